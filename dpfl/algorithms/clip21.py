"""The Clip21 family: Clip-SGD, Clip21-SGD, α-NormEC, Clip21-SGD2M and Clip21-SGD2M+
(specs/clip21-sgd2m.md; Islamov et al., "(Double) Momentum and Error Feedback for Clipping
with Fast Rates and Differential Privacy", numbering of the anonymous version 002).

One implementation, :class:`Clip21SGD2M` (Alg. 3, §2.2), carries every error-feedback method;
the others are it with constants fixed or a part swapped:

* ``clip21-sgd2m``: Alg. 3, client momentum β, clipped error feedback, EF/server step β̂;
* ``clip21-sgd``: Alg. 2 (§3.2), β = β̂ = 1;
* ``alpha-normec``: §3.4, β = 1 and the compressor Norm_α(u) = u/(α + ||u||) in place of clip_τ;
* ``clip21-sgd2m-plus``: Alg. 5 (§2.9), per-sample clipping at τ_in, noise inside the momentum;
* ``clip-sgd``: Alg. 1 (§3.1), stateless (:class:`ClipSGD`, sharing privacy, sampling and
  oracles through :class:`Clip21Family`); ``clipping="per-sample"`` is §3.5's DP-SGD baseline.

Every method of the family takes part in partial participation (Alg. 4, §2.8) through
``fraction-train``.

Order of operations (A-sync). Round r = 1, 2, … broadcasts the server's x, the clients take
their gradient at that x, and the server updates ``g ← g + (β̂/s)·Σ_i c_i``, then
``x ← x − γ g``. With the zero initial states of the algorithm box (``g⁰ = v⁰ = 0``) this is
Alg. 3 under both initialisations of §2.5:

* (a), the box: ``x¹ = x⁰ − γ·0 = x⁰``, so round r is iteration t = r − 1 (gradients at x^{t+1})
  and the model after round r is ``x^{r+1}``;
* (b), the proofs (A-init): round 1, at x⁰, computes ``v_i⁰ = β∇f_i(x⁰, ξ)``,
  ``g_i⁰ = β̂·clip_τ(β∇f_i(x⁰, ξ))`` and ``g⁰ = β̂·mean_i(c_i⁰)`` (the first message noised and
  counted as a release), then ``x¹ = x⁰ − γg⁰``; round r ≥ 2 is iteration t = r − 2.

The two differ only in indexing, so no initialisation option is needed; ``num-server-rounds`` T
is the number of releases (the paper's T iterations under (b) are T + 1 rounds).

Privacy (§4, §9 A1–A5). Replace-one neighbouring local datasets. Client-level methods release
one vector per round of norm ≤ τ (≤ 1 for Norm_α), so the sensitivity is 2τ (2 for α-NormEC,
with τ := 1: A-α-NormEC) and there is no amplification (sample rate 1), because v_i and g_i carry
private information across rounds. The per-sample forms (``clip21-sgd2m-plus``, ``clip-sgd``
with ``clipping="per-sample"``) release the DP-SGD query ``(1/b)Σ_j clip_r(∇f_ij) + ω`` (r = τ_in,
resp. τ), sensitivity 2r/b, at sample rate b/m; everything else they send is post-processing.

``noise-multiplier`` (Opacus convention, std over the clip radius of one clipped vector; for the
per-sample forms std on the *sum* over the batch divided by r) sets σ_ω = ``noise-multiplier``·τ
for client-level clipping (·1 for α-NormEC; it is 004's noise-clipping ratio σ_ω/τ) and
``noise-multiplier``·r/b on the per-sample mean. The ledger accounts std/sensitivity, i.e.
``noise-multiplier``/2. Otherwise ``calibration`` picks

* ``accountant``: the Opacus multiplier z for (ε, δ) over T steps at sample rate 1 (b/m for the
  per-sample forms), σ = z·sensitivity;
* ``paper``: :func:`~dpfl.privacy.clip21_paper_noise_std` (App. G) for the released vector's
  radius (r/b for the per-sample forms, without amplification);
* ``practice``: :func:`~dpfl.privacy.clip21_practice_noise_std`, the experiments' σ_ω (default
  for reproductions), rescaled by b/m for the per-sample forms (App. J.2: "we rescale the
  DP-noise variance σ_ω by a factor b/m"; applied to the standard deviation). Its T is the
  number of rounds, or of epochs (rounds/⌊m/b⌋) with ``practice-horizon="epochs"`` (§9 A4).

Partial participation (A3): the same σ as with full participation (calibrated over all T rounds,
an upper bound on a client's releases), and a client's ledger records only the rounds it took
part in. The server knows who is sampled, so sampling gives no amplification against it.

Gradients: the client-level methods use the mini-batch gradient of ``batch-size`` records drawn
without replacement each round; the per-sample forms draw a fixed-size batch too (A-plus; the
ledger uses Opacus' Poisson analysis at q = b/m, the proxy the README describes). Norms are
taken over the whole flattened model (global clipping, §2.6).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from dpfl.algorithms.base import Algorithm, Cohort, Release, State, StepContext
from dpfl.algorithms.registry import ALGORITHMS
from dpfl.config import Param, RunConfig, positive, unit_interval
from dpfl.privacy import (
    SERVER,
    Randomness,
    accountant_noise_multiplier,
    clip21_paper_noise_std,
    clip21_practice_noise_std,
    clip_factors,
)

if TYPE_CHECKING:
    from dpfl.models import FlatModel

Metrics = dict[str, Tensor]

PARAMS: dict[str, Param] = {p.key: p for p in (
    Param("beta", 0.1, "Client heavy-ball momentum of Clip21-SGD2M(+) (Alg. 3/5 line 5).",
          check=unit_interval, symbol="β"),
    Param("beta-hat", 1.0, "Error-feedback and server step of Clip21-SGD2M(+) and α-NormEC "
          "(Alg. 3 lines 8 and 10).", check=unit_interval, symbol="β̂"),
    Param("normec-alpha", 1.0, "α of α-NormEC's compressor Norm_α(u) = u/(α + ||u||) (§3.4).",
          check=positive, symbol="α"),
    Param("normec-normalize", False, "α-NormEC: rescale the server's g to unit norm after "
          "each update, before the step, and keep it so (the related public code's `normalize` "
          "switch; §3.4 leaves it off)."),
    Param("fraction-train", 1.0, "Fraction of clients sampled each round, s = round(fraction·n) "
          "uniformly without replacement (Alg. 4).", check=unit_interval, symbol="s/n"),
    Param("pp-scaling", "printed", "Server scaling under partial participation: 'printed' "
          "β̂/s (Alg. 4 line 15) or 'n' β̂/n (keeps g = mean_i g_i without noise).",
          choices=("printed", "n")),
    Param("clip-inner", 0.1, "Per-sample clipping threshold of Clip21-SGD2M+ (Alg. 5 line 7); "
          "clip is its outer threshold.", check=positive, symbol="τ_in"),
    Param("clipping", "client", "Clip-SGD: clip each client's mini-batch gradient (Alg. 1) or "
          "each per-sample gradient (DP-SGD, §3.5).", choices=("client", "per-sample")),
    Param("practice-horizon", "rounds", "What T counts in calibration='practice', σ_ω = "
          "(τ/ε)·√(T·ln(1/δ)): 'rounds', the number of releases (§9 A1, A4), or 'epochs', "
          "passes over the local data, rounds/⌊m/b⌋ (the reading of Table 1's revealed cells and "
          "of the related public code: README).", choices=("rounds", "epochs"), symbol="T"),
    Param("gradient-noise", 0.0, "Std of Gaussian noise added to each client's mini-batch "
          "gradient: the 'Gaussian-added' stochastic oracle of E1 (§2.6, §9 D2); not DP noise.",
          check=lambda v: None if v >= 0 else f"must be >= 0, got {v}", symbol="σ"),
)}


FAMILY_KEYS = ("fraction-train", "pp-scaling", "practice-horizon")  # every method has these


def _params(*keys: str) -> tuple[Param, ...]:
    """The run-config keys of one method: its own ``keys`` and the family's."""
    return tuple(PARAMS[k] for k in (*keys, *FAMILY_KEYS))


