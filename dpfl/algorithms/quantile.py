"""Client-level DP-FedAvg with quantile-based adaptive clipping, as Flower runs it.

Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with Adaptive Clipping",
NeurIPS 2021 (arXiv:1905.03871), Algorithm 1, as Flower implements it in
``DifferentialPrivacyClientSideAdaptiveClipping`` (server) with ``adaptiveclipping_mod``
(client): the row the adaptive-clipping experiments compare against. The three formulas are
written here from the paper (dpfl's algorithms import nothing from Flower) and checked against
Flower's functions bit for bit (tests/test_quantile.py). Central DP: the server is
trusted to add the noise, and the unit protected is a client's whole update (add/remove one
client).

Each round (one ``train`` exchange, every client): the server broadcasts the model x and the
clipping norm C; client i runs K local SGD steps (no per-sample clipping, no local noise) on
fresh batches, clips its update Δ_i = x_K − x at C (:func:`clip_update`, Flower's
``adaptive_clip_inputs_inplace``) and sends the clipped update and the bit b_i = 1[‖Δ_i‖ ≤ C],
both un-noised. The server adds Gaussian noise to both sums and steps::

    x ← x + (Σ_i clip_C(Δ_i) + N(0, (z_Δ C)² I)) / P
    C ← C · exp(−η_C ((Σ_i b_i + N(0, σ_b²)) / P − γ))      (:func:`geometric_update`)

The noise split is Theorem 1's, as Flower's ``compute_adaptive_noise_params`` applies it: σ_b =
P/20 unless ``clipped-count-stddev`` is given, and z_Δ = (z^−2 − (2σ_b)^−2)^−1/2 for the run's
effective multiplier z (``noise-multiplier``, or calibrated; :func:`update_multiplier`). Three
deliberate differences from Flower 1.41's classes, measured in docs/algorithms.md:

* the bit is Andrew et al.'s b_i = 1[‖Δ_i‖ ≤ C]; Flower's mod and server-side class send
  1[‖Δ_i‖ > C] into the same update, which then moves C away from the target quantile;
* the update's noise is scaled by the C the updates were clipped at (Flower scales it by the
  norm after the geometric update);
* noise is drawn from the run's keyed streams, not ``np.random``, so a run is reproducible and
  the engine equals Flower bit for bit; the mean is unweighted (FedAvg's weights are the
  clients' record counts: equal for an equal split).

Privacy. Two server-side Gaussian releases per round at sample rate 1: the update sum
(sensitivity C, multiplier z_Δ) and the count (sensitivity 1: a bit in {0, 1}, multiplier σ_b).
Andrew et al.'s split gives the pair the effective multiplier z for centred bits
(sensitivity ½); with Flower's uncentred bits the ledger composes what is actually released,
which costs more than z (docs/privacy.md has the numbers).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
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
from dpfl.algorithms.local_dpsgd import LOCAL_STEPS, plain_local_sgd
from dpfl.algorithms.registry import ALGORITHMS
from dpfl.algorithms.user_level import CLIENT_SAMPLING, poisson_clients, refuse_epochs
from dpfl.config import (
    BATCH_SIZE,
    CLIP,
    FRACTION_TRAIN,
    LEARNING_RATE,
    Param,
    hyperparameter,
    positive,
)
from dpfl.errors import ConfigError
from dpfl.privacy import CALIBRATIONS, Query, Randomness, Relation, Target
from dpfl.privacy.calibration import accountant_noise_multiplier
from dpfl.privacy.ledger import PrivacyLedger

TARGET_QUANTILE = Param("target-quantile", 0.5, "dp-fedavg-quantile: the quantile of the "
                        "clients' update norms the clipping norm tracks (the fraction of "
                        "updates left unclipped).",
                        check=lambda v: None if 0 <= v <= 1 else f"must be in [0, 1], got {v}",
                        symbol="γ")
CLIP_LEARNING_RATE = Param("clip-learning-rate", 0.2, "dp-fedavg-quantile: step of the "
                           "geometric update of the clipping norm.", check=positive, symbol="η_C")
COUNT_STDDEV = Param("clipped-count-stddev", -1.0, "dp-fedavg-quantile: std of the noise on the "
                     "count of unclipped updates; -1 = Flower's default, clients/20, raised "
                     "where a calibrated run's target ε needs it (small federations) to twice "
                     "the multiplier that target gives one release a round.",
                     check=lambda v: None if v == -1.0 or v >= 0 else
                     f"must be -1 or >= 0, got {v}", symbol="σ_b")


@dataclass(frozen=True)
class QuantileHyperparameters:
    batch_size: int = hyperparameter(BATCH_SIZE)  # b
    learning_rate: float = hyperparameter(LEARNING_RATE)  # client step size
    clip: float = hyperparameter(CLIP)  # C_0, the initial clipping norm
    local_steps: int = hyperparameter(LOCAL_STEPS)  # K
    target_quantile: float = hyperparameter(TARGET_QUANTILE)  # γ
    clip_learning_rate: float = hyperparameter(CLIP_LEARNING_RATE)  # η_C
    clipped_count_stddev: float = hyperparameter(COUNT_STDDEV)  # σ_b
    fraction_train: float = hyperparameter(FRACTION_TRAIN)  # q
    client_sampling: str = hyperparameter(CLIENT_SAMPLING)

    def __post_init__(self) -> None:
        refuse_epochs(self.client_sampling, "dp-fedavg-quantile")
        if self.client_sampling == "fixed" and self.fraction_train < 1:
            raise ConfigError("client-sampling", "dp-fedavg-quantile's releases are analysed "
                              "under add/remove neighbours, which a fixed-size cohort of fewer "
                              "than every client does not keep (an added client pushes "
                              "another out)", allowed='"poisson", or fraction-train=1')


def update_multiplier(multiplier: float, count_stddev: float) -> float:
    """z_Δ = (z^−2 − (2σ_b)^−2)^−1/2: the update's noise multiplier that, beside the count's
    noise σ_b, makes the pair of releases as private as one release of multiplier z (Theorem 1,
    for centred bits; z < 2σ_b)."""
    return (multiplier ** (-2) - (2 * count_stddev) ** (-2)) ** -0.5


def update_norm(update: np.ndarray) -> float:
    """‖Δ‖ of a flat update as Flower's ``get_norm`` computes it: the square root of the squared
    float32 norm."""
    return float(np.sqrt(np.linalg.norm(update) ** 2))


def clip_update(update: np.ndarray, clip: float, norm: float | None = None) -> bool:
    """Scale the flat ``update`` in place to ℓ2 norm at most ``clip`` (Algorithm 1's
    Δ·min(1, C/‖Δ‖), ``norm`` its :func:`update_norm` where known); whether it was scaled (the
    norm exceeded C)."""
    norm = update_norm(update) if norm is None else norm
    factor = min(1, clip / norm)
    update *= factor
    return factor < 1


def geometric_update(clip: float, fraction: float, hp: QuantileHyperparameters) -> float:
    """Algorithm 1's geometric update C · exp(−η_C (b̃ − γ)) of the clipping norm, b̃ the noisy
    fraction of unclipped updates."""
    return clip * math.exp(-hp.clip_learning_rate * (fraction - hp.target_quantile))


@ALGORITHMS.register_class
class QuantileDPFedAvg(Algorithm[QuantileHyperparameters]):
    """DP-FedAvg with quantile-based adaptive clipping (client-level central DP; see the
    module docstring)."""

    name = "dp-fedavg-quantile"
    defaults = {"learning-rate": 0.01, "clip": 0.03}  # docs/defaults.md
    Hyperparameters = QuantileHyperparameters
    protection = ("client-level central DP (add/remove one client): clients clip their update "
                  "at an adaptive norm, the trusted server adds Gaussian noise to the sum of "
                  "updates and to the count of unclipped ones")
    exchanges = (Exchange("train", ("x", "clip"),
                          {"delta": Upload("model", central=True),
                           "unclipped": Upload("count", central=True)}),)

    @property
    def relation(self) -> Relation:
        return Relation.ADD_REMOVE

    @property
    def cohort(self) -> float:
        """W, the fixed denominator of the mean and of the fraction of unclipped updates: the
        expected cohort q·n under Poisson sampling (Andrew et al.'s), else every client."""
        return self.hp.fraction_train * self.num_clients

    @property
    def sample_rate(self) -> float:
        return self.cohort / self.num_clients

    @classmethod
    def participants_per_round(cls, hp: QuantileHyperparameters, num_clients: int) -> int:
        return sample_size(hp.fraction_train, num_clients)

    def participants(self, server_round: int, clients: list[int], rng: Randomness) -> list[int]:
        """Each client with probability q (``client-sampling="poisson"``, possibly none), or
        every client (``"fixed"`` at q = 1)."""
        if self.hp.client_sampling == "poisson":
            return poisson_clients(self.hp.fraction_train, server_round, clients, rng)
        return sample_clients(self.hp.fraction_train, server_round, clients, rng)

    def zero_sums(self, exchange: str) -> State:
        return {"delta": torch.zeros(self.model.d), "unclipped": torch.zeros(1)}

    def population_releases(self) -> dict[str, str]:
        """Both releases where clients are sampled (q < 1): amplified, they are charged to
        every client each round. At q = 1 every client takes part and is charged them as a
        participant, which its node's ledger counts too."""
        return self.central_releases() if self.sample_rate < 1 else {}

    def queries(self, num_samples: int) -> list[Query]:
        return []  # the clients add no noise

    def server_queries(self) -> list[Query]:
        """The update sum (radius C, sent each round) and the count of unclipped updates
        (radius 1), streams ``model-noise`` and ``count-noise``, sampled at rate q
        (:meth:`population_releases`)."""
        return [Query("model", "train", radius=None, relation=self.relation, side="server",
                      sample_rate=self.sample_rate, stream="model-noise"),
                Query("count", "train", radius=1.0, relation=self.relation, side="server",
                      sample_rate=self.sample_rate, stream="count-noise")]

    def noise_multipliers(self, queries: list[Query], multiplier: float) -> list[float]:
        """Flower's split of the effective multiplier z: z_Δ for the update sum, σ_b for the
        count (``compute_adaptive_noise_params``)."""
        count, model = self.noise_split(multiplier)
        return [model if q.name == "model" else count for q in queries]

    @property
    def count_stddev(self) -> float:
        """σ_b as configured: ``clipped-count-stddev``, or Flower's default P/20 for the
        (expected) cohort P (which the ``accountant`` calibration may raise:
        :func:`quantile_noise_multiplier`)."""
        given = self.hp.clipped_count_stddev
        return self.cohort / 20 if given < 0 else given

    def noise_split(self, multiplier: float, count_stddev: float | None = None
                    ) -> tuple[float, float]:
        """(σ_b, z_Δ) for the effective multiplier z and the count noise σ_b
        (:attr:`count_stddev` when None), as Flower computes them."""
        sigma_b = self.count_stddev if count_stddev is None else count_stddev
        if multiplier <= 0:
            return sigma_b, 0.0
        if multiplier >= 2 * sigma_b:
            raise ConfigError("clipped-count-stddev", f"the count noise σ_b = {sigma_b:g} "
                              f"leaves no room for the effective noise multiplier "
                              f"{multiplier:g}, which must stay below 2σ_b",
                              allowed=f"> {multiplier / 2:g}")
        return sigma_b, update_multiplier(multiplier, sigma_b)

    # ---- server --------------------------------------------------------------------------
    def init_server_state(self, x0: Tensor) -> State:
        return {"x": x0.clone(), "clip": torch.tensor([self.hp.clip], dtype=torch.float64)}

    def broadcast(self, exchange: str, state: State, server_round: int) -> State:
        return dict(state)

    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        clip = float(state["clip"][0])
        p = self.cohort
        update = ctx.privatize("model", sums["delta"], radius=clip)
        count = float(ctx.privatize("count", sums["unclipped"].double()).sum())
        clip = geometric_update(clip, count / p, self.hp)
        return {"x": state["x"] + update / p, "clip": torch.tensor([clip], dtype=torch.float64)}

    def clip_radius(self, state: State) -> float:
        return float(state["clip"][0])

    # ---- client --------------------------------------------------------------------------
    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: ClientContext) -> tuple[State, State]:
        hp = self.hp
        x = broadcast["x"].to(ctx.device)
        clip = float(broadcast["clip"][0])
        params = plain_local_sgd(self.model, x, cohort, ctx, steps=hp.local_steps,
                                 batch_size=hp.batch_size, learning_rate=hp.learning_rate)
        deltas = (params - x).cpu().numpy()
        unclipped = np.ones((len(cohort), 1), dtype=np.float32)
        for row, bit in zip(deltas, unclipped, strict=True):
            norm = update_norm(row)  # finite unless an entry is not, or the squares overflow
            # local steps that overflowed (a record's NaN is already dropped by the gradient):
            # the runtime sends the row as zeros and logs it, so its bit is a zero update's
            if not math.isfinite(norm) and not np.isfinite(row).all():
                continue
            if norm > 0:  # Flower's clip divides by the norm; a zero update stays as it is
                bit[0] = not clip_update(row, clip, norm)
        return {"delta": torch.from_numpy(deltas), "unclipped": torch.from_numpy(unclipped)}, {}


