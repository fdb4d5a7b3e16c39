"""DP-FTRL: user-level DP-FedAvg whose noise is correlated across rounds by tree aggregation.

Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, "Practical and Private (Deep) Learning without
Sampling or Shuffling", ICML 2021 (arXiv:2103.00039): Algorithm 1 (DP-FTRL, with momentum:
DP-FTRLM), §5's federated form, the tree restarted each epoch (Appendix D); the form Google's
production keyboard models were trained with (Xu et al., "Federated Learning of Gboard Language
Models with Differential Privacy", ACL 2023). No client sampling is assumed random: the server
goes through the population in epochs, and the guarantee comes from the tree, not from
amplification. Each round t, in epoch e and at position p of its tree:

* the cohort is the p-th block of s = round(``fraction-train``·n) clients of epoch e's
  permutation (drawn from the server's stream of epoch e), so every client takes part at most
  once per epoch; an epoch is R = ⌊n/s⌋ rounds, and the n − R·s clients past its last block sit
  it out;
* each client runs K local SGD steps from x and uploads its update clipped at S, as in
  ``dp-fedavg-user``;
* the server releases the sum of the clipped updates plus the tree's noise increment e_p
  (:mod:`dpfl.privacy.tree`): summed over the epoch's rounds, the releases are the noisy prefix
  sums of Algorithm 1, each node drawn N(0, (z·S)² I) for the per-node noise multiplier z;
* the server steps with heavy-ball momentum on the release: m ← β·m + g̃, x ← x + γ_g·m/s (the
  paper's DP-FTRLM, whose momentum on the noisy prefix sums is this momentum on their
  increments; β = 0 is DP-FTRL).

Privacy (user-level, central: the trusted server draws the noise). The schedule is fixed and
public, so neighbours differ in what one client sends, not in who takes part: one client's
data replaced by data whose update is zero (Kairouz et al.'s zero-out relation, dp-accounting's
``REPLACE_SPECIAL``), which moves a round's sum by at most S, as adding or removing a client
does; the ledger keeps it under add/remove, whose sensitivity it shares. One tree, in which the
client's single round enters at most h = ⌈log2(R + 1)⌉ nodes, is then a Gaussian mechanism of
sensitivity S·√h: the release is declared with radius S·√h, calibrated per tree, and each
client is charged one such mechanism each epoch it takes part in, composed over the epochs
without amplification. Swapping one client's data for another's (replace-one) moves a sum by up
to 2S: the same ε needs twice the noise. The sampler enforces the schedule: a population whose
size changes between rounds is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
from dpfl.algorithms.user_level import UserLevelFedAvg
from dpfl.config import BATCH_SIZE, CLIP, FRACTION_TRAIN, LEARNING_RATE, Param, hyperparameter
from dpfl.errors import ConfigError
from dpfl.privacy import Query, Randomness, Relation
from dpfl.privacy.calibration import CALIBRATIONS, Target, accountant_noise_multiplier
from dpfl.privacy.randomness import SERVER
from dpfl.privacy.tree import increment, tree_depth

SERVER_MOMENTUM = Param("server-momentum", 0.9, "DP-FTRL: heavy-ball momentum of the server's "
                        "step on the released (noisy) update, m ← βm + g̃, x ← x + γ_g·m/s; 0 = "
                        "DP-FTRL without momentum (Kairouz et al. 2021 use 0.9).",
                        check=lambda v: None if 0 <= v < 1 else f"must be in [0, 1), got {v}",
                        symbol="β")


@dataclass(frozen=True)
class FTRLHyperparameters:
    batch_size: int = hyperparameter(BATCH_SIZE)  # b, of the clients' local SGD
    learning_rate: float = hyperparameter(LEARNING_RATE)  # η, the clients' step size
    clip: float = hyperparameter(CLIP)  # S
    local_steps: int = hyperparameter(LOCAL_STEPS)  # K
    fraction_train: float = hyperparameter(FRACTION_TRAIN)  # s = round(q·n) clients a round
    server_learning_rate: float = hyperparameter(SERVER_LEARNING_RATE)  # γ_g
    server_momentum: float = hyperparameter(SERVER_MOMENTUM)  # β


@ALGORITHMS.register_class
class DPFTRL(UserLevelFedAvg):
    """DP-FTRL with tree aggregation, restarted each epoch (see the module docstring)."""

    name = "dp-ftrl"
    defaults = {"learning-rate": 0.1, "clip": 0.01}  # docs/defaults.md
    Hyperparameters = FTRLHyperparameters
    protection = ("user-level central DP: each client of the round's cohort clips its whole "
                  "update, the trusted server adds tree-aggregation noise correlated across "
                  "the rounds of an epoch; each client takes part at most once an epoch; "
                  "zero-out neighbours (one client's update replaced by zero, sensitivity S "
                  "as under add/remove); no amplification")
    exchanges = (Exchange("train", ("x",), {"delta": Upload("model", central=True)}),)

    @property
    def relation(self) -> Relation:
        return Relation.ADD_REMOVE

    @property
    def reported_accountants(self) -> tuple[str, ...]:
        return ()

    @property
    def cohort(self) -> int:
        """s: the clients of every round, the denominator of the mean."""
        return sample_size(self.hp.fraction_train, self.num_clients)

    @property
    def epoch_rounds(self) -> int:
        """R = ⌊n/s⌋: the rounds of an epoch, the leaves of its tree."""
        return self.num_clients // self.cohort

    @property
    def depth(self) -> int:
        """h: the nodes of a tree one client's round enters, at most."""
        return tree_depth(self.epoch_rounds)

    def position(self, server_round: int) -> tuple[int, int]:
        """(epoch, position in its tree) of ``server_round``, both from 1."""
        epoch, position = divmod(server_round - 1, self.epoch_rounds)
        return epoch + 1, position + 1

    @classmethod
    def participants_per_round(cls, hp: FTRLHyperparameters, num_clients: int) -> int:
        return sample_size(hp.fraction_train, num_clients)

    def participants(self, server_round: int, clients: list[int], rng: Randomness) -> list[int]:
        """The ``position``-th block of s clients of the epoch's permutation (stream
        ``epochs`` of the server, keyed by the epoch): each client at most once an epoch."""
        if len(clients) != self.num_clients:
            raise ConfigError("num-partitions", f"dp-ftrl's tree assumes a fixed population of "
                              f"{self.num_clients} clients, and round {server_round} offers "
                              f"{len(clients)}", allowed=str(self.num_clients))
        epoch, position = self.position(server_round)
        order = rng.permutation(SERVER, epoch, "epochs", len(clients))
        block = order[(position - 1) * self.cohort:position * self.cohort]
        return sorted(clients[i] for i in block.tolist())

    def noise_multipliers(self, queries: list[Query], multiplier: float) -> list[float]:
        """``noise-multiplier`` is z, each tree node's std over S (Kairouz et al.'s and TFF's
        noise multiplier): the tree's own multiplier is z·S / (S·√h)."""
        return [multiplier / math.sqrt(self.depth) for _ in queries]

    def queries(self, num_samples: int) -> list[Query]:
        return []  # the clients add no noise

    # ---- server --------------------------------------------------------------------------
    def init_server_state(self, x0: Tensor) -> State:
        return {"x": x0.clone(), "momentum": torch.zeros_like(x0),
                "tree": torch.zeros(self.depth, x0.numel(), dtype=x0.dtype)}

    def server_queries(self) -> list[Query]:
        """One tree: radius S·√h (one client's round in h nodes), once per epoch."""
        return [Query("model", "train", radius=self.hp.clip * math.sqrt(self.depth),
                      relation=self.relation, side="server", stream="model-noise")]

    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        """The sum plus the tree's increment, then the momentum step; the server's ledger is
        charged the tree at its first round."""
        _, position = self.position(ctx.server_round)
        total = sums["delta"]
        noise, tree = increment(state["tree"], position, ctx.noise("model", total))
        released = ctx.publish("model", total + noise, charge=position == 1)
        momentum = self.hp.server_momentum * state["momentum"] + released
        return {"x": state["x"] + self.hp.server_learning_rate * momentum / self.cohort,
                "momentum": momentum, "tree": tree}


@CALIBRATIONS.register("accountant", "dp-ftrl")
def tree_accountant(algorithm: DPFTRL, query: Query, target: Target, options: None) -> float:
    """The smallest multiplier of one tree whose composition over the trees a client can take
    part in, ⌈rounds / R⌉ (one an epoch), meets the target: no sample rate amplifies it."""
    trees = math.ceil(target.rounds / algorithm.epoch_rounds)
    return accountant_noise_multiplier(epsilon=target.epsilon, delta=target.delta,
                                       sample_rate=1.0, steps=trees,
                                       accountant=target.accountant)