# ---- compressors -------------------------------------------------------------------------------

def row_norms(vectors: Tensor) -> Tensor:
    """``[C]`` float64 ℓ2 norms of the rows of ``[C, d]``, one client at a time, so that a client's
    norm does not depend on how many clients share the call (Flower == engine bit for bit)."""
    return torch.stack([torch.linalg.vector_norm(row, dtype=torch.float64) for row in vectors])


@dataclass(frozen=True)
class Compressor:
    """A map whose output norm is at most ``bound(config)`` (the replace-one sensitivity of a
    message is twice that). ``factor(norms, config)`` scales each row: ``u = factor·diff``."""

    name: str
    factor: Callable[[Tensor, RunConfig], Tensor]
    bound: Callable[[RunConfig], float]


CLIP = Compressor(  # clip_τ(u) = min(1, τ/||u||)·u, eq. (4)
    "clip", lambda norms, cfg: clip_factors(norms, float(cfg["clip"])),
    lambda cfg: float(cfg["clip"]))
NORM_ALPHA = Compressor(  # Norm_α(u) = u/(α + ||u||), §3.4; ||Norm_α(u)|| < 1 for every α
    "norm-alpha", lambda norms, cfg: 1 / (float(cfg["normec-alpha"]) + norms),
    lambda cfg: 1.0)


