"""Adaptive clipping from the RMS of gradient norms: AdaptDP-FedAvg and its baseline DP-FedAvg.

Fukami, Murata, Niwa, "Adaptive Clipping for Differential Private Federated Learning in
Interpolation Regimes", TMLR (OpenReview vvSHlH3a8V). Algorithm, proposition and equation
numbers below are the paper's; it numbers only eqs. (1)–(3).

**AdaptDP-FedAvg** (Algorithm 1). Every client takes part in every round, which has two
exchanges:

1. ``statistic``: client p draws b^C of its records uniformly without replacement and sends the
   noisy mean of their clipped squared gradient norms at the global model x_{r−1}::

       s_r^(p) = (1/b^C) Σ_z min(‖∇ℓ_z(x_{r−1})‖², Ĝ²) + ξ,      ξ ~ N(0, (σ_p^C)² Ĝ⁴)

   The server sets the round's radius (line 9), floored at 0 inside the root (a very negative
   noise draw can make the radicand negative; the paper leaves that case open)::

       C_r = min(√(max(2τ((1/P) Σ_p s_r^(p) + ν̃), 0)), Ĝ)
       ν̃ = √2 · √(mean_p (σ_p^C)² / P) · Ĝ² · √(log(2PR/u))       (Proposition 2)

   ν̃ is a √(2 log(2PR/u))-sigma bound on the averaged statistic noise (public: it depends on
   the clients' calibrated noise, P, R and u only); ``debias=false`` drops it.
2. ``train``: with C_r broadcast, each client runs K local DP-SGD steps from x_{r−1}, each on a
   fresh batch of b records drawn without replacement, the gradient taken at the current local
   iterate (Algorithm 2's and the proofs' x_{k−1})::

       x_k = x_{k−1} − η((1/b) Σ_z clip_{C_r}(∇ℓ_z(x_{k−1})) + ξ_k),   ξ_k ~ N(0, σ_p² C_r² I)

   and sends x_K; the server averages the local models (unweighted) and, with a finite
   ``projection-radius`` B, projects onto the B-ball (line 18; off by default, Remark 2).

A round with C_r = 0 takes no step (zero clipped gradients, zero noise). The paper's theory
output x^(out) (the mean of all local iterates) is not formed: the experiments evaluate x_r.

**DP-FedAvg** (Algorithm 2, App. D; record-level local DP-SGD inside FedAvg, not McMahan et
al.'s client-level method): the ``train`` exchange alone, at the fixed radius C = ``clip``.

Privacy (Proposition 1, Theorem 1). Replace-one neighbours within a client's data (local
record-level DP against an untrusted server). Per round a client makes two releases: the
statistic (radius Ĝ²/b^C, so sensitivity 2Ĝ²/b^C as the paper counts it, at sample rate
b^C/n_p) and K training steps (radius C_r/b, at rate b/n_p). The noise of a step is relative to
C_r, so its privacy cost does not depend on C_r (§3.3); C_r is post-processing of the noisy
statistics. In the paper's units a release of noise multiplier z (std over sensitivity) has the
relative noise size σ = 2z/b: σ_p = 2z/b, σ_p^C = 2z^C/b^C. Calibration ``paper`` is eq. (1)
(AdaptDP-FedAvg: ε/4 for each release) and eq. (3) (DP-FedAvg: ε/2), with the subsampled-RDP
operator of Wang et al. at the order α* = 1 + ⌈2 log(1/δ)/ε⌉
(:mod:`dpfl.privacy.subsampled_rdp`); ``noise-size`` takes the relative noise sizes themselves
(the experiments fix σ first, §5.1); ``accountant`` is Opacus'. The ledger reports Opacus' ε and
the paper's accountant's (``rdp-wor``) for the noise actually used.

With ``sampling="poisson"`` (DP-FedAvg and the PCDP paper's baselines) the neighbours are
add/remove, and every batch a release is computed on (the training steps', and a statistic's)
is a Poisson sample: each record with the release's own sample rate b/n_p (n_p =
``min-client-records`` where set: public, never the client's actual record count), the sum
divided by b (Abadi et al., CCS 2016, §3.1; :meth:`~dpfl.algorithms.base.Cohort.draw`). A
fixed-size batch would let an added record push another out, moving a clipped mean by 2C/b.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dpfl.algorithms.base import (
    Algorithm,
    Batches,
    ClientContext,
    Cohort,
    Exchange,
    ServerContext,
    State,
    Upload,
    sample_clients,
)
from dpfl.algorithms.registry import ALGORITHMS
from dpfl.config import (
    BATCH_SIZE,
    CLIP,
    FRACTION_TRAIN,
    LEARNING_RATE,
    Param,
    all_of,
    at_least,
    at_most,
    hyperparameter,
    open_unit,
    positive,
)
from dpfl.privacy import CALIBRATIONS, Query, Randomness, Relation, Target, clip_by_norm
from dpfl.privacy.subsampled_rdp import noise_size

# beyond it a round never ends, and the ledgers' accountants stall on the compositions
MAX_LOCAL_STEPS = 1_000_000
LOCAL_STEPS = Param("local-steps", 1, "Local DP-SGD steps per round, each on a fresh batch.",
                    check=all_of(at_least(1), at_most(MAX_LOCAL_STEPS)), symbol="K")
TAU = Param("tau", 1.0, "AdaptDP-FedAvg: bias of the radius, C_r = min(√(2τ(mean + ν̃)), Ĝ) "
            "(Algorithm 1 line 9).", check=positive, symbol="τ")
STATISTIC_BATCH = Param("statistic-batch-size", 0, "AdaptDP-FedAvg: records per client behind "
                        "the radius statistic, drawn without replacement apart from the "
                        "training batches; 0 = batch-size.", check=at_least(0), symbol="b^C")
FAILURE = Param("failure-probability", 0.01, "AdaptDP-FedAvg: u in the debiasing constant ν̃ "
                "(Proposition 2; Remark 2 suggests 0.01).", check=open_unit, symbol="u")
DEBIAS = Param("debias", True, "AdaptDP-FedAvg: add ν̃ to the averaged statistic (Proposition "
               "2); false = the ablation without it.")
PROJECTION = Param("projection-radius", math.inf, "AdaptDP-FedAvg: project the averaged model "
                   "onto the ball of this radius (Algorithm 1 line 18); inf = no projection, the "
                   "paper's practice (Remark 2).", check=positive, symbol="B")
NOISE_SIZE = Param("noise-size", 0.01, "calibration='noise-size': σ_p, the training noise std "
                   "relative to the clip radius on a batch mean (the paper's Table 1 unit).",
                   check=positive, symbol="σ_p")
SAMPLING = Param("sampling", "fixed", "How each local step draws its batch: 'fixed' (b records "
                 "uniformly without replacement; replace-one neighbours) or 'poisson' (each record "
                 "with probability b/n, n = min-client-records where set, else the client's "
                 "partition size, the sum divided by the expected b; add/remove neighbours, "
                 "Opacus' analysis).", choices=("fixed", "poisson"))
SERVER_LEARNING_RATE = Param("server-learning-rate", 1.0, "Global step size: the server moves "
                             "by this times the mean update, x ← x − γ_g·mean_i(x − x_i); 1 = "
                             "the average of the local models.", check=positive, symbol="γ_g")
PROXIMAL_MU = Param("proximal-mu", 0.0, "FedProx's proximal weight: each per-sample gradient "
                    "gets μ(x_k − x) added before clipping (the local loss plus (μ/2)‖x_k − x‖², "
                    "Li et al. 2020); 0 = FedAvg.", check=at_least(0.0), symbol="μ")
MOMENTUM = Param("momentum", 0.0, "Heavy-ball momentum of the local SGD on the noisy gradient, "
                 "PyTorch's form m ← βm + g̃, w ← w − γm, the buffer kept in client state "
                 "across rounds; 0 = the paper's plain SGD (Alg. 1; the first author's public "
                 "code defaults to 0.9).", check=lambda v: None if 0 <= v < 1
                 else f"must be in [0, 1), got {v}", symbol="β_m")


def milestones_problem(text: str) -> str | None:
    try:
        parse_milestones(text)
    except ValueError:
        return f"expected increasing positive round numbers separated by commas, got {text!r}"
    return None


def parse_milestones(text: str) -> tuple[int, ...]:
    rounds = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    if any(r < 1 for r in rounds) or list(rounds) != sorted(set(rounds)):
        raise ValueError(text)
    return rounds


LR_MILESTONES = Param("lr-milestones", "", "Rounds after which the learning rate is divided by "
                      "10 again, e.g. '40,60' (the first author's public code: half and three "
                      "quarters of the epochs); empty = a constant learning rate.",
                      check=milestones_problem)

STATISTIC_NOISE_SIZE = Param("statistic-noise-size", 0.005, "calibration='noise-size': σ_p^C, "
                             "the statistic's noise std relative to Ĝ² (AdaptDP-FedAvg).",
                             check=positive, symbol="σ_p^C")


@dataclass(frozen=True)
class LocalDPSGDHyperparameters:
    """What K local DP-SGD steps read. The constants are those of AdaptDP-FedAvg (and of
    DP-FedAvg's defaults): fixed-size batches, every client, the server averages."""

    batch_size: int = hyperparameter(BATCH_SIZE)  # b
    learning_rate: float = hyperparameter(LEARNING_RATE)  # η (γ_l)
    clip: float = hyperparameter(CLIP)  # C (DP-FedAvg), Ĝ (AdaptDP-FedAvg)
    local_steps: int = hyperparameter(LOCAL_STEPS)  # K
    sampling: ClassVar[str] = "fixed"
    fraction_train: ClassVar[float] = 1.0
    server_learning_rate: ClassVar[float] = 1.0
    proximal_mu: ClassVar[float] = 0.0
    momentum: ClassVar[float] = 0.0
    lr_milestones: ClassVar[str] = ""
    adaptive: ClassVar[bool] = False

    def learning_rate_at(self, server_round: int) -> float:
        """η divided by 10 for each of ``lr-milestones`` before ``server_round``."""
        passed = sum(m < server_round for m in parse_milestones(self.lr_milestones))
        return self.learning_rate / 10 ** passed


@dataclass(frozen=True)
class FederatedHyperparameters(LocalDPSGDHyperparameters):
    """Local DP-SGD inside a federation that samples batches and clients and has a server
    step size."""

    sampling: str = hyperparameter(SAMPLING)
    fraction_train: float = hyperparameter(FRACTION_TRAIN)  # S/N
    server_learning_rate: float = hyperparameter(SERVER_LEARNING_RATE)  # γ_g


@dataclass(frozen=True)
class DPFedAvgHyperparameters(FederatedHyperparameters):
    proximal_mu: float = hyperparameter(PROXIMAL_MU)  # μ (FedProx)
    momentum: float = hyperparameter(MOMENTUM)  # β_m
    lr_milestones: str = hyperparameter(LR_MILESTONES)


@dataclass(frozen=True)
class AdaptDPFedAvgHyperparameters(LocalDPSGDHyperparameters):
    tau: float = hyperparameter(TAU)  # τ
    statistic_batch_size: int = hyperparameter(STATISTIC_BATCH)  # b^C
    failure_probability: float = hyperparameter(FAILURE)  # u
    debias: bool = hyperparameter(DEBIAS)
    projection_radius: float = hyperparameter(PROJECTION)  # B
    adaptive: ClassVar[bool] = True

    @property
    def statistic_batch(self) -> int:
        return self.statistic_batch_size or self.batch_size


@dataclass(frozen=True)
class NoiseSizeOptions:
    """The run-config keys of ``calibration="noise-size"``."""

    noise_size: float = hyperparameter(NOISE_SIZE)
    statistic_noise_size: float = hyperparameter(STATISTIC_NOISE_SIZE)


@ALGORITHMS.register_class
class AdaptDPFedAvg(Algorithm):
    """AdaptDP-FedAvg (Algorithm 1): a noisy statistic sets the round's radius C_r, then K local
    DP-SGD steps clipped at C_r. See the module docstring."""

    name = "adaptdp-fedavg"
    Hyperparameters = AdaptDPFedAvgHyperparameters
    protection = ("record-level local DP per client: the radius statistic and K local DP-SGD "
                  "steps per round, each noised on the client; replace-one neighbours with "
                  "fixed-size sampling without replacement, or add/remove with "
                  "sampling='poisson'")

    @property
    def reported_accountants(self) -> tuple[str, ...]:  # type: ignore[override]
        """The adaptive-clipping paper's ``rdp-wor`` for its fixed-size sampling; under Poisson
        sampling the classical RDP conversion (the PCDP paper's) and PRV."""
        return ("rdp-classical", "prv") if self.hp.sampling == "poisson" else ("rdp-wor",)
    exchanges = (Exchange("statistic", ("x",), {"s": Upload("statistic")}),
                 Exchange("train", ("x", "radius"), {"x": Upload("train", post_processing=True)}))
    #: the share of ε each release gets in the paper's calibration (eqs. (1), (3))
    epsilon_share: ClassVar[float] = 1 / 4

    @property
    def relation(self) -> Relation:  # type: ignore[override]
        """Replace-one for fixed-size batches (the paper's), add/remove for Poisson sampling."""
        return Relation.ADD_REMOVE if self.hp.sampling == "poisson" else Relation.REPLACE_ONE

    def batch_of(self, release: str) -> int:
        """The records per client behind one step of ``release``."""
        return self.hp.statistic_batch if release == "statistic" else self.hp.batch_size

    def queries(self, num_samples: int) -> list[Query]:
        """Per round: the statistic (radius Ĝ²/b^C, rate b^C/n_p, stream ``statistic-noise``;
        Proposition 1 with Δ^C = 2/b^C) if adaptive, and K training steps (radius C_r/b, sent by
        the server each round, rate b/n_p)."""
        hp = self.hp
        train = Query("train", "train", radius=None, relation=self.relation,
                      sample_rate=hp.batch_size / num_samples, steps=hp.local_steps)
        if not hp.adaptive:
            return [train]
        b = hp.statistic_batch
        return [Query("statistic", "statistic", radius=hp.clip ** 2 / b, relation=self.relation,
                      sample_rate=min(1.0, b / num_samples), stream="statistic-noise"), train]

    # ---- server --------------------------------------------------------------------------
    def init_server_state(self, x0: Tensor) -> State:
        return {"x": x0.clone(), "radius": torch.tensor([self.hp.clip], dtype=torch.float32)}

    def broadcast(self, exchange: str, state: State, server_round: int) -> State:
        if exchange == "statistic":
            return {"x": state["x"]}
        return {"x": state["x"], "radius": state["radius"]}

    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        if exchange == "statistic":
            mean = float(sums["s"].double().sum()) / len(ctx.participants)
            return {"x": state["x"], "radius": torch.tensor([self.radius(mean, ctx)],
                                                            dtype=torch.float32)}
        x = torch.lerp(state["x"], sums["x"] / len(ctx.participants),
                       self.hp.server_learning_rate)  # the mean itself at γ_g = 1
        if self.hp.adaptive and math.isfinite(self.hp.projection_radius):
            x = clip_by_norm(x, self.hp.projection_radius)
        return {"x": x, "radius": state["radius"]}

    def participants(self, server_round: int, clients: list[int], rng: Randomness) -> list[int]:
        return sample_clients(self.hp.fraction_train, server_round, clients, rng)

    def radius(self, mean: float, ctx: ServerContext) -> float:
        """C_r = min(√(max(2τ(mean + ν̃), 0)), Ĝ) (Algorithm 1 line 9)."""
        hp = self.hp
        radicand = 2 * hp.tau * (mean + (self.debiasing(ctx) if hp.debias else 0.0))
        return min(math.sqrt(max(radicand, 0.0)), hp.clip)

    def debiasing(self, ctx: ServerContext) -> float:
        """ν̃ = √(2 log(2PR/u)) × the std of the averaged statistic noise, √(Σ_p std_p²)/P
        (Proposition 2: √2·√(mean_p (σ_p^C)²/P)·Ĝ²·√log(2PR/u), with std_p = σ_p^C·Ĝ²)."""
        p = len(ctx.participants)
        releases = [ctx.client_release(c, "statistic") for c in ctx.participants]
        variance = sum(r.std() ** 2 for r in releases) / p ** 2
        u = self.hp.failure_probability
        return math.sqrt(2 * math.log(2 * p * ctx.num_rounds / u) * variance)

    def clip_radius(self, state: State) -> float:
        return float(state["radius"][0])

    # ---- client --------------------------------------------------------------------------
    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: ClientContext) -> tuple[State, State]:
        hp = self.hp
        x = broadcast["x"].to(ctx.device)
        if exchange == "statistic":
            batches = cohort.draw(ctx, "statistic", "statistic", hp.statistic_batch)
            s, = batches.means(self.statistic, x, empty=(torch.zeros(1, dtype=torch.float64),),
                               device=ctx.device)
            return {"s": s.float().cpu()}, states
        params, states = self.local_steps(x, cohort, states, broadcast, ctx)
        return {"x": params.cpu()}, states

    def statistic(self, xb: Tensor, yb: Tensor, x: Tensor) -> tuple[Tensor]:
        """``[C, 1]``: the mean of min(‖∇ℓ_z(x)‖², Ĝ²) over each client's batch (float64)."""
        _, norms = self.model.clipped_mean(x, xb, yb, self.hp.clip)
        return (norms.double().square().clamp(max=self.hp.clip ** 2).mean(dim=1, keepdim=True),)

    def init_client_state(self, num_clients: int) -> State:
        """The momentum buffers, when there is momentum."""
        return {"momentum": torch.zeros(num_clients, self.model.d)} if self.hp.momentum else {}

    def local_steps(self, x: Tensor, cohort: Cohort, states: State, broadcast: State,
                    ctx: ClientContext) -> tuple[Tensor, State]:
        """K local steps from ``x`` for every client at the broadcast radius, on
        :meth:`step_gradient`: plain SGD at the round's learning rate, or heavy-ball
        (PyTorch's m ← βm + g̃, w ← w − γm) with ``momentum``, whose buffers persist in client
        state."""
        hp = self.hp
        radius = float(broadcast["radius"][0])
        lr = hp.learning_rate_at(ctx.server_round)
        params = x.unsqueeze(0).repeat(len(cohort), 1)
        velocity = states["momentum"].to(ctx.device) if hp.momentum else None
        clipped = torch.zeros(len(cohort), device=ctx.device)
        memo: dict[str, object] = {}  # what the steps of one round share (a subspace)
        for k in range(hp.local_steps):
            g, fraction = self.step_gradient(params, x, cohort, k, radius, broadcast, ctx, memo)
            clipped += fraction
            if velocity is not None:
                velocity = hp.momentum * velocity + g
                g = velocity
            params = params - lr * g
        ctx.diagnose("clipped-fraction", clipped / hp.local_steps)
        return params, ({"momentum": velocity.cpu()} if velocity is not None else states)

    def step_gradient(self, params: Tensor, x: Tensor, cohort: Cohort, k: int, radius: float,
                      broadcast: State, ctx: ClientContext, memo: dict[str, object]
                      ) -> tuple[Tensor, Tensor]:
        """The noisy gradient of local step ``k`` and the fraction clipped (DP-SGD's; a
        projected step overrides it)."""
        return self.noisy_gradient(params, x, self.batches(cohort, k, ctx), radius, k, ctx)

    def batches(self, cohort: Cohort, k: int, ctx: ClientContext) -> Batches:
        """Each client's batch of local step ``k``, from stream ``batch-<k>``: b records
        without replacement, or (``sampling="poisson"``, add/remove) each record with the
        release's probability b/n (:meth:`Cohort.draw`)."""
        return cohort.draw(ctx, f"batch-{k}", "train", self.hp.batch_size)

    def noisy_gradient(self, params: Tensor, x: Tensor, batches: Batches, radius: float,
                       k: int, ctx: ClientContext) -> tuple[Tensor, Tensor]:
        """``[C, d]``: (1/b) Σ_j clip_C(∇ℓ_j(x_k) + μ(x_k − x)) plus the release's noise
        (std σ·C/b), and the fraction of the batch clipped ``[C]``. C_r = 0 takes no step."""
        hp = self.hp
        clipped = torch.zeros(len(params), device=ctx.device)
        if radius > 0:
            offset = hp.proximal_mu * (params - x) if hp.proximal_mu else None
            g, clipped = self.clipped_means(params, batches, radius, ctx, offset=offset)
        else:  # nothing to add, and the noise std is 0 too
            g = torch.zeros_like(params)
        return ctx.privatize("train", g, radius=radius / hp.batch_size, step=k), clipped

    def clipped_means(self, params: Tensor, batches: Batches, radius: float,
                      ctx: ClientContext, *, offset: Tensor | None = None
                      ) -> tuple[Tensor, Tensor]:
        """``[C, d]`` (1/b) Σ_j clip_C(∇ℓ_j + offset) over each client's batch (b = batch-size,
        the expected size under Poisson sampling: :meth:`Batches.means`), and the fraction of
        each batch clipped (0 for an empty one)."""
        def clipped(xb: Tensor, yb: Tensor, params: Tensor, offset: Tensor | None
                    ) -> tuple[Tensor, Tensor]:
            mean, norms = self.model.clipped_mean(params, xb, yb, radius, offset=offset)
            return mean, (norms > radius).float().mean(dim=1)

        mean, clipped_fraction = batches.means(
            clipped, params, offset, empty=(params.new_zeros(self.model.d), params.new_zeros(())),
            device=ctx.device)
        return mean, clipped_fraction


