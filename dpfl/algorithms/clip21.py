"""The Clip21 family: Clip-SGD, Clip21-SGD, α-NormEC, Clip21-SGD2M and Clip21-SGD2M+.

Islamov, Horváth, Lucchi, Richtárik, Gorbunov, "Double Momentum and Error Feedback for Clipping
with Fast Rates and Differential Privacy", arXiv:2502.11682. Algorithm, section, appendix and
table numbers are those of the ICLR 2026 submission "Momentum and Error Feedback for Clipping
with Fast Rates and Differential Privacy" (OpenReview dX1yxeQOF3), which adds α-NormEC,
partial participation (Alg. 4), Clip21-SGD2M+ (Alg. 5) and the ε-calibrated experiments.

One implementation, :class:`Clip21SGD2M` (Alg. 3), carries every error-feedback method;
the others are it with constants fixed or a part swapped:

* ``clip21-sgd2m``: Alg. 3, client momentum β, clipped error feedback, EF/server step β̂;
* ``clip21-sgd``: Alg. 2, β = β̂ = 1;
* ``alpha-normec`` (Shulgin et al. 2025, a baseline of App. I.2.2): β = 1 and the compressor
  Norm_α(u) = u/(α + ||u||) in place of clip_τ;
* ``clip21-sgd2m-plus``: Alg. 5 (App. J), per-sample clipping at τ_in, noise inside the momentum;
* ``clip-sgd``: Alg. 1, stateless (:class:`ClipSGD`, sharing privacy, sampling and
  oracles through :class:`Clip21Family`); ``clipping="per-sample"`` is App. J.2's DP-SGD baseline.

A fixed constant is a ``ClassVar`` of the method's hyperparameter dataclass, so the method does
not accept its key. Every method takes part in partial participation (Alg. 4, App. A) through
``fraction-train``.

Order of operations. Round r = 1, 2, … broadcasts the server's x, the clients take their
gradient at that x, and the server updates ``g ← g + (β̂/s)·Σ_i c_i``, then ``x ← x − γ g``.
With the zero initial states of the algorithm box (``g⁰ = v⁰ = 0``) this is Alg. 3 under both
initialisations the paper uses (its algorithm box, and its proofs):

* (a), the box: ``x¹ = x⁰ − γ·0 = x⁰``, so round r is iteration t = r − 1 (gradients at x^{t+1})
  and the model after round r is ``x^{r+1}``;
* (b), the proofs: round 1, at x⁰, computes ``v_i⁰ = β∇f_i(x⁰, ξ)``,
  ``g_i⁰ = β̂·clip_τ(β∇f_i(x⁰, ξ))`` and ``g⁰ = β̂·mean_i(c_i⁰)`` (the first message noised and
  counted as a release), then ``x¹ = x⁰ − γg⁰``; round r ≥ 2 is iteration t = r − 2.

The two differ only in indexing, so no initialisation option is needed; ``num-server-rounds`` T
is the number of releases (the paper's T iterations under (b) are T + 1 rounds).

Privacy (App. G). Replace-one neighbouring local datasets. Client-level methods release one
vector per round of norm ≤ τ (≤ 1 for Norm_α): radius τ (1 for α-NormEC, whose noise is
calibrated with τ := 1), no amplification (sample rate 1), because v_i and g_i carry private
information across rounds. The per-sample forms (``clip21-sgd2m-plus``, ``clip-sgd`` with
``clipping="per-sample"``) release the DP-SGD query ``(1/b)Σ_j clip_r(∇f_ij) + ω``, radius r/b
(r = τ_in, resp. τ), at sample rate b/m; everything else they send is post-processing.
``noise-multiplier`` sets σ_ω = ``noise-multiplier``·radius (the noise-clipping ratio σ_ω/τ of
the experiments with a noise-to-clip ratio). Otherwise ``calibration`` picks

* ``accountant``: the Opacus multiplier for (ε, δ) over T steps at the query's sample rate;
* ``paper``: :func:`clip21_paper_noise_std` (App. G) for the released vector's radius, without
  amplification;
* ``practice``: :func:`clip21_practice_noise_std`, the experiments' σ_ω (default for the
  reproductions), rescaled by b/m for the per-sample forms (App. J.2: "we rescale the DP-noise
  variance σ_ω by a factor b/m"; applied to the standard deviation). Its T is the number of
  rounds, or of epochs (rounds/⌊m/b⌋) with ``practice-horizon="epochs"``: the paper does not say
  which; docs/reproductions.md explains why the experiments most likely counted epochs.

Partial participation: the same σ as with full participation (calibrated over all T rounds, an
upper bound on a client's releases), and a client's ledger records only the rounds it took part
in. The server knows who is sampled, so sampling gives no amplification against it.

Gradients: the client-level methods use the mini-batch gradient of ``batch-size`` records drawn
without replacement each round; the per-sample forms draw a fixed-size batch too (the ledger
uses Opacus' Poisson analysis at q = b/m, the proxy docs/privacy.md describes) under replace-one
neighbours, and under add/remove (DPSGD-GC's ``relation``) a Poisson batch, each record with the
release's probability q = b/m, the sum still divided by b (Abadi et al. 2016, §3.1): with a
fixed-size batch an added record would push another out. Norms are taken over the whole
flattened model (global clipping, as in the paper's experiments).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from dpfl.algorithms.base import (
    Algorithm,
    ClientContext,
    Cohort,
    Exchange,
    ServerContext,
    State,
    Upload,
    sample_clients,
    sample_size,
)
from dpfl.algorithms.registry import ALGORITHMS
from dpfl.config import (
    BATCH_SIZE,
    CLIP,
    CLIPPING_FUNCTION,
    CLIPPING_STABILITY,
    FRACTION_TRAIN,
    LEARNING_RATE,
    Param,
    hyperparameter,
    positive,
    unit_interval,
)
from dpfl.errors import ConfigError
from dpfl.models.rows import batch_shape, record_means
from dpfl.privacy import CALIBRATIONS, Query, Randomness, Target, clip_factors
from dpfl.privacy.clipping import PerSampleClipping

# ---- hyperparameters ---------------------------------------------------------------------------

BETA = Param("beta", 0.1, "Client heavy-ball momentum of Clip21-SGD2M(+) (Alg. 3/5 line 5).",
             check=unit_interval, symbol="β")
BETA_HAT = Param("beta-hat", 1.0, "Error-feedback and server step of Clip21-SGD2M(+) and "
                 "α-NormEC (Alg. 3 lines 8 and 10); \"auto\" = the algorithm's default.",
                 check=unit_interval, symbol="β̂", per_algorithm=True)
NORMEC_ALPHA = Param("normec-alpha", 1.0, "α of α-NormEC's compressor Norm_α(u) = u/(α + ||u||) "
                     "(Shulgin et al. 2025).", check=positive, symbol="α")
NORMEC_NORMALIZE = Param("normec-normalize", False, "α-NormEC: rescale the server's g to unit "
                         "norm after each update, before the step, and keep it so (the related "
                         "public code's `normalize` switch; off in the paper's description).")
PP_SCALING = Param("pp-scaling", "printed", "Server scaling under partial participation: "
                   "'printed' β̂/s (Alg. 4 line 15) or 'n' β̂/n (keeps g = mean_i g_i without "
                   "noise).", choices=("printed", "n"))
CLIP_INNER = Param("clip-inner", 0.1, "Per-sample clipping threshold of Clip21-SGD2M+ (Alg. 5 "
                   "line 7); clip is its outer threshold; \"auto\" = the algorithm's default.",
                   check=positive, symbol="τ_in", per_algorithm=True)
CLIPPING = Param("clipping", "client", "Clip-SGD: clip each client's mini-batch gradient "
                 "(Alg. 1) or each per-sample gradient (DP-SGD, App. J.2).",
                 choices=("client", "per-sample"))
GRADIENT_NOISE = Param("gradient-noise", 0.0, "Std of Gaussian noise added to each client's "
                       "mini-batch gradient: the 'Gaussian-added' stochastic oracle of the "
                       "logistic-regression experiment (App. I.1); not DP noise.",
                       check=lambda v: None if v >= 0 else f"must be >= 0, got {v}", symbol="σ")
PRACTICE_HORIZON = Param("practice-horizon", "rounds", "What T counts in calibration='practice', "
                         "σ_ω = (τ/ε)·√(T·ln(1/δ)): 'rounds', the number of releases, or "
                         "'epochs', passes over the local data, rounds/⌊m/b⌋ (the reading of "
                         "Table 1's revealed cells and of the related public code: "
                         "docs/reproductions.md).",
                         choices=("rounds", "epochs"), symbol="T")


@dataclass(frozen=True)
class Clip21Hyperparameters:
    """What every method of the family reads: b, γ and partial participation."""

    batch_size: int = hyperparameter(BATCH_SIZE)
    learning_rate: float = hyperparameter(LEARNING_RATE)  # γ
    fraction_train: float = hyperparameter(FRACTION_TRAIN)  # s/n
    pp_scaling: str = hyperparameter(PP_SCALING)


@dataclass(frozen=True)
class ClipSGDHyperparameters(Clip21Hyperparameters, PerSampleClipping):
    clip: float = hyperparameter(CLIP)  # τ
    clipping: str = hyperparameter(CLIPPING)
    clipping_function: str = hyperparameter(CLIPPING_FUNCTION)  # φ (per-sample only)
    clipping_stability: float = hyperparameter(CLIPPING_STABILITY)  # r
    gradient_noise: float = hyperparameter(GRADIENT_NOISE)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clipping == "per-sample" and self.gradient_noise > 0:
            raise ConfigError("gradient-noise", "applies to clipping='client' only: the "
                              "per-sample query uses no gradient oracle", allowed="0.0")
        if self.clipping == "client" and self.clipping_function != CLIPPING_FUNCTION.default:
            raise ConfigError("clipping-function", "applies to clipping='per-sample' only: "
                              "clipping='client' clips the client's gradient with clip_τ",
                              allowed=CLIPPING_FUNCTION.default)


@dataclass(frozen=True)
class Clip21SGDHyperparameters(Clip21Hyperparameters):
    clip: float = hyperparameter(CLIP)  # τ
    gradient_noise: float = hyperparameter(GRADIENT_NOISE)
    beta: ClassVar[float] = 1.0
    beta_hat: ClassVar[float] = 1.0


@dataclass(frozen=True)
class Clip21SGD2MHyperparameters(Clip21Hyperparameters):
    clip: float = hyperparameter(CLIP)  # τ
    beta: float = hyperparameter(BETA)
    beta_hat: float = hyperparameter(BETA_HAT)
    gradient_noise: float = hyperparameter(GRADIENT_NOISE)


@dataclass(frozen=True)
class Clip21SGD2MPlusHyperparameters(Clip21Hyperparameters, PerSampleClipping):
    clip: float = hyperparameter(CLIP)  # τ_out
    clip_inner: float = hyperparameter(CLIP_INNER)  # τ_in
    clipping_function: str = hyperparameter(CLIPPING_FUNCTION)  # φ at τ_in
    clipping_stability: float = hyperparameter(CLIPPING_STABILITY)  # r
    beta: float = hyperparameter(BETA)
    beta_hat: float = hyperparameter(BETA_HAT)
    gradient_noise: ClassVar[float] = 0.0


@dataclass(frozen=True)
class AlphaNormECHyperparameters(Clip21Hyperparameters):
    beta_hat: float = hyperparameter(BETA_HAT)
    normec_alpha: float = hyperparameter(NORMEC_ALPHA)
    normec_normalize: bool = hyperparameter(NORMEC_NORMALIZE)
    gradient_noise: float = hyperparameter(GRADIENT_NOISE)
    beta: ClassVar[float] = 1.0


@dataclass(frozen=True)
class PracticeOptions:
    """The run-config keys of ``calibration="practice"``."""

    practice_horizon: str = hyperparameter(PRACTICE_HORIZON)


# ---- compressors -------------------------------------------------------------------------------

def row_norms(vectors: Tensor) -> Tensor:
    """``[C]`` float64 ℓ2 norms of the rows of ``[C, d]``, one client at a time, so that a client's
    norm does not depend on how many clients share the call (Flower == engine bit for bit)."""
    return torch.stack([torch.linalg.vector_norm(row, dtype=torch.float64) for row in vectors])


@dataclass(frozen=True)
class Compressor:
    """A map whose output norm is at most ``bound(hp)`` (the radius of a message).
    ``factor(norms, hp)`` scales each row: ``u = factor·diff``."""

    name: str
    factor: Callable[[Tensor, Any], Tensor]
    bound: Callable[[Any], float]


CLIP_TAU = Compressor(  # clip_τ(u) = min(1, τ/||u||)·u, eq. (4)
    "clip", lambda norms, hp: clip_factors(norms, hp.clip), lambda hp: hp.clip)
NORM_ALPHA = Compressor(  # Norm_α(u) = u/(α + ||u||); ||Norm_α(u)|| < 1 for every α
    "norm-alpha", lambda norms, hp: 1 / (hp.normec_alpha + norms), lambda hp: 1.0)


def compress(compressor: Compressor, diff: Tensor, hp: Any) -> tuple[Tensor, Tensor]:
    """``(compressor(diff) [C, d], ||diff|| [C])``, computed in ``diff``'s own memory (the
    caller hands over a tensor it owns: no ``[C, d]`` temporary)."""
    norms = row_norms(diff)
    return diff.mul_(compressor.factor(norms, hp).to(diff.dtype).unsqueeze(-1)), norms


# ---- the shared part: privacy, sampling, gradient oracles --------------------------------------

class Clip21Family(Algorithm[Clip21Hyperparameters]):
    """What every method of the family shares: the client's Gaussian release, client sampling
    (Alg. 4), the server's average, and the two gradient oracles."""

    exchanges = (Exchange("train", ("x",), {"c": Upload("message")}),)
    per_client_broadcast = True
    server_keys = ("learning-rate", "fraction-train", "pp-scaling")

    # ---- privacy -----------------------------------------------------------------------------
    @abstractmethod
    def per_sample(self) -> bool:
        """Whether the release is the per-sample DP-SGD query (else the client's message)."""

    @abstractmethod
    def radius(self) -> float:
        """Norm bound r of one clipped vector of the release (τ, τ_in or 1)."""

    def release(self) -> str:
        """The name of the round's one release (the upload's)."""
        return next(iter(self.exchanges[0].uploads.values())).release

    def queries(self, num_samples: int) -> list[Query]:
        """One release per round: the message (radius r, no amplification), or the per-sample
        query (radius r/b, sample rate b/m)."""
        name = self.release()
        if self.per_sample():
            b = self.hp.batch_size
            return [Query(name, "train", radius=self.radius() / b, relation=self.relation,
                          sample_rate=b / num_samples)]
        return [Query(name, "train", radius=self.radius(), relation=self.relation)]

    # ---- partial participation (Alg. 4) ------------------------------------------------------
    @classmethod
    def participants_per_round(cls, hp: Clip21Hyperparameters, num_clients: int) -> int:
        return sample_size(hp.fraction_train, num_clients)

    def participants(self, server_round: int, clients: list[int], rng: Randomness) -> list[int]:
        """s = round(fraction-train·n) clients (at least 1), uniformly without replacement from
        the server's stream, sorted; all clients when fraction-train = 1."""
        return sample_clients(self.hp.fraction_train, server_round, clients, rng)

    def average(self, total: Tensor, ctx: ServerContext) -> Tensor:
        """(1/s)·Σ_{i∈S} c_i as printed (Alg. 4 line 15), or (1/n)·Σ with pp-scaling = 'n'."""
        s = len(ctx.participants)
        if self.hp.pp_scaling == "n" and s < ctx.num_clients:
            return total / ctx.num_clients
        return total / s

    # ---- gradient oracles --------------------------------------------------------------------
    def batch(self, cohort: Cohort, ctx: ClientContext) -> tuple[Tensor, Tensor]:
        xb, yb = cohort.sample(ctx.rng, ctx.server_round, "batch", self.hp.batch_size)
        return xb.to(ctx.device), yb.to(ctx.device)

    def losses(self, cohort: Cohort, ctx: ClientContext) -> Tensor | None:
        """Where a gradient oracle writes its per-sample losses (diagnostics only)."""
        if not ctx.diagnosing:
            return None
        return torch.empty(len(cohort), self.hp.batch_size, device=ctx.device)

    def gradient(self, x: Tensor, cohort: Cohort, ctx: ClientContext) -> Tensor:
        """``∇f_i(x, ξ_i)``: each client's mini-batch gradient ``[C, d]``, plus N(0, σ²I) with
        σ = ``gradient-noise`` (the Gaussian-added oracle of the logistic-regression runs)."""
        xb, yb = self.batch(cohort, ctx)
        losses = self.losses(cohort, ctx)
        grads = self.model.batch_gradients(x, xb, yb, losses=losses)
        if losses is not None:
            ctx.diagnose("train-loss", losses.mean(dim=1))
        if (sigma := self.hp.gradient_noise) > 0:  # the Gaussian-added oracle
            grads = grads + ctx.rng.normal(cohort.ids, ctx.server_round, "oracle", (self.model.d,),
                                           torch.full((len(cohort),), sigma), device=ctx.device)
        return grads

    def clipped_mean(self, x: Tensor, cohort: Cohort, ctx: ClientContext) -> Tensor:
        """The DP-SGD query before its noise, ``(1/b)Σ_{j∈S_i} clip_r(∇f_ij(x))`` ``[C, d]``
        (Alg. 5 line 7, App. J.2), r = ``radius()``, clip_r the ``clipping-function``'s φ_r,
        over each client's batch S_i as the relation needs it (:meth:`Cohort.draw`: Poisson
        sampling under add/remove). Only the per-sample forms call it, whose hyperparameters
        are :class:`~dpfl.privacy.clipping.PerSampleClipping`."""
        r = self.radius()
        clipping = self.hp.per_sample_clipping

        def clipped(xb: Tensor, yb: Tensor, x: Tensor, *, lengths: list[int] | None,
                    divisor: int) -> tuple[Tensor, ...]:
            losses = (torch.empty(batch_shape(yb, lengths), device=ctx.device)
                      if ctx.diagnosing else None)
            mean, norms = self.model.clipped_mean(x, xb, yb, r, losses=losses, lengths=lengths,
                                                  divisor=divisor, clipping=clipping)
            if losses is None:
                return (mean,)
            return (mean, record_means(losses, lengths),
                    record_means((norms > r).float(), lengths))

        batches = cohort.draw(ctx, "batch", self.release(), self.hp.batch_size)
        empty = (x.new_zeros(self.model.d),) + (x.new_zeros(()),) * (2 if ctx.diagnosing else 0)
        mean, *diagnostics = batches.means(clipped, x, empty=empty, device=ctx.device)
        if diagnostics:
            ctx.diagnose("train-loss", diagnostics[0])
            ctx.diagnose("clipped-fraction", diagnostics[1])
        return mean