def compress(compressor: Compressor, diff: Tensor, config: RunConfig) -> tuple[Tensor, Tensor]:
    """``(compressor(diff) [C, d], ||diff|| [C])``, computed in ``diff``'s own memory (the
    caller hands over a tensor it owns: no ``[C, d]`` temporary)."""
    norms = row_norms(diff)
    return diff.mul_(compressor.factor(norms, config).to(diff.dtype).unsqueeze(-1)), norms


# ---- the shared part: privacy, sampling, gradient oracles --------------------------------------

class Clip21Family(Algorithm):
    """What every method of the family shares: calibration of the client's Gaussian release,
    client sampling (Alg. 4), the server's average, and the two gradient oracles."""

    calibrations = ("accountant", "paper", "practice")

    def __init__(self, config: RunConfig, model: FlatModel) -> None:
        super().__init__(config, model)
        self.batch_size = int(config["batch-size"])
        self.gamma = float(config["learning-rate"])
        self.num_clients = int(config["num-partitions"])

    # ---- privacy -----------------------------------------------------------------------------
    @abstractmethod
    def per_sample(self) -> bool:
        """Whether the release is the per-sample DP-SGD query (else the client's message)."""

    @abstractmethod
    def radius(self) -> float:
        """Norm bound r of one clipped vector of the release (τ, τ_in or 1)."""

    def sensitivity(self) -> float:
        """Replace-one ℓ2 sensitivity of the released query: 2r, or 2r/b per sample."""
        return 2 * self.radius() / (self.batch_size if self.per_sample() else 1)

    def releases(self, num_samples: int) -> list[Release]:
        cfg = self.config
        q = self.batch_size / num_samples if self.per_sample() else 1.0
        rounds, eps, delta = int(cfg["num-server-rounds"]), float(cfg["epsilon"]), float(
            cfg["delta"])
        if cfg["noise-multiplier"] >= 0:
            z = float(cfg["noise-multiplier"]) / 2  # Opacus convention (std / r) -> replace-one
        elif cfg["calibration"] == "accountant":
            z = accountant_noise_multiplier(epsilon=eps, delta=delta, sample_rate=q,
                                            steps=rounds, accountant=str(cfg["accountant"]))
        elif cfg["calibration"] == "paper":
            z = clip21_paper_noise_std(epsilon=eps, delta=delta, rounds=rounds,
                                       clip=self.sensitivity() / 2) / self.sensitivity()
        else:  # practice, T per practice-horizon
            horizon = rounds if cfg["practice-horizon"] == "rounds" else rounds / max(
                1, num_samples // self.batch_size)
            z = q * clip21_practice_noise_std(epsilon=eps, delta=delta, rounds=horizon,
                                              clip=self.radius()) / self.sensitivity()
        return [Release("train", noise_multiplier=z, sample_rate=q, steps=1)]

    def add_noise(self, messages: Tensor, cohort: Cohort, ctx: StepContext) -> Tensor:
        """``messages + ω`` in place, ω ~ N(0, σ² I_d) per client, σ = z·sensitivity. The
        messages of every method but Clip21-SGD2M+ reach the model only through the server's
        average and never feed client state, so the engine's ``engine-mode="fast"`` may pool
        their noise (:meth:`StepContext.add_noise`)."""
        std = ctx.noise_multiplier("train") * self.sensitivity()
        return ctx.add_noise(messages, cohort, std, poolable=not self.noise_feeds_state())

    def noise_feeds_state(self) -> bool:
        """Whether the noised query feeds client state (Clip21-SGD2M+'s momentum)."""
        return False

    # ---- partial participation (Alg. 4) ------------------------------------------------------
    def participants(self, round: int, clients: list[int], rng: Randomness) -> list[int]:
        """s = round(fraction-train·n) clients (at least 1), uniformly without replacement from
        the server's stream, sorted; all clients when fraction-train = 1."""
        s = max(1, math.floor(float(self.config["fraction-train"]) * len(clients) + 0.5))
        if s >= len(clients):
            return list(clients)
        order = torch.randperm(len(clients), generator=rng.generator(SERVER, round, "participants"))
        return sorted(clients[i] for i in order[:s].tolist())

    def average(self, messages: Tensor) -> Tensor:
        """(1/s)·Σ_{i∈S} c_i as printed (Alg. 4 line 15), or (1/n)·Σ with pp-scaling = 'n'."""
        if self.config["pp-scaling"] == "n" and len(messages) < self.num_clients:
            return messages.sum(dim=0) / self.num_clients
        return messages.mean(dim=0)

    # ---- gradient oracles --------------------------------------------------------------------
    def batch(self, cohort: Cohort, ctx: StepContext) -> tuple[Tensor, Tensor]:
        xb, yb = cohort.sample(ctx.rng, ctx.round, "batch", self.batch_size)
        return xb.to(ctx.device), yb.to(ctx.device)

    def gradient(self, x: Tensor, cohort: Cohort, ctx: StepContext) -> tuple[Tensor, Metrics]:
        """``∇f_i(x, ξ_i)``: each client's mini-batch gradient ``[C, d]`` (and its loss), plus
        N(0, σ²I) with σ = ``gradient-noise`` (the Gaussian-added oracle of E1)."""
        xb, yb = self.batch(cohort, ctx)
        losses = torch.empty(len(cohort), self.batch_size, device=ctx.device)
        grads = self.model.batch_gradients(x, xb, yb, losses=losses)
        if (sigma := float(self.config["gradient-noise"])) > 0:  # the Gaussian-added oracle
            grads = grads + ctx.rng.normal(cohort.ids, ctx.round, "oracle", (self.model.d,),
                                           torch.full((len(cohort),), sigma), device=ctx.device)
        return grads, {"train-loss": losses.mean(dim=1).cpu()}

    def private_mean(self, x: Tensor, cohort: Cohort, ctx: StepContext) -> tuple[Tensor, Metrics]:
        """The DP-SGD query ``(1/b)Σ_{j∈S_i} clip_r(∇f_ij(x)) + ω_i`` ``[C, d]`` (Alg. 5 line 7,
        §3.5), r = ``radius()``, σ = z·2r/b."""
        xb, yb = self.batch(cohort, ctx)
        losses = torch.empty(len(cohort), self.batch_size, device=ctx.device)
        mean, norms = self.model.clipped_mean(x, xb, yb, self.radius(), losses=losses)
        metrics = {"train-loss": losses.mean(dim=1).cpu(),
                   "clipped-fraction": (norms > self.radius()).float().mean(dim=1).cpu()}
        return self.add_noise(mean, cohort, ctx), metrics


# ---- Clip21-SGD2M and its special cases ---------------------------------------------------------

@ALGORITHMS.register_class
class Clip21SGD2M(Clip21Family):
    """Clip21-SGD2M (Alg. 3, §2.2), its partial-participation form (Alg. 4, §2.8), and the
    template of Clip21-SGD, α-NormEC and Clip21-SGD2M+.

    Client i (state ``v_i``, ``g_i``, zero at the start)::

        v_i ← (1 − β) v_i + β ∇f_i(x, ξ_i)          line 5 (Alg. 5: the noisy per-sample query)
        u_i = C(v_i − g_i)                           C = clip_τ (eq. 4) or Norm_α (§3.4)
        c_i = u_i + ω_i                              line 7, the message (Alg. 5: c_i = u_i)
        g_i ← g_i + β̂ u_i                            line 8, the same u_i, noise-free

    Server (state ``x``, ``g``): ``g ← g + β̂·average(c)`` (line 10; Alg. 4 line 15), then
    ``x ← x − γ g`` (line 3 of the next iteration; see the module docstring for the order).

    Class constants make the variants: ``fixed`` overrides run-config keys (β, β̂),
    ``compressor`` picks C, ``noise_in_momentum`` selects Alg. 5. ``v_i`` is kept only when
    β < 1 (with β = 1 it is the fresh gradient). Idle clients under partial participation keep
    their state (Alg. 4 lines 11–14): the runtimes only pass participants' states.

    Metrics per client: ``train-loss``; ``clip-active`` (1 if ||v_i − g_i|| > τ, so its round
    mean is |I_t|/n of §2.7; clip_τ only); ``clip-input-norm`` ||v_i − g_i||; ``ef-residual``
    ||g_i − v_i||² after the step (the Lyapunov term of §2.7); Alg. 5 adds ``clipped-fraction``
    (per-sample clipping at τ_in).
    """

    name = "clip21-sgd2m"
    params = _params("beta", "beta-hat", "gradient-noise")
    protection = ("record-level local DP per client (replace-one neighbours; any change of the "
                  "client's data): one clipped message of sensitivity 2τ per round, client-side "
                  "Gaussian noise, no amplification")
    fixed: ClassVar[dict[str, float]] = {}
    compressor: ClassVar[Compressor] = CLIP
    noise_in_momentum: ClassVar[bool] = False

    def __init__(self, config: RunConfig, model: FlatModel) -> None:
        super().__init__(config, model)
        self.beta = float(self.fixed.get("beta", config["beta"]))
        self.beta_hat = float(self.fixed.get("beta-hat", config["beta-hat"]))

    def per_sample(self) -> bool:
        return self.noise_in_momentum

    def radius(self) -> float:
        return float(self.config["clip-inner"]) if self.per_sample() else self.compressor.bound(
            self.config)

    # ---- server ------------------------------------------------------------------------------
    def init_server_state(self, x0: Tensor) -> State:
        return {"x": x0.clone(), "g": torch.zeros_like(x0)}

    def server_step(self, exchange: str, state: State, uploads: State,
                    participants: list[int], round: int) -> State:
        g = self.server_direction(state["g"] + self.beta_hat * self.average(uploads["c"]))
        return {"x": state["x"] - self.gamma * g, "g": g}

    def server_direction(self, g: Tensor) -> Tensor:
        """The server's g after line 10, as kept and stepped along (α-NormEC may normalise)."""
        return g

    # ---- client ------------------------------------------------------------------------------
    def init_client_state(self, num_clients: int) -> State:
        keys = ("v", "g") if self.beta < 1 else ("g",)
        return {k: torch.zeros(num_clients, self.model.d) for k in keys}

    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: StepContext) -> tuple[State, State, Metrics]:
        x = broadcast["x"].to(ctx.device)
        if self.noise_in_momentum:
            fresh, metrics = self.private_mean(x, cohort, ctx)
        else:
            fresh, metrics = self.gradient(x, cohort, ctx)
        g = states["g"].to(ctx.device)
        # the caller's states are read, never written; `fresh` is ours and becomes v
        v = fresh if self.beta == 1 else torch.lerp(states["v"].to(ctx.device), fresh,
                                                    self.beta, out=fresh)  # line 5
        u, norms = compress(self.compressor, v - g, self.config)  # u = C(v − g)
        g = torch.add(g, u, alpha=self.beta_hat)  # line 8
        message = u if self.noise_in_momentum else self.add_noise(u, cohort, ctx)  # line 7
        metrics["clip-input-norm"] = norms.float().cpu()
        if self.compressor is CLIP:
            metrics["clip-active"] = (norms > float(self.config["clip"])).float().cpu()
        # ||g_i − v_i||² after the step = ||(1 − β̂·factor)(v − g)||² (the Lyapunov term, §2.7)
        factor = self.compressor.factor(norms, self.config)
        metrics["ef-residual"] = (norms * (1 - self.beta_hat * factor)).square().float().cpu()
        new = {"g": g.cpu(), "v": v.cpu()} if self.beta < 1 else {"g": g.cpu()}
        return {"c": message.cpu()}, new, metrics


