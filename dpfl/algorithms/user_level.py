"""User-level DP-FedAvg: each sampled client's whole update clipped, Gaussian noise on the sum.

McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language Models",
ICLR 2018 (arXiv:1710.06963), Algorithm 1 (DP-FedAvg, flat clipping, uniform weights). The
unit protected is a client's whole data (user-level, or client-level, DP), and the server is
trusted to add the noise (central DP). Each round:

* the server samples the cohort C_t: with ``client-sampling="poisson"`` each of the n clients
  independently with probability q = ``fraction-train`` (add/remove neighbours: one client's
  data added or removed), or with ``"fixed"`` s = round(q·n) clients uniformly without
  replacement (replace-one neighbours: one client's data swapped);
* each client k ∈ C_t runs K local SGD steps from x (no per-sample clipping, no local noise)
  and uploads its update clipped at S = ``clip``: Δ_k = clip_S(x_K − x);
* the server adds N(0, (z·S)² I) to Σ_k Δ_k and steps x ← x + γ_g (Σ_k Δ_k + N) / W with the
  fixed denominator W = q·n (Poisson: the expected cohort, the paper's estimator f̃_f) or s.

Privacy. One server-side Gaussian release a round, sensitivity S (add/remove) or 2S
(replace-one), sampled at rate q (or s/n): the subsampled Gaussian mechanism of the paper's
moments accountant, composed over the rounds. Sampling amplifies the guarantee of *every*
client, sampled or not, so the ledger charges this release to the whole population each round
(:attr:`Upload.population`); a client's participations are counted beside it. A round whose
Poisson draw is empty still releases the noise (on a zero sum), as the analysis assumes.
"""

from __future__ import annotations

from dataclasses import dataclass

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
from dpfl.algorithms.local_dpsgd import LOCAL_STEPS, SERVER_LEARNING_RATE, plain_local_sgd
from dpfl.algorithms.registry import ALGORITHMS
from dpfl.config import BATCH_SIZE, CLIP, FRACTION_TRAIN, LEARNING_RATE, Param, hyperparameter
from dpfl.errors import ConfigError
from dpfl.privacy import Query, Randomness, Relation
from dpfl.privacy.clipping import clip_by_norm
from dpfl.privacy.randomness import SERVER

CLIENT_SAMPLING = Param("client-sampling", "poisson", "User-level algorithms: how each round's "
                        "participants are drawn: 'poisson' (each client independently with "
                        "probability fraction-train, q; add/remove neighbours; the mean divides "
                        "by the expected cohort q·n), 'fixed' (round(q·n) clients uniformly "
                        "without replacement; replace-one neighbours) or 'epochs' (dp-ftrl's "
                        "default: the clients in blocks of a permutation, each once an epoch; "
                        "dp-ftrl's banded noise also takes 'poisson', sampling round t from "
                        "one of b groups).",
                        choices=("poisson", "fixed", "epochs"), per_algorithm=True)


def refuse_epochs(sampling: str, name: str) -> None:
    """The epoch schedule is dp-ftrl's: its accounting needs correlated noise."""
    if sampling == "epochs":
        raise ConfigError("client-sampling", f"{name} samples its cohort at random: 'epochs' "
                          "(each client once an epoch, no amplification) is dp-ftrl's "
                          "schedule", allowed=("poisson", "fixed"))


@dataclass(frozen=True)
class UserLevelHyperparameters:
    batch_size: int = hyperparameter(BATCH_SIZE)  # b, of the clients' local SGD
    learning_rate: float = hyperparameter(LEARNING_RATE)  # η, the clients' step size
    clip: float = hyperparameter(CLIP)  # S
    local_steps: int = hyperparameter(LOCAL_STEPS)  # K
    fraction_train: float = hyperparameter(FRACTION_TRAIN)  # q
    client_sampling: str = hyperparameter(CLIENT_SAMPLING)
    server_learning_rate: float = hyperparameter(SERVER_LEARNING_RATE)  # γ_g

    def __post_init__(self) -> None:
        refuse_epochs(self.client_sampling, "a user-level algorithm")


def poisson_clients(rate: float, server_round: int, clients: list[int],
                    rng: Randomness) -> list[int]:
    """Each of ``clients`` independently with probability ``rate``, from the server's stream
    of ``server_round`` (client i's coin is the stream's i-th uniform); possibly none."""
    kept = rng.bernoulli_rows([SERVER], [len(clients)], server_round, "participants", [rate])[0]
    return [clients[i] for i in kept.tolist()]