# ---- Clip21-SGD2M and its special cases ---------------------------------------------------------

@ALGORITHMS.register_class
class Clip21SGD2M(Clip21Family):
    """Clip21-SGD2M (Alg. 3), its partial-participation form (Alg. 4, App. A), and the
    template of Clip21-SGD, α-NormEC and Clip21-SGD2M+.

    Client i (state ``v_i``, ``g_i``, zero at the start)::

        v_i ← (1 − β) v_i + β ∇f_i(x, ξ_i)          line 5 (Alg. 5: the noisy per-sample query)
        u_i = C(v_i − g_i)                           C = clip_τ (eq. 4) or Norm_α
        c_i = u_i + ω_i                              line 7, the message (Alg. 5: c_i = u_i)
        g_i ← g_i + β̂ u_i                            line 8, the same u_i, noise-free

    ``client_step`` returns u_i; the runtime adds ω_i. Server (state ``x``, ``g``):
    ``g ← g + β̂·average(c)`` (line 10; Alg. 4 line 15), then ``x ← x − γ g`` (line 3 of the
    next iteration; see the module docstring for the order).

    ``compressor`` picks C and ``noise_in_momentum`` selects Alg. 5. ``v_i`` is kept only when
    β < 1 (with β = 1 it is the fresh gradient). Idle clients under partial participation keep
    their state (Alg. 4 lines 11–14): the runtimes only pass participants' states.

    Diagnostics per client (non-private mode only): ``train-loss``; ``clip-active`` (1 if
    ||v_i − g_i|| > τ, so its round mean is the fraction of clients whose clipping is active;
    clip_τ only); ``clip-input-norm`` ||v_i − g_i||; ``ef-residual`` ||g_i − v_i||² after the
    step (the error-feedback term of the Lyapunov function, eq. (9)); Alg. 5 adds
    ``clipped-fraction`` (per-sample clipping at τ_in).
    """

    name = "clip21-sgd2m"
    defaults = {"learning-rate": 0.01, "clip": 0.01}  # docs/defaults.md
    Hyperparameters = Clip21SGD2MHyperparameters
    protection = ("record-level local DP per client (replace-one neighbours; any change of the "
                  "client's data): one clipped message of sensitivity 2τ per round, client-side "
                  "Gaussian noise, no amplification")
    compressor: ClassVar[Compressor] = CLIP_TAU
    noise_in_momentum: ClassVar[bool] = False

    def per_sample(self) -> bool:
        return self.noise_in_momentum

    def radius(self) -> float:
        return self.hp.clip_inner if self.per_sample() else self.compressor.bound(self.hp)

    # ---- server ------------------------------------------------------------------------------
    def init_server_state(self, x0: Tensor) -> State:
        return {"x": x0.clone(), "g": torch.zeros_like(x0)}

    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        g = self.server_direction(state["g"] + self.hp.beta_hat * self.average(sums["c"], ctx))
        return {"x": state["x"] - self.hp.learning_rate * g, "g": g}

    def server_direction(self, g: Tensor) -> Tensor:
        """The server's g after line 10, as kept and stepped along (α-NormEC may normalise)."""
        return g

    # ---- client ------------------------------------------------------------------------------
    def init_client_state(self, num_clients: int) -> State:
        keys = ("v", "g") if self.hp.beta < 1 else ("g",)
        return {k: torch.zeros(num_clients, self.model.d) for k in keys}

    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: ClientContext) -> tuple[State, State]:
        hp = self.hp
        x = broadcast["x"].to(ctx.device)
        if self.noise_in_momentum:
            fresh = ctx.privatize("gradient", self.clipped_mean(x, cohort, ctx))
        else:
            fresh = self.gradient(x, cohort, ctx)
        g = states["g"].to(ctx.device)
        # the caller's states are read, never written; `fresh` is ours and becomes v
        v = fresh if hp.beta == 1 else torch.lerp(states["v"].to(ctx.device), fresh, hp.beta,
                                                  out=fresh)  # line 5
        u, norms = compress(self.compressor, v - g, hp)  # u = C(v − g)
        g = torch.add(g, u, alpha=hp.beta_hat)  # line 8
        if ctx.diagnosing:
            ctx.diagnose("clip-input-norm", norms)
            if self.compressor is CLIP_TAU:
                ctx.diagnose("clip-active", (norms > hp.clip).float())
            # ||g_i − v_i||² after the step = ||(1 − β̂·factor)(v − g)||² (the Lyapunov term)
            factor = self.compressor.factor(norms, hp)
            ctx.diagnose("ef-residual", (norms * (1 - hp.beta_hat * factor)).square())
        new = {"g": g.cpu(), "v": v.cpu()} if hp.beta < 1 else {"g": g.cpu()}
        return {"c": u.cpu()}, new