@ALGORITHMS.register_class
class DPFedAvg(AdaptDPFedAvg):
    """DP-FedAvg (Algorithm 2, App. D): AdaptDP-FedAvg's training exchange at the fixed radius
    C = ``clip``, with no statistic."""

    name = "dp-fedavg"
    Hyperparameters = DPFedAvgHyperparameters
    protection = ("record-level local DP per client: K local DP-SGD steps per round at a "
                  "fixed clip, noised on the client; replace-one neighbours with fixed-size "
                  "sampling without replacement, or add/remove with sampling='poisson'")
    exchanges = AdaptDPFedAvg.exchanges[1:]
    epsilon_share = 1 / 2


FAMILY = ("adaptdp-fedavg", "dp-fedavg")


# ---- calibration (eqs. (1), (3); §5.1) ---------------------------------------------------------

def replace_one_multiplier(noise_size: float, batch_size: int) -> float:
    """The noise multiplier (std over replace-one sensitivity 2·scale/b) of a relative noise
    size σ on a mean of b terms (std σ·scale): z = σb/2 (§4.6 of the paper's units)."""
    return noise_size * batch_size / 2


@CALIBRATIONS.register("paper", *FAMILY)
def paper_calibration(algorithm: AdaptDPFedAvg, query: Query, target: Target,
                      options: None) -> float:
    """σ of eq. (1) (AdaptDP-FedAvg: ε/4 for each release) or eq. (3) (DP-FedAvg: ε/2): the
    smallest σ whose R·(steps per round)-fold composition of the subsampled-RDP bound meets the
    share at α* = 1 + ⌈2 log(1/δ)/ε⌉; as a noise multiplier."""
    b = algorithm.batch_of(query.name)
    sigma = noise_size(epsilon=target.epsilon, delta=target.delta, batch_size=b,
                       num_samples=target.num_samples, steps=query.steps * target.rounds,
                       share=algorithm.epsilon_share)
    return replace_one_multiplier(sigma, b)


@CALIBRATIONS.register("noise-size", *FAMILY, options=NoiseSizeOptions, targets_epsilon=False)
def noise_size_calibration(algorithm: AdaptDPFedAvg, query: Query, target: Target,
                           options: NoiseSizeOptions) -> float:
    """The paper's relative noise sizes given directly (σ_p, and σ_p^C for the statistic; the
    experiments fix them first, Table 1), as noise multipliers."""
    sigma = options.statistic_noise_size if query.name == "statistic" else options.noise_size
    return replace_one_multiplier(sigma, algorithm.batch_of(query.name))


__all__ = ["FAMILY", "AdaptDPFedAvg", "DPFedAvg", "replace_one_multiplier"]
