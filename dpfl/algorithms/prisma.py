"""The PriSMA family: PriSMA, Non-PriSMA and the paper's baseline DPSGD-GC.

Huang, Zhang, Ling, "Differential Privacy in Distributed Learning: Beyond Uniformly Bounded
Stochastic Gradients", AISTATS 2025, PMLR 258:3223–3231 (equation, algorithm and section numbers
below are the paper's).

**PriSMA** (Algorithm 1): clipped recursive momentum (STORM) with client-side Gaussian noise and
a server-side clip. Client i keeps the noisy message v_i it sent; every round it draws a fresh
batch B_i^t of b records uniformly without replacement (under add/remove neighbours: each record
with probability b/N, the sums still divided by b) and takes per-sample gradients at x^t and
x^{t−1} on that same batch::

    t = 0:  v_i^0 = (1/b) Σ_j clip_C1(∇f_ij(x^0)) + ξ_i^0,                  ξ ~ N(0, σ_0² I)
    t ≥ 1:  v_i^t = (1 − γ) v_i^{t−1} + (γ/b) Σ_j clip_C1(∇f_ij(x^t))
                    + ((1 − γ)/b) Σ_j clip_C3(clip_C1(∇f_ij(x^t)) − clip_C1(∇f_ij(x^{t−1})))
                    + ξ_i^t,                                                 ξ ~ N(0, σ_1² I)  (20)
    server: x^{t+1} = x^t − η · clip_C2((1/M) Σ_i v_i^t)                                  (4)

Eq. (20) is the default; with ``smoothness-L`` = L > 0 it is eq. (4), v_i^t = g_i^t +
(1 − γ)(v_i^{t−1} − g̃_i^t) + ξ_i^t, whose sensitivity is bounded through ‖x^t − x^{t−1}‖ ≤ ηC2
instead of a C3 clip (eqs. (8)–(9)): ‖clip_C1(∇f_j(x^t)) − clip_C1(∇f_j(x^{t−1}))‖ ≤ LηC2. That
bound holds only if every f_j is L-smooth, which nothing checks (an L stated for the model need
not hold for the data), so eq. (4) enforces it: each per-sample difference is clipped at
C3 := LηC2, eq. (20)'s clip at that radius, a no-op wherever the smoothness assumption holds,
and the declared sensitivity holds unconditionally. The noise enters v_i, which the next round
reuses, so it is drawn inside the client step and the message is post-processing of it.

Privacy. Replace-one neighbours (the paper's) or add/remove (``relation``). Each round releases
one subsampled Gaussian query at rate b/N: at t = 0 the clipped mean (radius C1/b), at t ≥ 1 the
momentum increment q_i^t (radius (γC1 + (1 − γ)C3)/b, eq. (21); eq. (4): (γC1 + (1 − γ)LηC2)/b,
eq. (9)); everything else v_i carries is post-processing of earlier releases. The sensitivity is
the relation's factor (2 for replace-one, 1 for add/remove) × radius. Under add/remove the batch
is a Poisson sample at the release's
rate q = b/N (N = ``min-client-records`` where set, else the client's partition size; public,
never the client's actual record count): with a fixed-size batch an added record would push
another out, moving the mean by 2·radius, and Opacus' accountant analyses Poisson sampling.
Calibration ``paper`` gives both releases the noise multiplier σ̂ of Theorem 3 with Corollary 1
(:func:`prisma_paper_calibration`: σ_t = σ̂·sensitivity_t, so σ_0 and σ_1 of eq. (17));
``accountant`` gives both the Opacus multiplier for the T rounds at rate b/N.

**Non-PriSMA** (Lemma 1, Theorem 2): PriSMA with σ_0 = σ_1 = 0, an ablation without privacy
(ε = ∞).

**DPSGD-GC** (the baseline; Abadi et al. 2016, Li et al. 2024): per-sample Clip-SGD, a registered
preset of :class:`~dpfl.algorithms.clip21.ClipSGD` with ``clipping="per-sample"``;
``v_i^t = (1/b) Σ_j clip_C(∇f_ij(x^t)) + ξ_i^t``, ``x^{t+1} = x^t − η · mean_i v_i^t``. PriSMA
with γ = 1 and C2 = ∞ is DPSGD-GC. Its ``paper`` calibration is σ̂ too (γ = 1 in Theorem 3).
"""

from __future__ import annotations