@ALGORITHMS.register_class
class Clip21SGD(Clip21SGD2M):
    """Clip21-SGD (Alg. 2; Khirirat et al. 2023): Clip21-SGD2M with β = β̂ = 1, i.e.
    ``c_i = clip_τ(∇f_i(x, ξ) − g_i) + ω_i``, ``g_i ← g_i + clip_τ(·)``, ``g ← g + mean(c)``.
    With the whole local dataset as the batch it is Clip21-GD."""

    name = "clip21-sgd"
    Hyperparameters = Clip21SGDHyperparameters


@ALGORITHMS.register_class
class AlphaNormEC(Clip21SGD2M):
    """α-NormEC-SGD (Shulgin et al. 2025, arXiv:2502.13482): β = 1 and
    ``Norm_α(u) = u/(α + ||u||)`` in place of clip_τ:
    ``Δ_i = Norm_α(∇f_i(x, ξ) − g_i)``, ``g_i ← g_i + β̂Δ_i``, message ``Δ_i + ω_i``,
    ``g ← g + β̂·mean``. ``||Norm_α(·)|| < 1``, so the sensitivity is 2 for any α and the noise
    is calibrated with τ := 1; it has no ``clip``. α is ``normec-alpha``. ``normec-normalize``
    switches on the related code's server normalisation, ``g ← g/||g||`` after line 10 (kept
    normalised, so the next round adds to a unit vector), then ``x ← x − γg``; off by default.
    Post-processing of the noisy messages: the privacy is unchanged."""

    name = "alpha-normec"
    defaults = {"learning-rate": 0.01, "beta-hat": 0.01}  # docs/defaults.md
    Hyperparameters = AlphaNormECHyperparameters
    protection = ("record-level local DP per client (replace-one neighbours): one message of "
                  "norm < 1 (sensitivity 2) per round, client-side Gaussian noise, "
                  "no amplification")
    compressor = NORM_ALPHA

    def server_direction(self, g: Tensor) -> Tensor:
        if not self.hp.normec_normalize:
            return g
        norm = torch.linalg.vector_norm(g, dtype=torch.float64)
        return g / norm.clamp_min(1e-10).to(g.dtype)


