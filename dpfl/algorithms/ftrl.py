"""DP-FTRL: user-level DP-FedAvg whose noise is correlated across rounds (tree aggregation or
banded matrix factorization).

Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, "Practical and Private (Deep) Learning without
Sampling or Shuffling", ICML 2021 (arXiv:2103.00039): Algorithm 1 (DP-FTRL, with momentum:
DP-FTRLM), §5's federated form, the tree restarted each epoch (Appendix D); the form Google's
production keyboard models were trained with (Xu et al., "Federated Learning of Gboard Language
Models with Differential Privacy", ACL 2023). ``noise-correlation="banded"`` replaces the tree
by banded matrix-factorization noise (Choquette-Choo et al., ICML 2023 and NeurIPS 2023; the
banded square root of Kalinin & Lampert, NeurIPS 2024: :mod:`dpfl.privacy.banded`), and
``"blt"`` by a buffered linear Toeplitz factorization optimised by jax_privacy for the run
(McMahan, Xu, Zhang, EMNLP 2024's BLT-DP-FTRL: :mod:`dpfl.privacy.blt`). No client
sampling is assumed random: the server goes through the population in epochs, and the
guarantee comes from the correlated noise, not from amplification. Each round t, at position
p of its epoch:

* the cohort is the p-th block of s = round(``fraction-train``·n) clients of the epoch's
  permutation (drawn from the server's stream: a fresh one each epoch for the tree, the first
  epoch's for every epoch under banded noise, so a client's rounds are exactly R apart), so
  every client takes part at most once per epoch; an epoch is R = ⌊n/s⌋ rounds, and the
  n − R·s clients past its last block sit it out;
* each client runs K local SGD steps from x and uploads its update clipped at S, as in
  ``dp-fedavg-user``;
* the server releases the sum of the clipped updates plus the round's correlated noise: the
  tree's increment e_p (:mod:`dpfl.privacy.tree`; summed over the epoch's rounds, the releases
  are the noisy prefix sums of Algorithm 1, each node drawn N(0, (z·S)² I)), or the banded
  (or BLT) factor's (C⁻¹Z)_t, each z_t drawn N(0, (z·S)² I);
* the server steps with heavy-ball momentum on the release: m ← β·m + g̃, x ← x + γ_g·m/s (the
  paper's DP-FTRLM, whose momentum on the noisy prefix sums is this momentum on their
  increments; β = 0 is DP-FTRL).

Privacy (user-level, central: the trusted server draws the noise). The schedule is fixed and
public, so neighbours differ in what one client sends, not in who takes part: one client's
data replaced by data whose update is zero (Kairouz et al.'s zero-out relation, dp-accounting's
``REPLACE_SPECIAL``), which moves a round's sum by at most S, as adding or removing a client
does; the ledger keeps it under add/remove, whose sensitivity it shares. A participation is a
Gaussian mechanism of sensitivity S·√h for the tree (its round enters at most
h = ⌈log2(R + 1)⌉ nodes of its epoch's tree), S·‖c‖ for banded noise (a column of the
factor; columns of rounds b or more apart do not overlap) and S·ν for BLT noise (its columns
overlap: ν² = max_j Δ_j²/j over the worst j participations R apart, :mod:`dpfl.privacy.blt`):
the release is declared with that
radius, and each client is charged one such mechanism each epoch it takes part in, composed
over the epochs without amplification. Swapping one client's data for another's (replace-one)
moves a sum by up to 2S: the same ε needs twice the noise. The sampler enforces the schedule:
a population whose size changes between rounds is refused, and so are more bands than R.

``client-sampling="poisson"`` (banded noise only) replaces the epochs by Choquette-Choo et al.
2023's b-min-separated sampling (their amplified banded MF, §4 and Theorem 4): the clients are
dealt once to b groups, and round t draws each member of group (t − 1) mod b with probability
p = q·b (b ≤ ⌊1/q⌋); the mean divides by q·n. Neighbours add or remove a client, whose chances,
b rounds apart, move disjoint columns of C: each is a Gaussian of multiplier z/‖c‖ entered with
probability p, composed over ⌈T/b⌉ chances as DP-SGD's subsampled Gaussian is.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import Tensor

from dpfl.algorithms.base import (
    Exchange,
    ServerContext,
    State,
    Upload,
    sample_size,
)
from dpfl.algorithms.local_dpsgd import LOCAL_STEPS, SERVER_LEARNING_RATE
from dpfl.algorithms.registry import ALGORITHMS
from dpfl.algorithms.user_level import CLIENT_SAMPLING, UserLevelFedAvg, poisson_clients
from dpfl.config import BATCH_SIZE, CLIP, FRACTION_TRAIN, LEARNING_RATE, Param, hyperparameter
from dpfl.errors import ConfigError
from dpfl.privacy import Query, Randomness, Relation, banded, blt, tree
from dpfl.privacy.calibration import CALIBRATIONS, Target, accountant_noise_multiplier
from dpfl.privacy.randomness import SERVER

if TYPE_CHECKING:
    from dpfl.models import FlatModel

SERVER_MOMENTUM = Param("server-momentum", 0.9, "DP-FTRL: heavy-ball momentum of the server's "
                        "step on the released (noisy) update, m ← βm + g̃, x ← x + γ_g·m/s; 0 = "
                        "DP-FTRL without momentum (Kairouz et al. 2021 use 0.9).",
                        check=lambda v: None if 0 <= v < 1 else f"must be in [0, 1), got {v}",
                        symbol="β")


NOISE_CORRELATION = Param("noise-correlation", "tree", "DP-FTRL: how the server's noise is "
                          "correlated across rounds: 'tree' (tree aggregation, restarted each "
                          "epoch; each epoch a fresh order of the clients) or 'banded' (banded "
                          "square-root matrix factorization over the whole run; one cyclic "
                          "order, each client every R rounds, R ≥ bands) or 'blt' (a buffered "
                          "linear Toeplitz factorization optimised by jax_privacy for the run's "
                          "rounds, its R and its participations; the same cyclic order; needs "
                          "pip install 'dpfl[blt]').",
                          choices=("tree", "banded", "blt"))
MAX_BANDS = 32  # bands=0 takes min(R, this): the state holds bands − 1 model-sized vectors
BANDS = Param("bands", 0, "DP-FTRL with noise-correlation='banded': b, the bands of the "
              "factor C (1 = independent noise); at most R = ⌊n/s⌋, the rounds between a "
              f"client's participations; 0 = min(R, {MAX_BANDS}).",
              check=lambda v: None if v >= 0 else f"must be >= 0, got {v}", symbol="b")


@dataclass(frozen=True)
class FTRLHyperparameters:
    batch_size: int = hyperparameter(BATCH_SIZE)  # b, of the clients' local SGD
    learning_rate: float = hyperparameter(LEARNING_RATE)  # η, the clients' step size
    clip: float = hyperparameter(CLIP)  # S
    local_steps: int = hyperparameter(LOCAL_STEPS)  # K
    fraction_train: float = hyperparameter(FRACTION_TRAIN)  # s = round(q·n) clients a round
    server_learning_rate: float = hyperparameter(SERVER_LEARNING_RATE)  # γ_g
    server_momentum: float = hyperparameter(SERVER_MOMENTUM)  # β
    noise_correlation: str = hyperparameter(NOISE_CORRELATION)
    bands: int = hyperparameter(BANDS)  # b
    client_sampling: str = hyperparameter(CLIENT_SAMPLING)

    def __post_init__(self) -> None:
        if self.client_sampling == "fixed":
            raise ConfigError("client-sampling", "dp-ftrl's accounting has no fixed-size random "
                              "cohort: its clients take part once an epoch ('epochs'), or, "
                              "under banded noise, Poisson-sampled from one of b groups a "
                              "round ('poisson')", allowed=("epochs", "poisson"))
        if self.noise_correlation == "blt" and self.bands:
            raise ConfigError("bands", "sets banded noise's bands; a BLT's buffers are "
                              "optimised with it (noise-correlation=\"blt\")", allowed=("0",))
        if self.noise_correlation == "blt" and importlib.util.find_spec("jax_privacy") is None:
            raise ConfigError("noise-correlation", "'blt' is optimised by jax_privacy, which is "
                              "not installed: pip install 'dpfl[blt]'",
                              allowed=("tree", "banded"))
        if self.client_sampling == "poisson" and self.noise_correlation != "banded":
            raise ConfigError("client-sampling", "Poisson sampling amplifies banded noise "
                              "(each client's rounds b apart); tree aggregation is accounted "
                              "without sampling: noise-correlation=\"banded\", or "
                              "client-sampling=\"epochs\"", allowed=("epochs",))


class Correlation(Protocol):
    """How the server's noise is correlated across rounds: the schedule it needs, the rows of
    state it keeps, one participation's sensitivity over S, and each round's noise."""

    cyclic: ClassVar[bool]  # one order of the clients for every epoch, else a fresh one each

    @property
    def rows(self) -> int: ...

    @property
    def norm(self) -> float: ...

    def step(self, rows: Tensor, server_round: int, position: int,
             fresh: Tensor) -> tuple[Tensor, Tensor]: ...


@dataclass(frozen=True)
class TreeNoise:
    """Tree aggregation over each epoch's R rounds, restarted each epoch
    (:mod:`dpfl.privacy.tree`): a participation enters h = ⌈log2(R + 1)⌉ nodes."""

    epoch_rounds: int
    cyclic: ClassVar[bool] = False

    @property
    def rows(self) -> int:
        return tree.tree_depth(self.epoch_rounds)

    @property
    def norm(self) -> float:
        return math.sqrt(self.rows)

    def step(self, rows: Tensor, server_round: int, position: int,
             fresh: Tensor) -> tuple[Tensor, Tensor]:
        return tree.increment(rows, position, fresh)


@dataclass(frozen=True)
class BandedNoise:
    """Banded square-root factorization over the whole run (:mod:`dpfl.privacy.banded`):
    participations at least b rounds apart move disjoint columns, ‖c‖ each."""

    coefficients: tuple[float, ...]
    cyclic: ClassVar[bool] = True

    @property
    def rows(self) -> int:
        return len(self.coefficients) - 1

    @property
    def norm(self) -> float:
        return banded.column_norm(list(self.coefficients))

    def step(self, rows: Tensor, server_round: int, position: int,
             fresh: Tensor) -> tuple[Tensor, Tensor]:
        return banded.increment(rows, list(self.coefficients), fresh)


@dataclass(frozen=True)
class BLTNoise:
    """A buffered linear Toeplitz factorization for the run's horizon (:mod:`dpfl.privacy.blt`):
    one buffer a decay, participations at least R rounds apart, ν each."""

    strategy: blt.Strategy
    cyclic: ClassVar[bool] = True

    @property
    def rows(self) -> int:
        return len(self.strategy.decay)

    @property
    def norm(self) -> float:
        return self.strategy.norm

    def step(self, rows: Tensor, server_round: int, position: int,
             fresh: Tensor) -> tuple[Tensor, Tensor]:
        if server_round > self.strategy.horizon:
            raise ConfigError("num-server-rounds", f"round {server_round} is past the "
                              f"{self.strategy.horizon} rounds this run's BLT noise was "
                              f"optimised and accounted for",
                              allowed=f"1..{self.strategy.horizon}")
        return blt.increment(rows, self.strategy, fresh)


def banded_noise(hp: FTRLHyperparameters, separation: int) -> BandedNoise:
    """b bands, at most ``separation``: the rounds between a client's participations."""
    bands = hp.bands or min(separation, MAX_BANDS)
    if bands > separation:
        why = ("⌊1/q⌋: b groups, each drawn at rate q·b ≤ 1" if hp.client_sampling ==
               "poisson" else "⌊n/s⌋, the rounds between a client's participations")
        raise ConfigError("bands", f"{bands} bands need a client's rounds at least {bands} "
                          f"apart, and this run allows at most {separation} ({why})",
                          allowed=f"1..{separation}, or 0")
    return BandedNoise(tuple(banded.square_root_coefficients(bands)))