@ALGORITHMS.register_class
class Clip21SGD(Clip21SGD2M):
    """Clip21-SGD (Alg. 2, §3.2; Khirirat et al. 2023): Clip21-SGD2M with β = β̂ = 1, i.e.
    ``c_i = clip_τ(∇f_i(x, ξ) − g_i) + ω_i``, ``g_i ← g_i + clip_τ(·)``, ``g ← g + mean(c)``.
    The run-config keys ``beta`` and ``beta-hat`` are ignored. With the whole local dataset as
    the batch it is Clip21-GD."""

    name = "clip21-sgd"
    params = _params("gradient-noise")
    fixed = {"beta": 1.0, "beta-hat": 1.0}


@ALGORITHMS.register_class
class AlphaNormEC(Clip21SGD2M):
    """α-NormEC-SGD (§3.4; Shulgin et al. 2025a): β = 1 and ``Norm_α(u) = u/(α + ||u||)`` in
    place of clip_τ: ``Δ_i = Norm_α(∇f_i(x, ξ) − g_i)``, ``g_i ← g_i + β̂Δ_i``, message
    ``Δ_i + ω_i``, ``g ← g + β̂·mean``. ``||Norm_α(·)|| < 1``, so the sensitivity is 2 for any α
    and the noise is calibrated with τ := 1 (A-α-NormEC); ``clip`` is unused. ``beta`` is
    ignored; α is ``normec-alpha``. ``normec-normalize`` switches on the related code's server
    normalisation, ``g ← g/||g||`` after line 10 (kept normalised, so the next round adds to a
    unit vector), then ``x ← x − γg``; off by default (§3.4). Post-processing of the noisy
    messages: the privacy is unchanged."""

    name = "alpha-normec"
    params = _params("beta-hat", "normec-alpha", "normec-normalize", "gradient-noise")
    protection = ("record-level local DP per client (replace-one neighbours): one message of "
                  "norm < 1 (sensitivity 2) per round, client-side Gaussian noise, "
                  "no amplification")
    fixed = {"beta": 1.0}
    compressor = NORM_ALPHA

    def server_direction(self, g: Tensor) -> Tensor:
        if not self.config["normec-normalize"]:
            return g
        norm = torch.linalg.vector_norm(g, dtype=torch.float64)
        return g / norm.clamp_min(1e-10).to(g.dtype)