class UserLevelFedAvg(Algorithm[UserLevelHyperparameters]):
    """What both placements of the noise share: the server's client sampling, K local SGD steps
    and the whole update clipped at S on each client, the server's mean over W."""

    @property
    def relation(self) -> Relation:
        return (Relation.ADD_REMOVE if self.hp.client_sampling == "poisson"
                else Relation.REPLACE_ONE)

    @property
    def reported_accountants(self) -> tuple[str, ...]:
        """Beside the run's accountant: under fixed-size client sampling the RDP bound for
        sampling without replacement (replace-one), which that draw is."""
        return () if self.hp.client_sampling == "poisson" else ("rdp-wor",)

    @property
    def cohort(self) -> float:
        """W: the denominator of the mean, q·n under Poisson sampling, else the cohort's size."""
        hp = self.hp
        return (hp.fraction_train * self.num_clients if hp.client_sampling == "poisson"
                else sample_size(hp.fraction_train, self.num_clients))

    @classmethod
    def participants_per_round(cls, hp: UserLevelHyperparameters, num_clients: int) -> int:
        return sample_size(hp.fraction_train, num_clients)

    def participants(self, server_round: int, clients: list[int], rng: Randomness) -> list[int]:
        if self.hp.client_sampling == "poisson":
            return poisson_clients(self.hp.fraction_train, server_round, clients, rng)
        return sample_clients(self.hp.fraction_train, server_round, clients, rng)

    # ---- server --------------------------------------------------------------------------
    def init_server_state(self, x0: Tensor) -> State:
        return {"x": x0.clone()}

    def broadcast(self, exchange: str, state: State, server_round: int) -> State:
        return {"x": state["x"]}

    def zero_sums(self, exchange: str) -> State:
        return {"delta": torch.zeros(self.model.d)}

    def mean_step(self, state: State, total: Tensor) -> State:
        """x ← x + γ_g·total/W."""
        return {"x": state["x"] + self.hp.server_learning_rate * total / self.cohort}

    def clip_radius(self, state: State) -> float:
        return self.hp.clip

    # ---- client --------------------------------------------------------------------------
    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: ClientContext) -> tuple[State, State]:
        hp = self.hp
        x = broadcast["x"].to(ctx.device)
        params = plain_local_sgd(self.model, x, cohort, ctx, steps=hp.local_steps,
                                 batch_size=hp.batch_size, learning_rate=hp.learning_rate)
        return {"delta": clip_by_norm(params - x, hp.clip).cpu()}, {}


@ALGORITHMS.register_class
class UserLevelDPFedAvg(UserLevelFedAvg):
    """DP-FedAvg with user-level central DP (McMahan et al. 2018, Algorithm 1; see the module
    docstring): the trusted server adds the noise to the sum."""

    name = "dp-fedavg-user"
    defaults = {"learning-rate": 0.1, "clip": 0.1}  # docs/defaults.md
    Hyperparameters = UserLevelHyperparameters
    protection = ("user-level central DP: each sampled client clips its whole update, the "
                  "trusted server adds Gaussian noise to the sum; add/remove one client under "
                  "Poisson client sampling, replace-one under fixed-size sampling, amplified "
                  "by the sampling")
    exchanges = (Exchange("train", ("x",), {"delta": Upload("model", central=True,
                                                            population=True)}),)

    def queries(self, num_samples: int) -> list[Query]:
        return []  # the clients add no noise

    def server_queries(self) -> list[Query]:
        """The update sum: radius S, sampled at rate q (or s/n), stream ``model-noise``."""
        return [Query("model", "train", radius=self.hp.clip, relation=self.relation,
                      sample_rate=self.cohort / self.num_clients, side="server",
                      stream="model-noise")]

    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        return self.mean_step(state, ctx.privatize("model", sums["delta"]))


@ALGORITHMS.register_class
class LocalUserLevelDPFedAvg(UserLevelFedAvg):
    """DP-FedAvg with the user-level noise added by the clients: each sampled client adds
    N(0, (z·2S)² I) to its clipped update (replace-one: one client's data swapped), so its reply
    is user-level DP against the server too; with ``secure-aggregation`` and
    ``distributed-noise`` each adds a share and the server sees only the sum, which carries the
    whole noise (distributed DP; Kairouz, Liu, Steinke, "The Distributed Discrete Gaussian
    Mechanism for Federated Learning with Secure Aggregation", ICML 2021, as dpfl's secure sum
    quantises every noised upload). The server picks the participants, so nothing amplifies
    against it: the release is charged to each participant, at sample rate 1."""

    name = "dp-fedavg-user-local"
    defaults = {"learning-rate": 0.1, "clip": 0.003}  # docs/defaults.md
    Hyperparameters = UserLevelHyperparameters
    protection = ("user-level local DP per client: each sampled client clips its whole update "
                  "and adds Gaussian noise to it (a share of it under distributed-noise); "
                  "replace-one neighbours, one client's data swapped; no amplification")
    exchanges = (Exchange("train", ("x",), {"delta": Upload("model")}),)

    @property
    def relation(self) -> Relation:
        return Relation.REPLACE_ONE

    @property
    def reported_accountants(self) -> tuple[str, ...]:
        return ()

    @classmethod
    def secure_aggregation_refusal(cls, hp: UserLevelHyperparameters) -> str | None:
        if hp.client_sampling == "poisson":
            return ("Poisson client sampling draws a cohort of random size, and a secure sum "
                    "needs its participants fixed: client-sampling=\"fixed\"")
        return super().secure_aggregation_refusal(hp)

    def queries(self, num_samples: int) -> list[Query]:
        """The clipped update: radius S, replace-one, every round the client takes part in."""
        return [Query("model", "train", radius=self.hp.clip, relation=self.relation)]

    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        return self.mean_step(state, sums["delta"])


__all__ = ["CLIENT_SAMPLING", "LocalUserLevelDPFedAvg", "UserLevelDPFedAvg", "UserLevelFedAvg",
           "UserLevelHyperparameters", "poisson_clients", "refuse_epochs"]
