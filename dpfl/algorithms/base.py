"""The algorithm contract: the math of one round, batched over clients.

An algorithm is written once, over flat parameter vectors, with a leading
client axis, and is driven unchanged by the Flower runtime (one client, or a
cohort, per ClientApp call) and by the in-process engine (all clients at once):

* ``client_step(exchange, states[C], broadcast, cohort, ctx)``
  ``-> (uploads[C], states[C], metrics[C])``
  runs on the clients. Clipping, per-sample gradients and noise live here, so what
  leaves a client is already private.
* ``server_step(exchange, server_state, uploads[S], participants) -> server_state``
  runs on the server over the participants' uploads, in client-id order.

A round is a sequence of *exchanges* (``exchanges``; one ``"train"`` by default,
e.g. ``("statistic", "train")`` for a noisy query followed by training). Client
state (momentum, error feedback, previous model) is a dict of tensors with a
leading client axis that persists across rounds; ``participants`` supports
client sampling; ``Release.steps`` supports several local steps per round.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from dpfl.config import Param, RunConfig
from dpfl.privacy import Randomness

if TYPE_CHECKING:
    from dpfl.models import FlatModel

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Release:
    """One privacy mechanism a client runs in each round it takes part in.

    ``noise_multiplier`` is the noise std over the sensitivity under the
    algorithm's neighbouring relation (0 means no noise); the ledger records
    ``steps`` compositions at ``sample_rate`` after every ``exchange``.
    """

    exchange: str
    noise_multiplier: float
    sample_rate: float
    steps: int = 1


@dataclass
class Cohort:
    """The local datasets of the clients in one ``client_step`` call.

    ``x``/``y`` hold the union of their data; ``indices[i]`` are client
    ``ids[i]``'s rows. A Flower client holds only its own rows, the engine the
    whole training set; both sample the same rows for the same client.
    """

    ids: list[int]
    x: torch.Tensor
    y: torch.Tensor
    indices: list[torch.Tensor]
    _whole: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, init=False, repr=False, compare=False)  # read-only, see sample()

    @property
    def sizes(self) -> list[int]:
        return [len(i) for i in self.indices]

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, positions: Sequence[int]) -> Cohort:
        return Cohort([self.ids[p] for p in positions], self.x, self.y,
                      [self.indices[p] for p in positions])

    def sample(self, rng: Randomness, round: int, purpose: str,
               batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A mini-batch of ``batch_size`` rows per client, uniformly without
        replacement from its own data (fresh every call): ``x [C, b, ...]``, ``y [C, b]``.
        A batch of a client's whole data is that data in stored order (no draw: the set is
        certain and a mean does not depend on the order), gathered once per cohort."""
        if all(size == batch_size for size in self.sizes):
            if self._whole is None:
                rows = torch.stack(self.indices)
                self._whole = (self.x[rows], self.y[rows])
            return self._whole
        picks = rng.sample_without_replacement(self.ids, self.sizes, round, purpose, batch_size)
        rows = torch.stack([idx[p] for idx, p in zip(self.indices, picks, strict=True)])
        return self.x[rows], self.y[rows]


@dataclass
class StepContext:
    """What a client step needs besides state and data.

    ``pooled_noise`` is set by the engine's ``engine-mode="fast"`` only (never under Flower):
    see :meth:`add_noise`.
    """

    round: int
    rng: Randomness
    releases: list[list[Release]]  # per client in the cohort
    device: torch.device
    pooled_noise: bool = False

    def noise_multiplier(self, exchange: str) -> torch.Tensor:
        """The cohort's noise multipliers ``[C]`` for the release of ``exchange``."""
        return torch.tensor([next(r.noise_multiplier for r in rel if r.exchange == exchange)
                             for rel in self.releases], dtype=torch.float32)

    def add_noise(self, messages: torch.Tensor, cohort: Cohort, std: torch.Tensor, *,
                  poolable: bool, purpose: str = "noise") -> torch.Tensor:
        """Add N(0, std[i]² I) to row i of ``messages [C, d]`` in place and return it.

        By default every row gets its client's own draw (stream ``(seed, client, round,
        purpose)``), so a client's message is private on its own and the engine equals Flower
        bit for bit. With ``pooled_noise`` (engine only) and ``poolable`` — the caller
        guarantees that the noised rows reach the model only through their sum or plain
        average and never feed client state — one draw ``sqrt(Σ_i std[i]²)·z``, z ~ N(0, I)
        from the cohort's first client's stream, goes into row 0 instead: the sum of the rows
        then has exactly the law of the sum of independent per-client draws, at the cost of one
        ``d``-vector instead of ``C``. The per-row messages no longer are the clients' private
        messages, which is why Flower never uses it.
        """
        if not bool((std > 0).any()):
            return messages
        if self.pooled_noise and poolable:
            pooled = std.double().square().sum().sqrt().reshape(1)
            draw = self.rng.normal(cohort.ids[:1], self.round, f"{purpose}-pooled",
                                   messages.shape[1:], pooled, dtype=messages.dtype)
            messages[0].add_(draw[0].to(messages.device))
            return messages
        noise = self.rng.normal(cohort.ids, self.round, purpose, messages.shape[1:], std,
                                dtype=messages.dtype, device=messages.device)
        return messages.add_(noise)


class Algorithm(ABC):
    """Base class of every algorithm; subclasses register in ``ALGORITHMS``."""

    name: ClassVar[str]
    params: ClassVar[tuple[Param, ...]] = ()
    exchanges: ClassVar[tuple[str, ...]] = ("train",)
    relation: ClassVar[str] = "replace-one"
    protection: ClassVar[str]
    calibrations: ClassVar[tuple[str, ...]] = ("accountant",)

    def __init__(self, config: RunConfig, model: FlatModel) -> None:
        self.config = config
        self.model = model

    # ---- privacy -------------------------------------------------------------------
    @abstractmethod
    def releases(self, num_samples: int) -> list[Release]:
        """The calibrated mechanisms of one round for a client holding ``num_samples`` records."""

    # ---- server --------------------------------------------------------------------
    def init_server_state(self, x0: torch.Tensor) -> State:
        return {"x": x0.clone()}

    def participants(self, round: int, clients: list[int], rng: Randomness) -> list[int]:
        """The clients taking part in ``round`` (all of them by default)."""
        return list(clients)

    def broadcast(self, exchange: str, state: State, round: int) -> State:
        return {"x": state["x"]}

    @abstractmethod
    def server_step(self, exchange: str, state: State, uploads: State,
                    participants: list[int], round: int) -> State:
        """New server state from the participants' uploads (client-id order)."""

    def global_params(self, state: State) -> torch.Tensor:
        return state["x"]

    # ---- client --------------------------------------------------------------------
    def init_client_state(self, num_clients: int) -> State:
        return {}

    @abstractmethod
    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: StepContext) -> tuple[State, State, dict[str, torch.Tensor]]:
        """Uploads ``[C, ...]``, new client states ``[C, ...]`` and metrics ``[C]``."""