@ALGORITHMS.register_class
class Clip21SGD2MPlus(Clip21SGD2M):
    """Clip21-SGD2M+ (Alg. 5, App. J): the momentum absorbs the DP-SGD query,
    ``v_i ← (1 − β)v_i + β((1/b)Σ_j clip_{τ_in}(∇f_ij(x)) + ω_i)``, and the message
    ``c_i = clip_τ(v_i − g_i)`` carries no fresh noise (post-processing of the noisy query), so
    ``g = mean_i g_i`` exactly. ``clip`` is τ_out, ``clip-inner`` τ_in. Privacy: the per-sample
    query at sample rate b/m (fixed-size batches without replacement), everything else
    post-processing."""

    name = "clip21-sgd2m-plus"
    defaults = {"clip-inner": 1.0}  # docs/defaults.md
    Hyperparameters = Clip21SGD2MPlusHyperparameters
    exchanges = (Exchange("train", ("x",), {"c": Upload("gradient", post_processing=True)}),)
    protection = ("record-level local DP per client (replace-one neighbours): per-sample "
                  "clipping at clip-inner, client-side Gaussian noise inside the momentum, "
                  "sampling amplification at rate b/m")
    noise_in_momentum = True


# ---- Clip-SGD ------------------------------------------------------------------------------------