def blt_noise(hp: FTRLHyperparameters, separation: int, horizon: int) -> BLTNoise:
    """jax_privacy's BLT for ``horizon`` rounds, a client's at least ``separation`` apart."""
    if horizon < 1:
        raise ValueError("BLT noise is optimised for the run's rounds: "
                         "DPFTRL.calibrated_for first")
    return BLTNoise(blt.optimised(horizon, separation))


#: the noise correlations by their run-config name, from the hyperparameters, the rounds
#: between a client's participations and the rounds the noise is calibrated for
CORRELATIONS: dict[str, Callable[[FTRLHyperparameters, int, int], Correlation]] = {
    "tree": lambda hp, epoch_rounds, horizon: TreeNoise(epoch_rounds),
    "banded": lambda hp, separation, horizon: banded_noise(hp, separation),
    "blt": blt_noise,
}


@ALGORITHMS.register_class
class DPFTRL(UserLevelFedAvg):
    """DP-FTRL with tree-aggregation or banded noise (see the module docstring)."""

    name = "dp-ftrl"
    defaults = {"learning-rate": 0.1, "clip": 0.01,  # docs/defaults.md
                "client-sampling": "epochs"}
    Hyperparameters = FTRLHyperparameters
    protection = ("user-level central DP: each client of the round's cohort clips its whole "
                  "update, the trusted server adds noise correlated across rounds (tree "
                  "aggregation, banded or BLT matrix factorization); each client takes part at "
                  "most once an epoch; "
                  "zero-out neighbours (one client's update replaced by zero, sensitivity S "
                  "as under add/remove); no amplification")
    exchanges = (Exchange("train", ("x",), {"delta": Upload("model", central=True)}),)
    zero_out = True  # the schedule is public and fixed

    def __init__(self, hp: FTRLHyperparameters, model: FlatModel, num_clients: int,
                 **kwargs) -> None:
        super().__init__(hp, model, num_clients, **kwargs)
        poisson = hp.client_sampling == "poisson"
        separation = int(1 / hp.fraction_train + 1e-9) if poisson else self.epoch_rounds
        #: the rounds between a client's participations (at least), and the rounds the noise
        #: is calibrated for (:meth:`calibrated_for`): what the correlation is built for
        self.separation, self.horizon = separation, 0
        self._correlation: Correlation | None = None
        #: rounds between a client's chances to take part: R, or b groups under Poisson
        self.period = self.correlation.rows + 1 if poisson else self.epoch_rounds
        #: a member's chance to be drawn in its group's round: 1, or p = q·b under Poisson
        self.sample_rate = min(1.0, hp.fraction_train * self.period) if poisson else 1.0
        self._order: tuple[tuple[int, int], list[int]] = ((-1, -1), [])

    @property
    def correlation(self) -> Correlation:
        """The noise's correlation (:data:`CORRELATIONS`), built when first read."""
        if self._correlation is None:
            self._correlation = CORRELATIONS[self.hp.noise_correlation](
                self.hp, self.separation, self.horizon)
        return self._correlation

    def calibrated_for(self, rounds: int) -> None:
        """The correlation for the rounds the noise is calibrated for (a BLT is optimised for
        them), built now: one the run cannot serve is refused before its first round."""
        self.horizon = rounds
        self._correlation = CORRELATIONS[self.hp.noise_correlation](
            self.hp, self.separation, rounds)

    @property
    def relation(self) -> Relation:
        return Relation.ADD_REMOVE

    @property
    def reported_accountants(self) -> tuple[str, ...]:
        return ()

    @property
    def cohort(self) -> float:
        """The denominator of the mean: s, the clients of every round, or under Poisson
        sampling the expected cohort q·n."""
        if self.hp.client_sampling == "poisson":
            return self.hp.fraction_train * self.num_clients
        return sample_size(self.hp.fraction_train, self.num_clients)

    @property
    def epoch_rounds(self) -> int:
        """R = ⌊n/s⌋: the rounds of an epoch, the leaves of its tree."""
        return self.num_clients // sample_size(self.hp.fraction_train, self.num_clients)

    def position(self, server_round: int) -> tuple[int, int]:
        """(epoch, position in its tree) of ``server_round``, both from 1."""
        epoch, position = divmod(server_round - 1, self.epoch_rounds)
        return epoch + 1, position + 1

    @classmethod
    def participants_per_round(cls, hp: FTRLHyperparameters, num_clients: int) -> int:
        return sample_size(hp.fraction_train, num_clients)

    def participants(self, server_round: int, clients: list[int], rng: Randomness) -> list[int]:
        """The ``position``-th block of s clients of the epoch's permutation (stream
        ``epochs`` of the server, keyed by the epoch; the first epoch's for every epoch where
        the correlation needs a cyclic schedule): each client at most once an epoch. Under
        Poisson sampling the first epoch's permutation deals the clients to b groups (every
        b-th of it) and round t draws each member of group (t − 1) mod b with probability
        p = q·b (Choquette-Choo et al. 2023's b-min-separated sampling): a client's rounds
        are b apart or more."""
        if len(clients) != self.num_clients:
            raise ConfigError("num-partitions", f"dp-ftrl's schedule assumes a fixed population "
                              f"of {self.num_clients} clients, and round {server_round} offers "
                              f"{len(clients)}", allowed=str(self.num_clients))
        epoch, position = self.position(server_round)
        order = self.order(rng.seed, 1 if self.correlation.cyclic else epoch)
        if self.hp.client_sampling == "poisson":
            group = order[(server_round - 1) % self.period::self.period]
            return sorted(poisson_clients(self.sample_rate, server_round,
                                          [clients[i] for i in group], rng))
        size = sample_size(self.hp.fraction_train, self.num_clients)
        return sorted(clients[i] for i in order[(position - 1) * size:position * size])

    def order(self, seed: int, epoch: int) -> list[int]:
        """Epoch ``epoch``'s permutation of the clients, from the run seed's stream ``epochs``
        whatever the run's randomness (``secure-noise`` included): the schedule is public and
        no guarantee rests on its secrecy, and every round of an epoch must read the same one,
        also after a resume. The latest is kept: a million-client permutation a round costs
        more than the round."""
        if self._order[0] != (seed, epoch):
            drawn = Randomness(seed).permutation(SERVER, epoch, "epochs", self.num_clients)
            self._order = ((seed, epoch), drawn.tolist())
        return self._order[1]

    def population_releases(self) -> dict[str, str]:
        """Under Poisson-sampled groups the release is amplified: every client is charged its
        group's chance, drawn or not (:meth:`population_round`); over epochs each participant
        is charged its participation."""
        return self.central_releases() if self.hp.client_sampling == "poisson" else {}

    def population_round(self, server_round: int) -> bool:
        """Under Poisson-sampled groups, one chance a period for every client: charged at the
        period's first round (a group whose rounds come later in the period is charged early,
        at most one chance more than it has by the run's end); else every round, as any
        algorithm (there is no population release to charge)."""
        return self.hp.client_sampling != "poisson" or (server_round - 1) % self.period == 0

    def noise_multipliers(self, queries: list[Query], multiplier: float) -> list[float]:
        """``noise-multiplier`` is z, each draw's std over S (a tree node's: Kairouz et al.'s
        and TFF's noise multiplier; a round's z_t for banded noise): a participation's own
        multiplier is z·S / (S·√h) for the tree, z·S / (S·‖c‖) for banded noise, z·S / (S·ν)
        for BLT noise."""
        return [multiplier / self.correlation.norm for _ in queries]

    def queries(self, num_samples: int) -> list[Query]:
        return []  # the clients add no noise

    def noise_matrix(self, rounds: int) -> Tensor:
        """M: the correlation's own steps fed one-hot draws, row t the coefficients of round
        t's noise on the draws of rounds 1 … ``rounds``."""
        draws = torch.eye(rounds, dtype=torch.float64)
        rows = torch.zeros(self.correlation.rows, rounds, dtype=torch.float64)
        noises = []
        for t in range(1, rounds + 1):
            noise, rows = self.correlation.step(rows, t, self.position(t)[1], draws[t - 1])
            noises.append(noise)
        return torch.stack(noises)

    # ---- server --------------------------------------------------------------------------
    def init_server_state(self, x0: Tensor) -> State:
        state = {"x": x0.clone(), "momentum": torch.zeros_like(x0),
                 "noise": torch.zeros(self.correlation.rows, x0.numel(), dtype=x0.dtype)}
        if self.hp.noise_correlation == "blt":  # the buffers belong to this horizon's BLT
            state["horizon"] = torch.tensor(float(self.horizon), dtype=torch.float64)
        return state

    def server_queries(self) -> list[Query]:
        """One participation: radius S·√h (a round in h tree nodes), S·‖c‖ (a column of
        the banded factor) or S·ν (BLT), one an epoch; under Poisson sampling one chance every
        b rounds, sampled at rate p = q·b."""
        return [Query("model", "train", radius=self.hp.clip * self.correlation.norm,
                      relation=self.relation, sample_rate=self.sample_rate, side="server",
                      stream="model-noise")]

    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        """The sum plus the round's correlated noise, then the momentum step; the server's
        ledger is charged once a period, at its first round (one chance for every client)."""
        _, position = self.position(ctx.server_round)
        if "horizon" in state and int(state["horizon"]) != self.horizon:
            raise ConfigError("calibration-rounds", f"this run's BLT noise was optimised for "
                              f"{int(state['horizon'])} rounds and its buffers hold that "
                              f"factorization's state: resume it with the same horizon",
                              allowed=str(int(state["horizon"])))
        total = sums["delta"]
        noise, rows = self.correlation.step(state["noise"], ctx.server_round, position,
                                            ctx.noise("model", total))
        released = ctx.publish("model", total + noise,
                               charge=(ctx.server_round - 1) % self.period == 0)
        momentum = self.hp.server_momentum * state["momentum"] + released
        return {**state, "x": state["x"] + self.hp.server_learning_rate * momentum / self.cohort,
                "momentum": momentum, "noise": rows}


@CALIBRATIONS.register("accountant", "dp-ftrl")
def participation_accountant(algorithm: DPFTRL, query: Query, target: Target, options: None) -> float:
    """The smallest multiplier of one participation whose composition over those a client can
    make, ⌈rounds / R⌉ (one an epoch; no sample rate amplifies it), or under Poisson sampling
    ⌈rounds / b⌉ chances each sampled at rate p, meets the target."""
    participations = math.ceil(target.rounds / algorithm.period)
    return accountant_noise_multiplier(epsilon=target.epsilon, delta=target.delta,
                                       sample_rate=algorithm.sample_rate, steps=participations,
                                       accountant=target.accountant)