import logging
import math
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
)
from dpfl.algorithms.clip21 import Clip21Hyperparameters, ClipSGD
from dpfl.algorithms.registry import ALGORITHMS
from dpfl.config import (
    BATCH_SIZE,
    CLIP,
    CLIPPING_FUNCTION,
    CLIPPING_STABILITY,
    LEARNING_RATE,
    Param,
    at_least,
    hyperparameter,
    positive,
    unit_interval,
)
from dpfl.errors import ConfigError
from dpfl.privacy import CALIBRATIONS, Query, Relation, Target, clip_by_norm
from dpfl.privacy.clipping import PerSampleClipping

log = logging.getLogger(__name__)


RELATION = Param("relation", "replace-one", "The neighbouring relation protected: "
                 "'replace-one' (one record replaced, the papers' choice: fixed-size batches, "
                 "sensitivity twice a clipped record's norm) or 'add-remove' (one record added "
                 "or removed: Poisson sampling, each record with probability b/n, n = "
                 "min-client-records where set, else the client's partition size, the mean "
                 "still divided by b; Opacus' analysis, half the noise for the same ε).",
                 choices=tuple(r.value for r in Relation))
GAMMA = Param("gamma", 0.5, "PriSMA: weight of the fresh clipped gradient in the recursive "
              "momentum (eqs. (4), (20)); 1 = no momentum.", check=unit_interval, symbol="γ")
SERVER_CLIP = Param("server-clip", math.inf, "PriSMA: the server clips the mean of the messages "
                    "at C2 before its step (eq. (4)); inf = no server clip.", check=positive,
                    symbol="C2")
CLIP_DIFF = Param("clip-diff", 0.5, "PriSMA eq. (20): per-sample clip C3 of the difference of a "
                  "sample's clipped gradients at x^t and x^{t−1}.", check=positive, symbol="C3")
SMOOTHNESS = Param("smoothness-L", 0.0, "PriSMA: the smoothness constant L; > 0 selects eq. (4) "
                   "(the sensitivity is bounded through L·η·C2, so server-clip must be finite; "
                   "each per-sample difference is clipped at C3 = L·η·C2, which enforces that "
                   "bound where the data are not L-smooth); 0 = eq. (20).",
                   check=at_least(0.0), symbol="L")


@dataclass(frozen=True)
class DPSGDGCHyperparameters(Clip21Hyperparameters, PerSampleClipping):
    clip: float = hyperparameter(CLIP)  # C
    clipping_function: str = hyperparameter(CLIPPING_FUNCTION)  # φ
    clipping_stability: float = hyperparameter(CLIPPING_STABILITY)  # r
    relation: str = hyperparameter(RELATION)
    clipping: ClassVar[str] = "per-sample"
    gradient_noise: ClassVar[float] = 0.0


@ALGORITHMS.register_class
class DPSGDGC(ClipSGD):
    """Distributed DPSGD-GC: per-sample clipped, client-noised SGD with plain averaging, one
    step per round (per-sample Clip-SGD with the paper's calibration)."""

    name = "dpsgd-gc"
    defaults = {}  # not Clip-SGD's: docs/defaults.md
    Hyperparameters = DPSGDGCHyperparameters
    protection = ("record-level local DP per client (the relation's neighbours), per-sample "
                  "clipping, client-side noise, sampling amplification at rate b/N (fixed-size "
                  "batches under replace-one, Poisson batches under add/remove)")

    @property
    def relation(self) -> Relation:
        return Relation(self.hp.relation)


@dataclass(frozen=True)
class PrismaCalibration:
    """Theorem 3 with Corollary 1 (eqs. 17–18, 102).

    ``noise_multiplier`` is σ̂ = (b/N)·sqrt(3.5·T·α/ρ) with α = 1 + 2 ln(1/δ)/ε and
    ρ = ε/2: the ratio of the noise std to the replace-one sensitivity of the averaged query,
    the same in every round. ``valid`` says whether the theorem's sufficient condition (18)
    holds; the paper's own experiments violate it.
    """

    noise_multiplier: float
    alpha: float
    rho: float
    valid: bool


def prisma_paper_calibration(*, epsilon: float, delta: float, batch_size: int,
                             num_samples: int, rounds: int) -> PrismaCalibration:
    alpha = 1 + 2 * math.log(1 / delta) / epsilon
    rho = epsilon / 2
    scale = math.sqrt(3.5 * rounds * alpha / rho)
    z = batch_size / num_samples * scale
    inner = num_samples / (batch_size * alpha * (1 + z * z))
    valid = z * z >= 0.7 and inner > 0 and alpha <= (2 * z * z / 3) * math.log(inner) + 1
    if not valid:
        log.warning("PriSMA Theorem 3 condition (18) does not hold for ε=%s, δ=%s, b=%s, N=%s, "
                    "T=%s (σ̂=%.4g); the ledger's accountant ε is the guarantee to rely on.",
                    epsilon, delta, batch_size, num_samples, rounds, z)
    return PrismaCalibration(noise_multiplier=z, alpha=alpha, rho=rho, valid=valid)