@ALGORITHMS.register_class
class ClipSGD(Clip21Family):
    """Clip-SGD (Alg. 1; "DP-SGD" of the papers' experiments): stateless,
    ``c_i = clip_τ(∇f_i(x, ξ_i)) + ω_i``, ``x ← x − γ·mean(c)``. With ``clipping="per-sample"``
    it is App. J.2's DP-SGD baseline, ``c_i = (1/b)Σ_j clip_τ(∇f_ij(x)) + ω_i`` (sensitivity 2τ/b,
    sample rate b/m). With full gradients it is Clip-GD (Example 2.1: any x⁰ ∈ [−2, 2] is a
    fixed point). Diagnostics: ``train-loss``; client clipping ``clip-active`` and
    ``clip-input-norm`` (of the mini-batch gradient); per-sample ``clipped-fraction``."""

    name = "clip-sgd"
    defaults = {"learning-rate": 0.1, "clip": 0.03}  # docs/defaults.md
    Hyperparameters = ClipSGDHyperparameters
    protection = ("record-level local DP per client (replace-one neighbours): clipping='client' "
                  "clips the client's mini-batch gradient (sensitivity 2τ, no amplification); "
                  "'per-sample' is DP-SGD (sensitivity 2τ/b, sample rate b/m); client-side "
                  "Gaussian noise")

    def per_sample(self) -> bool:
        return self.hp.clipping == "per-sample"

    def radius(self) -> float:
        return self.hp.clip

    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        return {"x": state["x"] - self.hp.learning_rate * self.average(sums["c"], ctx)}

    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: ClientContext) -> tuple[State, State]:
        x = broadcast["x"].to(ctx.device)
        if self.per_sample():
            return {"c": self.clipped_mean(x, cohort, ctx).cpu()}, states
        message, norms = compress(CLIP_TAU, self.gradient(x, cohort, ctx), self.hp)
        if ctx.diagnosing:
            ctx.diagnose("clip-active", (norms > self.radius()).float())
            ctx.diagnose("clip-input-norm", norms)
        return {"c": message.cpu()}, states


