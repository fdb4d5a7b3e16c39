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
    ClientContext,
    Cohort,
    Exchange,
    ServerContext,
    State,
    Upload,
)
from dpfl.algorithms.local_dpsgd import (
    LR_MILESTONES,
    MOMENTUM,
    PROXIMAL_MU,
    FederatedDPSGD,
    FederatedHyperparameters,
    LocalDPSGDHyperparameters,
)
from dpfl.algorithms.registry import ALGORITHMS
from dpfl.config import Param, at_least, hyperparameter, open_unit, positive
from dpfl.models.rows import record_means
from dpfl.privacy import CALIBRATIONS, Query, Target, clip_by_norm
from dpfl.privacy.subsampled_rdp import noise_size

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
STATISTIC_NOISE_SIZE = Param("statistic-noise-size", 0.005, "calibration='noise-size': σ_p^C, "
                             "the statistic's noise std relative to Ĝ² (AdaptDP-FedAvg).",
                             check=positive, symbol="σ_p^C")


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

    @property
    def statistic_batch(self) -> int:
        return self.statistic_batch_size or self.batch_size


@dataclass(frozen=True)
class NoiseSizeOptions:
    """The run-config keys of ``calibration="noise-size"``."""

    noise_size: float = hyperparameter(NOISE_SIZE)
    statistic_noise_size: float = hyperparameter(STATISTIC_NOISE_SIZE)


@ALGORITHMS.register_class
class AdaptDPFedAvg(FederatedDPSGD[AdaptDPFedAvgHyperparameters]):
    """AdaptDP-FedAvg (Algorithm 1): a noisy statistic sets the round's radius C_r, then K local
    DP-SGD steps clipped at C_r. See the module docstring."""

    name = "adaptdp-fedavg"
    Hyperparameters = AdaptDPFedAvgHyperparameters
    protection = ("record-level local DP per client: the radius statistic and K local DP-SGD "
                  "steps per round, each noised on the client; replace-one neighbours "
                  "(fixed-size sampling without replacement)")
    exchanges = (Exchange("statistic", ("x",), {"s": Upload("statistic")}),
                 *FederatedDPSGD.exchanges)
    #: the share of ε each release gets in the paper's calibration (eq. (1))
    epsilon_share: ClassVar[float] = 1 / 4

    def batch_of(self, release: str) -> int:
        """The records per client behind one step of ``release``."""
        return self.hp.statistic_batch if release == "statistic" else self.hp.batch_size

    def queries(self, num_samples: int) -> list[Query]:
        """Per round: the statistic (radius Ĝ²/b^C, rate b^C/n_p, stream ``statistic-noise``;
        Proposition 1 with Δ^C = 2/b^C), and K training steps (radius C_r/b, sent by the server
        each round, rate b/n_p)."""
        hp = self.hp
        b = hp.statistic_batch
        return [Query("statistic", "statistic", radius=hp.clip ** 2 / b, relation=self.relation,
                      sample_rate=min(1.0, b / num_samples), stream="statistic-noise"),
                *super().queries(num_samples)]

    # ---- server --------------------------------------------------------------------------
    def broadcast(self, exchange: str, state: State, server_round: int) -> State:
        if exchange == "statistic":
            return {"x": state["x"]}
        return super().broadcast(exchange, state, server_round)

    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        if exchange == "statistic":
            mean = float(sums["s"].double().sum()) / len(ctx.participants)
            return {"x": state["x"], "radius": torch.tensor([self.radius(mean, ctx)],
                                                            dtype=torch.float32)}
        x = self.average(state, sums, ctx)
        if math.isfinite(self.hp.projection_radius):
            x = clip_by_norm(x, self.hp.projection_radius)
        return {"x": x, "radius": state["radius"]}

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

    # ---- client --------------------------------------------------------------------------
    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: ClientContext) -> tuple[State, State]:
        if exchange != "statistic":
            return super().client_step(exchange, states, broadcast, cohort, ctx)
        batches = cohort.draw(ctx, "statistic", "statistic", self.hp.statistic_batch)
        s, = batches.means(self.statistic, broadcast["x"].to(ctx.device),
                           empty=(torch.zeros(1, dtype=torch.float64),), device=ctx.device)
        return {"s": s.float().cpu()}, states

    def statistic(self, xb: Tensor, yb: Tensor, x: Tensor, *, lengths: list[int] | None = None,
                  divisor: int | None = None) -> tuple[Tensor]:
        """``[C, 1]``: (1/b) Σ_j min(‖∇ℓ_j(x)‖², Ĝ²) over each client's batch (float64; a
        ragged batch: ``lengths``, b = ``divisor``, as
        :meth:`~dpfl.models.FlatModel.clipped_mean`; fixed-size: the batch's mean)."""
        norms = self.model.per_sample_norms(x, xb, yb, lengths=lengths)
        terms = norms.double().square().clamp(max=self.hp.clip ** 2)
        return (record_means(terms, lengths, divisor)[:, None],)


@ALGORITHMS.register_class
class DPFedAvg(FederatedDPSGD[DPFedAvgHyperparameters]):
    """DP-FedAvg (Algorithm 2, App. D): the ``train`` exchange alone, at the fixed radius
    C = ``clip``, with client and batch sampling, FedProx's proximal term, momentum and a
    learning-rate schedule as options."""

    name = "dp-fedavg"
    Hyperparameters = DPFedAvgHyperparameters
    protection = ("record-level local DP per client: K local DP-SGD steps per round at a "
                  "fixed clip, noised on the client; replace-one neighbours with fixed-size "
                  "sampling without replacement, or add/remove with sampling='poisson'")
    #: the share of ε the release gets in the paper's calibration (eq. (3))
    epsilon_share: ClassVar[float] = 1 / 2


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
