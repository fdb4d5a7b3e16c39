"""Secure aggregation over a Flower ``Grid``: one exchange through Flower's SecAgg+.

Flower 1.41 ships SecAgg+ (Bell et al., CCS 2020) for its legacy API only: the server workflow
``SecAggPlusWorkflow`` expects a ``LegacyContext`` and a legacy ``Strategy``, and the client mod
``secaggplus_mod`` reads a legacy fit result; there is no Message-API counterpart. dpfl keeps
every line of the protocol Flower's (key agreement, Shamir secret sharing, masking, the
unmasking of dropped nodes) and drives the workflow's four stages from its transport, one
exchange at a time (:func:`secure_exchange`):

1. *setup* and *share keys*: the nodes hosting the exchange's participants make key pairs and
   exchange encrypted shares of their masks' seeds. Nothing derived from data has left a node
   yet, so a node lost here does not stop the exchange: Flower's unmasking would fail for every
   node (the lost node's shares are missing), so the two stages start again with the nodes that
   answered (at most :data:`RESTARTS` times).
2. *collect masked vectors*: each node receives dpfl's own :class:`~dpfl.wire.TrainRequest`
   (the workflow's per-node payload, replaced after setup) and answers with the sum of its
   participants' quantised uploads (:func:`dpfl.rounds.secure_sum.node_vector`), which the
   mod masks; counts of releases and the noise source travel in clear, the uploads never do.
   A refusal stops the exchange here, before anything is unmasked.
3. *unmask*: the surviving nodes send the shares that remove the masks; Flower sums the masked
   vectors, unmasks the total and hands its strategy the aggregate, from which dpfl recovers the
   integer total exactly (:func:`dpfl.rounds.secure_sum.from_flower`): the engine's sums, bit
   for bit.

Every node shares with every other (``num_shares`` = all: SecAgg's complete graph, so that each
node sees every node's status and can check its survivor rule,
:func:`dpfl.client.app.secure_stages`), and the masks are reconstructed from a majority of the
nodes' shares (``reconstruction_threshold`` one half). The protocol is Flower's semi-honest
one: its public keys are not authenticated, so the server is trusted to follow it
(docs/privacy.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import FitIns, Parameters, parameters_to_ndarrays
from flwr.server import LegacyContext
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.serverapp import Grid

from dpfl.flower_internals import (
    MAIN_CONFIGS_RECORD,
    MAIN_PARAMS_RECORD,
    GridClientProxy,
    WorkflowKey,
    WorkflowState,
)
from dpfl.flower_secagg import install_mask_expansion
from dpfl.problem import Problem
from dpfl.rounds import ClientRefused, Replies
from dpfl.rounds.secure_sum import (
    FLOWER_RANGE,
    MODULUS,
    from_flower,
    quantisations,
    quiet_flower,
)
from dpfl.rounds.transport import ClientsLost
from dpfl.wire import SecureTrainReply, TrainRequest

install_mask_expansion()  # before Flower's SecAggPlusWorkflow unmasks anything

#: how many times setup and share-keys start again after losing a node
RESTARTS = 3


def workflow() -> SecAggPlusWorkflow:
    """Flower's workflow with dpfl's parameters: every node shares with every other, a
    majority reconstructs, and a node's sum enters at weight one on :data:`FLOWER_RANGE`
    (:mod:`dpfl.rounds.secure_sum`)."""
    return SecAggPlusWorkflow(num_shares=1.0, reconstruction_threshold=0.5,
                              max_weight=float(FLOWER_RANGE), clipping_range=1.0,
                              quantization_range=FLOWER_RANGE, modulus_range=MODULUS)


class _Shim(LegacyStrategy):
    """The legacy strategy the workflow asks for its nodes and hands the aggregate to."""

    def __init__(self, nodes: list[int], grid: Grid) -> None:
        self.nodes = nodes
        self.grid = grid
        self.aggregate: list[np.ndarray] | None = None
        self.contributed = 0

    def configure_fit(self, server_round, parameters, client_manager):  # type: ignore[override]
        # the workflow reads only each proxy's node id, and sends dpfl's payload (run id 0)
        return [(GridClientProxy(n, self.grid, 0), FitIns(Parameters([], ""), {}))
                for n in self.nodes]

    def aggregate_fit(self, server_round, results, failures):  # type: ignore[override]
        self.aggregate = parameters_to_ndarrays(results[0][1].parameters) if results else None
        self.contributed = len(results)
        return None, {}

    def initialize_parameters(self, client_manager):  # type: ignore[override]
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):  # type: ignore
        return []

    def aggregate_evaluate(self, server_round, results, failures):  # type: ignore[override]
        return None, {}

    def evaluate(self, server_round, parameters):  # type: ignore[override]
        return None


class _Relay(Grid):
    """The grid the workflow talks to: its ``send_and_receive`` is dpfl's wait (round-timeout,
    progress lines, the stop signal), and it keeps the replies of the last call."""

    def __init__(self, grid: Grid, wait: Callable[[list[Message]], list[Message]]) -> None:
        self.grid = grid
        self.wait = wait
        self.replies: list[Message] = []

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        self.replies = self.wait(list(messages))
        return self.replies

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def create_message(self, *args: Any, **kwargs: Any) -> Message:  # pragma: no cover
        return self.grid.create_message(*args, **kwargs)

    def set_run(self, run_id: int) -> None:  # pragma: no cover
        self.grid.set_run(run_id)

    @property
    def run(self):  # type: ignore[override]  # pragma: no cover
        return self.grid.run


def secure_exchange(problem: Problem, grid: Grid, wait: Callable[[list[Message]], list[Message]],
                    requests: dict[int, TrainRequest], survivors: int, *,
                    nodes_count: bool = True) -> Replies:
    """One exchange of ``requests`` (one :class:`~dpfl.wire.TrainRequest` a node) through
    SecAgg+ (module docstring): the uploads' sums over the participants of the nodes whose
    masked vectors were unmasked, and their counts and noise sources; participants of nodes
    lost before the collect stage are ``unreached`` (nothing left them), after it ``lost``.
    Raises :class:`~dpfl.rounds.ClientRefused` when a node refused (before anything is
    unmasked), :class:`~dpfl.rounds.transport.ClientsLost` when fewer than two nodes, or
    participants holding fewer than ``survivors`` noise shares, would be summed, or SecAgg+
    could not unmask. ``nodes_count``: the nodes check the survivors themselves
    (:func:`dpfl.client.app.secure_stages`; not in Flower's simulation, whose nodes trust the
    server), so an n_s no node can count is refused before the key exchange."""
    with quiet_flower():
        return _secure_exchange(problem, grid, wait, requests, survivors, nodes_count)


def _secure_exchange(problem: Problem, grid: Grid,
                     wait: Callable[[list[Message]], list[Message]],
                     requests: dict[int, TrainRequest], survivors: int,
                     nodes_count: bool) -> Replies:
    first = next(iter(requests.values()))
    exchange, server_round = first.exchange, first.server_round
    where = f"round {server_round}, exchange {exchange!r}"
    grids = quantisations(problem, exchange)
    clients_of = {node: request.clients for node, request in requests.items()}
    nodes, unreached = sorted(requests), {}
    relay, flow = _Relay(grid, wait), workflow()
    for _ in range(RESTARTS + 1):
        if len(nodes) < 2:
            raise ClientsLost(f"{where}: secure aggregation needs at least 2 nodes, "
                              f"{len(nodes)} answered")
        countable = min(len(clients_of[n]) for n in nodes) + len(nodes) - 1
        if nodes_count and countable < survivors:  # a node would refuse to unmask
            raise ClientsLost(f"{where}: min-survivors={survivors}, but a node hosting "
                              f"{min(len(clients_of[n]) for n in nodes)} of the participants "
                              f"on {len(nodes)} nodes can count only {countable} noise shares "
                              f"in the sum (its own, and one a node), and would not unmask it: "
                              f"set min-survivors to at most {countable}, or host fewer "
                              f"clients a node")
        shim = _Shim(nodes, relay)
        context = LegacyContext(Context(run_id=0, node_id=0, node_config={},
                                        state=RecordDict(), run_config={}), strategy=shim)
        context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
            {WorkflowKey.CURRENT_ROUND: server_round})
        context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
        state = WorkflowState()
        ready = flow.setup_stage(relay, context, state) and flow.share_keys_stage(
            relay, context, state)
        gone = set(nodes) - set(state.active_node_ids)
        if ready and not gone:
            break
        for node in gone:  # nothing of theirs was released: they are not charged
            unreached.update({c: f"node {node} lost during secure aggregation's key exchange"
                              for c in clients_of[node]})
        nodes = sorted(set(nodes) - gone)
    else:
        raise ClientsLost(f"{where}: secure aggregation lost nodes in its key exchange "
                          f"{RESTARTS + 1} times")
    state.nid_to_fitins = {n: requests[n].encode() for n in nodes}
    collected = flow.collect_masked_vectors_stage(relay, context, state)
    answered = {m.metadata.src_node_id: m for m in relay.replies if not m.has_error()}
    reported: dict[int, dict[str, int]] = {}
    noise: dict[int, str] = {}
    refused: list[ClientRefused] = []
    for node, message in answered.items():
        reply = SecureTrainReply.decode(message.content)
        if isinstance(reply, ClientRefused):
            refused.append(reply)
            continue
        reported.update(reply.charged)
        noise.update({c: reply.noise for c in clients_of[node]})
    sent = [c for n in nodes for c in clients_of[n]]
    if refused:
        silent = {c for r in refused for c in r.clients}
        raise ClientRefused(sorted(silent), "; ".join(dict.fromkeys(r.reason for r in refused)),
                            released=[c for c in sent if c not in silent])
    summed = sorted(c for n in answered for c in clients_of[n])
    lost = {c: f"node {node}: no masked vector" for node in nodes if node not in answered
            for c in clients_of[node]}
    if not collected or len(summed) < survivors:
        raise ClientsLost(f"{where}: secure aggregation kept {len(answered)} nodes holding "
                          f"{len(summed)} participants' noise; min-survivors={survivors} and "
                          f"SecAgg+'s threshold must hold: nothing was unmasked", sent)
    if not flow.unmask_stage(relay, context, state) or shim.aggregate is None:
        raise ClientsLost(f"{where}: SecAgg+ could not unmask the sum (too few shares)", sent)
    sums = {key: from_flower(grid_of, aggregate, shim.contributed, len(summed)).to(
        problem.device) for (key, grid_of), aggregate in zip(grids.items(), shim.aggregate,
                                                              strict=True)}
    return Replies(sums, {}, lost=lost, unreached=unreached, reported=reported, noise=noise)