FAMILY = ("clip-sgd", "clip21-sgd", "clip21-sgd2m", "clip21-sgd2m-plus", "alpha-normec")


# ---- calibration (App. G; the experiments' mapping) --------------------------------------------

def clip21_paper_noise_std(*, epsilon: float, delta: float, rounds: int, clip: float) -> float:
    """Clip21-SGD2M's proven noise level (App. G).

    ``σ_ω = (8τ/ε)·sqrt(T·ln(5T/(4δ))·ln(1/δ))``: each of the T releases, of replace-one
    sensitivity 2τ, is (ε̃, δ/T)-DP with ε̃ = ε/(2·sqrt(2T ln(1/δ))) (Dwork–Roth Thm 3.22), and
    advanced composition gives (ε, δ) over T rounds (strictly (ε, 2δ), and Thm 3.22 needs
    ε̃ < 1). ``clip`` is τ, half the sensitivity of the released vector. Returns σ_ω, the
    per-coordinate standard deviation.
    """
    t = float(rounds)
    return 8 * clip / epsilon * math.sqrt(t * math.log(5 * t / (4 * delta)) * math.log(1 / delta))


def clip21_practice_noise_std(*, epsilon: float, delta: float, rounds: float,
                              clip: float) -> float:
    """The noise level of the paper's DP experiments (Table 1).

    ``σ_ω = (τ/ε)·sqrt(T·ln(1/δ))``, inferred from the authors' related public code (the paper
    does not state it); ``rounds`` is T, which the run-config key ``practice-horizon`` makes the
    number of rounds or of epochs. It is not a DP guarantee: the ledger's accountant ε for this
    noise is the one to report. For n = 25, batch 64, 150 epochs (T = 5625), δ = 1e-3:
    σ_ω/τ = 65.7, 37.9, 21.9, 12.6, 7.30 for ε = 3, 5.2, 9, 15.6, 27.
    """
    return clip / epsilon * math.sqrt(float(rounds) * math.log(1 / delta))