@CALIBRATIONS.register("paper", "dpsgd-gc", "prisma")
def paper_calibration(algorithm: Any, query: Query, target: Target, options: None) -> float:
    """σ̂ of Theorem 3 for the client's N records, for every release (σ_t = σ̂·Δ̃_t, eq. (17)),
    as std over the sensitivity under the query's relation (σ̂ is relative to replace-one)."""
    z = prisma_paper_calibration(epsilon=target.epsilon, delta=target.delta,
                                 batch_size=algorithm.hp.batch_size,
                                 num_samples=target.num_samples, rounds=target.rounds)
    return query.relation.multiplier(z.noise_multiplier, of=Relation.REPLACE_ONE)


# ---- PriSMA -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrismaHyperparameters(PerSampleClipping):
    batch_size: int = hyperparameter(BATCH_SIZE)  # b
    learning_rate: float = hyperparameter(LEARNING_RATE)  # η
    clip: float = hyperparameter(CLIP)  # C1
    clipping_function: str = hyperparameter(CLIPPING_FUNCTION)  # φ at C1
    clipping_stability: float = hyperparameter(CLIPPING_STABILITY)  # r
    gamma: float = hyperparameter(GAMMA)  # γ
    server_clip: float = hyperparameter(SERVER_CLIP)  # C2
    clip_diff: float = hyperparameter(CLIP_DIFF)  # C3
    smoothness_L: float = hyperparameter(SMOOTHNESS)  # L
    relation: str = hyperparameter(RELATION)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.smoothness_L > 0:
            if math.isinf(self.server_clip):
                raise ConfigError("server-clip", "eq. (4) (smoothness-L > 0) bounds the "
                                  "sensitivity through L·η·C2: give a finite server-clip")
            if self.clip_diff != CLIP_DIFF.default:
                raise ConfigError("clip-diff", "eq. (4) (smoothness-L > 0) clips at C3 = "
                                  "L·η·C2: leave clip-diff at its default",
                                  allowed=f"{CLIP_DIFF.default}")