@CALIBRATIONS.register("accountant", "dp-fedavg-quantile")
def accountant_calibration(algorithm: QuantileDPFedAvg, query: Query, target: Target,
                           options: None) -> float:
    """The smallest effective multiplier z whose pair of releases under Flower's split,
    (z_Δ(z), σ_b) every round, meets the target by the Opacus accountant; the query's part of
    it."""
    sigma_b, z = quantile_noise_multiplier(algorithm, target)
    count, model = algorithm.noise_split(z, sigma_b)
    return model if query.name == "model" else count


@functools.lru_cache(maxsize=64)
def _epsilon(accountant: str, model: float, count: float, rate: float, rounds: int,
             delta: float) -> float:
    ledger = PrivacyLedger(accountant, Relation.ADD_REMOVE,
                           [(model, rate, rounds), (count, rate, rounds)])
    return ledger.epsilon(delta)


def quantile_noise_multiplier(algorithm: QuantileDPFedAvg, target: Target
                              ) -> tuple[float, float]:
    """(σ_b, z): bisection on z in (0, 2σ_b) (in log space, to 1e-6 relative): ε of R rounds
    of both releases is decreasing in z. Under the default σ_b, a target that P/20 cannot reach
    (the count alone would spend it: a small federation) raises σ_b to 2z₁, z₁ the multiplier
    of one release a round for the target: the count then spends about a quarter of the
    budget's RDP, and z_Δ is at most √(4/3) z."""
    sigma_b = algorithm.count_stddev
    if sigma_b <= 0:
        raise ConfigError("clipped-count-stddev", "a noisy run needs noise on the count",
                          allowed="-1 (clients/20) or > 0")

    def epsilon(log_z: float) -> float:
        count, model = algorithm.noise_split(math.exp(log_z), sigma_b)
        return _epsilon(target.accountant, model, count, algorithm.sample_rate, target.rounds,
                        target.delta)

    high = math.log(2 * sigma_b * (1 - 1e-9))
    if epsilon(high) > target.epsilon and algorithm.hp.clipped_count_stddev < 0:
        sigma_b = max(sigma_b, 2 * accountant_noise_multiplier(
            epsilon=target.epsilon, delta=target.delta, sample_rate=algorithm.sample_rate,
            steps=target.rounds,
            accountant=target.accountant))
        high = math.log(2 * sigma_b * (1 - 1e-9))
    low = math.log(1e-6)
    if epsilon(high) > target.epsilon:
        raise ConfigError("epsilon", f"ε={target.epsilon:g} is not reachable with the count "
                          f"noise σ_b = {sigma_b:g} (the effective multiplier must stay below "
                          f"2σ_b): raise clipped-count-stddev, or the target ε")
    while high - low > 1e-6:
        mid = (low + high) / 2
        low, high = (low, mid) if epsilon(mid) <= target.epsilon else (mid, high)
    return sigma_b, math.exp(high)