@CALIBRATIONS.register("paper", *FAMILY)
def paper_calibration(algorithm: Clip21Family, query: Query, target: Target,
                      options: None) -> float:
    """App. G's σ_ω for the released vector's radius, over its sensitivity."""
    return clip21_paper_noise_std(epsilon=target.epsilon, delta=target.delta,
                                  rounds=target.rounds, clip=query.radius) / query.sensitivity()


@CALIBRATIONS.register("practice", *FAMILY, options=PracticeOptions)
def practice_calibration(algorithm: Clip21Family, query: Query, target: Target,
                         options: PracticeOptions) -> float:
    """The experiments' σ_ω for the clipped vectors' radius r, times the sample rate (b/m for
    the per-sample forms, App. J.2), over the query's sensitivity; T counts rounds or epochs."""
    horizon: float = target.rounds
    if options.practice_horizon == "epochs":
        horizon = target.rounds / max(1, target.num_samples // algorithm.hp.batch_size)
    return query.sample_rate * clip21_practice_noise_std(
        epsilon=target.epsilon, delta=target.delta, rounds=horizon,
        clip=algorithm.radius()) / query.sensitivity()


__all__ = ["AlphaNormEC", "CLIP_TAU", "Clip21Family", "Clip21SGD", "Clip21SGD2M",
           "Clip21SGD2MPlus", "ClipSGD", "Compressor", "FAMILY", "NORM_ALPHA", "compress",
           "clip21_paper_noise_std", "clip21_practice_noise_std", "row_norms"]
