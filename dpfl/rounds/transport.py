"""What the round loop asks of a transport (its requests, the :class:`Transport` that answers
them), and the one reduction every transport uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from dpfl.algorithms import State
from dpfl.checkpoint import Lineage


@dataclass
class Replies:
    """One exchange's result: each upload summed over the participants that replied, and
    (non-private diagnostics only) each one's diagnostics.

    Over a real federation some participants can be missing, each with the reason:
    ``unreached`` were not sent the exchange (their node is offline), ``lost`` were sent it but
    their reply never came (the node failed or went away after receiving it). The engine loses
    nobody.

    ``reported``: each replying client's counts of the run's releases (by release name), as its
    node's own ledger holds them; ``noise``: where each replying client's noise came from
    (:data:`~dpfl.privacy.randomness.MODES`). Flower only: the server reconciles its ledger, the
    authority, with the counts, and its privacy statement with the noise."""

    sums: State | None
    diagnostics: dict[int, dict[str, float]] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)
    unreached: dict[int, str] = field(default_factory=dict)
    reported: dict[int, dict[str, int]] = field(default_factory=dict)
    noise: dict[int, str] = field(default_factory=dict)


class Transport(Protocol):
    """Carries one exchange to the participants and back: the in-process engine, or Flower
    messages (strategy + ClientApp)."""

    def begin(self, lineage: Lineage, states: State | None) -> dict[int, dict[str, int]]:
        """Called once before the first round: the run's lineage and, for a resumed run, the
        client states of its checkpoint (as :meth:`client_states` gave them). Returns the
        counts of the run's releases the clients' nodes reported when they were discovered
        (Flower; :attr:`Replies.reported`), for a resumed run to charge what an interrupted
        attempt released after its checkpoint."""
        ...

    def send_and_receive(self, exchange: str, server_round: int, broadcast: State,
                 participants: list[int]) -> Replies:
        """Send ``broadcast`` to ``participants`` (increasing id) and return their replies;
        raises :class:`ClientRefused` when a node refuses the exchange."""
        ...

    def client_states(self) -> State:
        """The client states a server checkpoint keeps: every client's in the engine, none
        under Flower (each client keeps its own on its node)."""
        ...


@dataclass(frozen=True)
class ExchangeRequest:
    """Send ``broadcast`` to ``participants`` (increasing id) for exchange ``exchange`` of round
    ``server_round``; answered with their :class:`Replies`."""

    exchange: str
    server_round: int
    broadcast: State
    participants: list[int]

    def sent_over(self, transport: Transport) -> Replies:
        return transport.send_and_receive(self.exchange, self.server_round, self.broadcast,
                                  self.participants)


@dataclass(frozen=True)
class Begin:
    """The run starts (:meth:`Transport.begin`); answered with the clients' reported counts."""

    lineage: Lineage
    states: State | None

    def sent_over(self, transport: Transport) -> dict[int, dict[str, int]]:
        return transport.begin(self.lineage, self.states)


@dataclass(frozen=True)
class ClientStates:
    """The client states a checkpoint keeps (:meth:`Transport.client_states`)."""

    def sent_over(self, transport: Transport) -> State:
        return transport.client_states()


#: what the round loop yields: each request is answered by :meth:`sent_over` a transport
Request = ExchangeRequest | Begin | ClientStates


class ClientsLost(RuntimeError):
    """Fewer participants replied to an exchange than ``min-clients`` requires (or than secure
    aggregation needs). ``released``: the participants whose noised uploads may have left them
    all the same (charged for the exchange)."""

    def __init__(self, message: str, released: list[int] | None = None) -> None:
        super().__init__(message)
        self.released = list(released or [])


class ClientRefused(RuntimeError):
    """Nodes refused an exchange for ``clients``, by their own policy (``reason``: the policy
    key, e.g. its ε cap): what a node raises and sends (:func:`dpfl.wire.encode_refusal`), and
    what the server's transport raises to the loop. ``released`` (server side) are the
    participants that did not refuse: they may have noised and sent their uploads, so they are
    charged for the exchange."""

    def __init__(self, clients: list[int], reason: str = "their privacy budget is spent",
                 released: list[int] | None = None) -> None:
        super().__init__(f"clients {clients} refused: {reason}")
        self.clients = clients
        self.reason = reason
        self.released = list(released or [])


#: rows per block of the one reduction, and clients per batched client step in the engine: a
#: block's uploads and their noise take 2·BLOCK·d·4 bytes (0.4 GB for the 203,530 parameters
#: of MNIST's 784-256-10 MLP) however many clients take part
BLOCK = 256


def blocks(n: int) -> list[slice]:
    """The blocks of ``n`` rows: :data:`BLOCK` consecutive rows each, the last one shorter."""
    return [slice(start, min(start + BLOCK, n)) for start in range(0, n, BLOCK)]


class Reduction(Protocol):
    """How a transport sums uploads over participants: rows fed a block at a time, the sums
    read at the end (:class:`RowSum`; :class:`dpfl.rounds.secure_sum.SecureSum`)."""

    sums: State

    def add(self, rows: State) -> None: ...


class RowSum:
    """The one reduction of uploads over participants, so that every transport sums in the
    same order and with the same kernels (the engine equals Flower bit for bit): each block of
    :data:`BLOCK` consecutive rows (increasing client id) is summed with one ``sum(dim=0)``, and
    the block sums are added in order. Up to :data:`BLOCK` participants it is one
    ``sum(dim=0)`` over all rows. Fed one block at a time (:meth:`add`), it never holds more
    than a block of rows."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: State = {}

    def add(self, rows: State) -> None:
        """Add the next block's rows ``{upload: [b, ...]}`` (b = :data:`BLOCK`, but in the
        last block)."""
        block = {k: v.to(self.device).sum(dim=0) for k, v in rows.items()}
        self.sums = {k: self.sums[k] + v for k, v in block.items()} if self.sums else block


def sum_rows(rows: State, device: torch.device, total: Reduction | None = None) -> State:
    """Each upload ``[S, ...]`` (rows in increasing client id) summed over the participants on
    ``device``, by the one reduction (:class:`RowSum`), or by ``total`` (an empty one:
    :func:`dpfl.rounds.secure_sum.reduction`)."""
    total = RowSum(device) if total is None else total
    for part in blocks(len(next(iter(rows.values()))) if rows else 0):
        total.add({k: v[part] for k, v in rows.items()})
    return total.sums


def per_client(ids: list[int], diagnostics: dict[str, torch.Tensor]) -> dict[int, dict[str, float]]:
    """``{client: {name: value}}`` from diagnostics ``{name: [C]}`` of the cohort ``ids``."""
    return {c: {k: float(v[i]) for k, v in diagnostics.items()} for i, c in enumerate(ids)}