@ALGORITHMS.register_class
class Clip21SGD2MPlus(Clip21SGD2M):
    """Clip21-SGD2M+ (Alg. 5, §2.9): the momentum absorbs the DP-SGD query,
    ``v_i ← (1 − β)v_i + β((1/b)Σ_j clip_{τ_in}(∇f_ij(x)) + ω_i)``, and the message
    ``c_i = clip_τ(v_i − g_i)`` carries no fresh noise, so ``g = mean_i g_i`` exactly.
    ``clip`` is τ_out, ``clip-inner`` τ_in. Privacy: the per-sample query at sample rate b/m
    (fixed-size batches without replacement, A-plus), everything else post-processing."""

    name = "clip21-sgd2m-plus"
    params = _params("beta", "beta-hat", "clip-inner")
    protection = ("record-level local DP per client (replace-one neighbours): per-sample "
                  "clipping at clip-inner, client-side Gaussian noise inside the momentum, "
                  "sampling amplification at rate b/m")
    noise_in_momentum = True

    def noise_feeds_state(self) -> bool:
        return True  # the noisy query enters v_i: its noise must stay per client


# ---- Clip-SGD ------------------------------------------------------------------------------------

@ALGORITHMS.register_class
class ClipSGD(Clip21Family):
    """Clip-SGD (Alg. 1, §3.1; "DP-SGD" of the papers' experiments): stateless,
    ``c_i = clip_τ(∇f_i(x, ξ_i)) + ω_i``, ``x ← x − γ·mean(c)``. With ``clipping="per-sample"``
    it is §3.5's DP-SGD baseline, ``c_i = (1/b)Σ_j clip_τ(∇f_ij(x)) + ω_i`` (sensitivity 2τ/b,
    sample rate b/m). With full gradients it is Clip-GD (Example 2.1: any x⁰ ∈ [−2, 2] is a
    fixed point). Metrics: ``train-loss``; client clipping ``clip-active`` and
    ``clip-input-norm`` (of the mini-batch gradient); per-sample ``clipped-fraction``."""

    name = "clip-sgd"
    params = _params("clipping", "gradient-noise")
    protection = ("record-level local DP per client (replace-one neighbours): clipping='client' "
                  "clips the client's mini-batch gradient (sensitivity 2τ, no amplification); "
                  "'per-sample' is DP-SGD (sensitivity 2τ/b, sample rate b/m); client-side "
                  "Gaussian noise")

    def per_sample(self) -> bool:
        return self.config["clipping"] == "per-sample"

    def radius(self) -> float:
        return float(self.config["clip"])

    def server_step(self, exchange: str, state: State, uploads: State,
                    participants: list[int], round: int) -> State:
        return {"x": state["x"] - self.gamma * self.average(uploads["c"])}

    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: StepContext) -> tuple[State, State, Metrics]:
        x = broadcast["x"].to(ctx.device)
        if self.per_sample():
            message, metrics = self.private_mean(x, cohort, ctx)
            return {"c": message.cpu()}, states, metrics
        grads, metrics = self.gradient(x, cohort, ctx)
        message, norms = compress(CLIP, grads, self.config)
        message = self.add_noise(message, cohort, ctx)
        metrics["clip-active"] = (norms > self.radius()).float().cpu()
        metrics["clip-input-norm"] = norms.float().cpu()
        return {"c": message.cpu()}, states, metrics


__all__ = ["AlphaNormEC", "CLIP", "Clip21Family", "Clip21SGD", "Clip21SGD2M", "Clip21SGD2MPlus",
           "ClipSGD", "Compressor", "NORM_ALPHA", "PARAMS", "compress", "row_norms"]