@ALGORITHMS.register_class
class Prisma(Algorithm[PrismaHyperparameters]):
    """PriSMA (Algorithm 1; eq. (20), or eq. (4) with ``smoothness-L``). See the module
    docstring. The first round is its own exchange (``init``: x^0 only, σ_0); every later round
    (``train``) broadcasts x^t and x^{t−1}, so a client keeps only the noisy v_i it sent (x^{t−1}
    is public and the same for every client)."""

    name = "prisma"
    Hyperparameters = PrismaHyperparameters
    protection = ("record-level local DP per client (the relation's neighbours): per-sample "
                  "clipping at C1 (and C3 on the differences), client-side Gaussian noise inside "
                  "the momentum, sampling amplification at rate b/N (fixed-size batches under "
                  "replace-one, Poisson batches under add/remove)")
    exchanges = (Exchange("init", ("x",), {"v": Upload("init", post_processing=True)}),
                 Exchange("train", ("x", "x_prev"),
                          {"v": Upload("momentum", post_processing=True)}))
    per_client_broadcast = True
    server_keys = ("learning-rate", "server-clip")  # eq. (4)'s radius, checked equal

    @property
    def relation(self) -> Relation:
        return Relation(self.hp.relation)

    def round_exchanges(self, server_round: int) -> tuple[Exchange, ...]:
        return self.exchanges[:1] if server_round == 1 else self.exchanges[1:]

    def momentum_radius(self) -> float:
        """The norm bound of one record's term of q_i^t = γ·clip_C1(∇f_ij(x^t)) + (1 − γ)·
        (its difference term), times b: γC1 + (1 − γ)C3 (eq. (21)), with C3 = LηC2 for eq. (4)
        (eq. (9)), enforced by the clip at C3 (:meth:`difference_clip`)."""
        return self.hp.gamma * self.hp.clip + (1 - self.hp.gamma) * self.difference_clip()

    def queries(self, num_samples: int) -> list[Query]:
        """The round's subsampled Gaussian query at rate b/N: the clipped mean at t = 0, the
        momentum increment q_i^t after. Both draw from stream ``noise``: they never share a
        round."""
        b = self.hp.batch_size
        rate = b / num_samples
        return [Query("init", "init", radius=self.hp.clip / b, relation=self.relation,
                      sample_rate=rate),
                Query("momentum", "train", radius=self.momentum_radius() / b,
                      relation=self.relation, sample_rate=rate)]

    # ---- server --------------------------------------------------------------------------
    def init_server_state(self, x0: Tensor) -> State:
        return {"x": x0.clone(), "x_prev": x0.clone()}

    def broadcast(self, exchange: str, state: State, server_round: int) -> State:
        if exchange == "init":
            return {"x": state["x"]}
        return {"x": state["x"], "x_prev": state["x_prev"]}

    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        """x^{t+1} = x^t − η·clip_C2(mean_i v_i^t) (unweighted mean, the whole vector)."""
        mean = sums["v"] / len(ctx.participants)
        step = clip_by_norm(mean, self.hp.server_clip)
        return {"x": state["x"] - self.hp.learning_rate * step, "x_prev": state["x"]}

    # ---- client --------------------------------------------------------------------------
    def init_client_state(self, num_clients: int) -> State:
        return {"v": torch.zeros(num_clients, self.model.d)}

    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: ClientContext) -> tuple[State, State]:
        """The round's release on a fresh batch (:meth:`Cohort.draw`: b records, or under
        add/remove each with probability b/N): v_i^0 (line 7) or v_i^t (line 10)."""
        release = self.exchange(exchange).uploads["v"].release
        batches = cohort.draw(ctx, "batch", release, self.hp.batch_size)
        points = [broadcast[k].to(ctx.device) for k in self.exchange(exchange).broadcast]
        q, = batches.means(self.query, *points, empty=(points[0].new_zeros(self.model.d),),
                           device=ctx.device)
        v = ctx.privatize(release, q)
        if exchange == "train":  # eq. (20) / (4), in the noised increment's fresh memory
            v.add_(states["v"].to(ctx.device), alpha=1 - self.hp.gamma)
        v = v.cpu()
        return {"v": v}, {"v": v}

    def query(self, xb: Tensor, yb: Tensor, x: Tensor, x_prev: Tensor | None = None, *,
              lengths: list[int] | None = None, divisor: int | None = None) -> tuple[Tensor]:
        """The round's query before its noise (a ragged batch: ``lengths``, ``divisor``, as
        :meth:`~dpfl.models.FlatModel.clipped_mean`): the clipped mean at t = 0 (line 7) and
        with γ = 1 (no momentum: the difference term has weight 0, DPSGD-GC's query), else the
        increment q_i^t."""
        ragged = {"lengths": lengths, "divisor": divisor}
        if x_prev is None or self.hp.gamma == 1:
            return self.model.clipped_mean(x, xb, yb, self.hp.clip,
                                           clipping=self.hp.per_sample_clipping, **ragged)[:1]
        return (self.increment(x, x_prev, xb, yb, **ragged),)

    def difference_clip(self) -> float:
        """C3, the clip of each per-sample difference c_j − c̃_j: ``clip-diff`` (eq. (20)), or
        L·η·C2 for eq. (4). Eqs. (8)–(9) bound that difference by L·η·C2 when every f_j is
        L-smooth, which nothing checks; clipping at it enforces the bound (a no-op wherever
        smoothness holds) and makes the declared radius (:meth:`momentum_radius`) hold
        unconditionally."""
        hp = self.hp
        if hp.smoothness_L > 0:
            return hp.smoothness_L * hp.learning_rate * hp.server_clip
        return hp.clip_diff

    def increment(self, x: Tensor, x_prev: Tensor, xb: Tensor, yb: Tensor, *,
                  lengths: list[int] | None = None, divisor: int | None = None) -> Tensor:
        """q_i^t ``[C, d]``: (1/b) Σ_j [γ·c_j + (1 − γ)·clip_C3(c_j − c̃_j)] with c_j, c̃_j the
        C1-clipped per-sample gradients at x^t and x^{t−1} on the same batch and C3 from
        :meth:`difference_clip`, without materialising them where the model has ghost
        norms."""
        hp = self.hp
        return self.model.clipped_difference_mean(
            x, x_prev, xb, yb, clip=hp.clip, gamma=hp.gamma, clip_diff=self.difference_clip(),
            lengths=lengths, divisor=divisor, clipping=hp.per_sample_clipping)


@ALGORITHMS.register_class
class NonPrisma(Prisma):
    """Non-PriSMA (Lemma 1, Theorem 2): PriSMA without noise (σ_0 = σ_1 = 0), an ablation with no
    privacy (ε = ∞); it takes no calibration keys."""

    name = "non-prisma"
    noise_free = True
    protection = "none: the noise-free ablation of PriSMA (ε = ∞)"
