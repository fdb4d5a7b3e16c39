"""``AlgorithmStrategy``: the Flower strategy that runs any registered algorithm.

It is the server side of the Flower transport, and thin: ``configure_train`` turns one
exchange's broadcast into one message per node hosting participants (:meth:`dispatch`),
``aggregate_train`` sums the participants' uploads (block by block: the one reduction the
engine uses too, :class:`~dpfl.rounds.RowSum`) and reads what else the replies hold
(:meth:`collect`: the loop's :class:`~dpfl.rounds.Replies`). ``start``
asks every node which clients it hosts, then drives the round loop
(:class:`~dpfl.rounds.RoundLoop`) over a :class:`FlowerTransport` of these two methods: the
loop runs the rounds, their exchanges (one message round-trip each), the budget stop and
the central evaluation, exactly as it does for the engine.

The messages both ends exchange are :mod:`dpfl.wire`'s.

An exchange waits for its replies up to ``round-timeout`` seconds, saying every
:data:`PROGRESS_EVERY` seconds how many are missing; the replies that have not come by then are
lost (``min-clients`` decides whether the run goes on without them).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from dpfl.algorithms import State
from dpfl.checkpoint import Lineage
from dpfl.problem import Problem
from dpfl.rounds import ClientRefused, Replies, RoundLoop, RowSum, Stopped, blocks, drive
from dpfl.rounds.evaluation import SET_METRICS
from dpfl.strategies.secure import secure_exchange
from dpfl.wire import (
    CLIENTS_QUERY,
    ClientsQuery,
    Hosted,
    TrainReply,
    TrainRequest,
    array_record,
)

log = logging.getLogger("dpfl")

PROGRESS_EVERY = 30.0  # seconds between the lines of an exchange that waits for replies
#: seconds discovery waits, once every node online has answered, for another one to come
SETTLE = 10.0
#: seconds discovery waits, at most, for the nodes hosting every client
CONNECT_TIMEOUT = 120.0


def simulated_grid(grid: Grid) -> bool:
    """Whether ``grid`` is Flower's simulation grid (its virtual SuperNodes all register at
    once). Flower gives no public signal; its class name is the one place this is read
    (tests/test_flower.py fails if Flower renames it)."""
    return type(grid).__name__ == "InMemoryGrid"


def ranges(ids: list[int]) -> str:
    """``[0-2, 5, 7-9]`` for sorted ``ids``: runs of consecutive ids in short."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return "[" + ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) + "]"


class FederationError(RuntimeError):
    """The federation does not match the run configuration, or a client failed."""


@dataclass(frozen=True)
class Dispatch:
    """One exchange as sent: its ``messages`` (one a node), the participants sent it
    (``pending``, increasing id), each node's share of them (``clients_of``), and those not
    sent it, with why (``unreached``: their node is offline)."""

    messages: list[Message]
    clients_of: dict[int, list[int]]
    unreached: dict[int, str]
    requests: dict[int, TrainRequest]  # each message's, by node

    @property
    def pending(self) -> list[int]:
        return sorted(c for clients in self.clients_of.values() for c in clients)


def to_record(arrays: State) -> ArrayRecord:
    """Tensors as an ArrayRecord, keys and order kept."""
    return array_record({k: v.detach().cpu().numpy() for k, v in arrays.items()})


def from_record(record: ArrayRecord) -> State:
    return {k: torch.from_numpy(a.numpy().copy()) for k, a in record.items()}


class AlgorithmStrategy(Strategy):
    """Drive the run's algorithm over a Flower ``Grid``.

    Parameters
    ----------
    problem : Problem
        Data, model, algorithm and calibrated releases of the run (built from the run config).
    connect_timeout : float (default: 120)
        Seconds to wait for the nodes hosting every client to connect.
    echo : bool (default: True)
        Print one line per round.
    """

    def __init__(self, problem: Problem, connect_timeout: float = CONNECT_TIMEOUT,
                 echo: bool = True) -> None:
        self.problem = problem
        self.connect_timeout = connect_timeout
        self.round_timeout = problem.config.run.round_timeout
        self.echo = echo
        self.node_of: dict[int, int] = {}
        self.asked: set[int] = set()  # nodes that said which clients they host
        self.reported: dict[int, dict[str, int]] = {}  # the counts the nodes reported at discovery
        self.lineage: Lineage | None = None  # the run's, sent with the discovery query
        self.dispatched: Dispatch | None = None  # configure_train's, for aggregate_train
        self.stopping: int | None = None  # a signal Flower's exit asked to stop on

    def request_stop(self, signum: int) -> None:
        """Ask the run to stop (Flower is exiting on ``signum``): the exchange under way, or
        the next one, raises :class:`~dpfl.rounds.Stopped`, and the round loop closes
        the results folder."""
        self.stopping = signum

    def summary(self) -> None:
        p = self.problem
        log.info("dpfl: algorithm %s (%s), %d clients, d=%d", p.algorithm.name,
                 p.algorithm.protection, p.num_clients, p.model.d)

    # ---- node discovery ------------------------------------------------------------------
    def discover(self, grid: Grid, lineage: Lineage | None = None) -> None:
        """Map client ids to nodes by asking every node which clients it hosts (and, for the
        run's ``lineage``, how often each was charged each release: :attr:`reported`): until
        every client is found, or ``connect_timeout`` passes, or the nodes online have answered
        and no other node has come for :data:`SETTLE` seconds (one second in a simulation, whose
        virtual SuperNodes all register at once); saying every :data:`PROGRESS_EVERY` seconds
        which clients are missing. Raises :class:`FederationError` naming the clients no node
        hosts (and those hosted beyond ``num-partitions``)."""
        self.lineage = lineage
        self.reported = {}
        wanted = set(range(self.problem.num_clients))
        start = time.monotonic()
        settle = 1.0 if simulated_grid(grid) else SETTLE
        seen: set[int] = set()
        came, say = start, start + PROGRESS_EVERY
        while True:
            online = self.ask_new_nodes(grid, strict=True)
            now = time.monotonic()
            if wanted <= set(self.node_of) or now - start > self.connect_timeout:
                break
            if online != seen:
                seen, came = online, now
            elif online and now - came >= settle:
                break
            if now >= say:
                say += PROGRESS_EVERY
                self.say(f"waiting for SuperNodes hosting clients "
                         f"{ranges(sorted(wanted - set(self.node_of)))} ({len(online)} online; "
                         f"{now - start:.0f} s)")
            time.sleep(1.0)
        missing = sorted(wanted - set(self.node_of))
        extra = sorted(set(self.node_of) - wanted)
        if missing or extra:
            n = len(wanted)
            problems = ([f"no SuperNode hosts clients {ranges(missing)}"] if missing else []) + (
                [f"SuperNodes host clients {ranges(extra)} beyond them"] if extra else [])
            raise FederationError(
                f"num-partitions={n}, but {' and '.join(problems)} (the {len(self.asked)} "
                f"SuperNodes that answered in {time.monotonic() - start:.0f} s host "
                f"{ranges(sorted(self.node_of))}); start "
                f"SuperNodes that host every client 0-{n - 1} once (node config partition-ids), "
                f"or set num-partitions to the clients they host (simulation: "
                f"--federation-config \"num-supernodes={n}\", or fewer SuperNodes that each "
                f"host a block of the clients)")

    def say(self, line: str) -> None:
        if self.echo:
            print(line, flush=True)
        else:
            log.info(line)

    def ask_new_nodes(self, grid: Grid, *, strict: bool = False) -> set[int]:
        """Ask the online nodes not asked yet which clients they host (a node that restarted
        rejoins under a new id, or its old one with node authentication); returns the online
        nodes. A failing node stops discovery (``strict``) or is left for later; so does a
        node that refuses to host any client (more SuperNodes than clients), or is left
        unused."""
        online = set(grid.get_node_ids())
        asked = [Message(ClientsQuery(self.lineage).encode(), n, CLIENTS_QUERY)
                 for n in sorted(online - self.asked)]
        for reply in grid.send_and_receive(asked, timeout=self.connect_timeout) if asked else []:
            if reply.has_error():
                if strict:
                    self._raise_on_error(reply)
                continue
            hosted = Hosted.decode(reply.content)
            if isinstance(hosted, ClientRefused):
                if strict:
                    raise FederationError(f"node {reply.metadata.src_node_id} takes no part "
                                          f"in the run: {hosted.reason}")
                continue
            self.asked.add(reply.metadata.src_node_id)
            for c in hosted.clients:
                self.node_of[c] = reply.metadata.src_node_id
            self.reported.update(hosted.charged)
        return online

    # ---- one exchange ----------------------------------------------------------------------
    def dispatch(self, grid: Grid, exchange: str, server_round: int, broadcast: State,
                 participants: list[int]) -> Dispatch:
        """One :class:`~dpfl.wire.TrainRequest` per node hosting some of ``participants``: the
        exchange's ``broadcast`` and the node's share of the participants. Participants whose
        node is offline are not sent it (:attr:`Dispatch.unreached`)."""
        online = self.ask_new_nodes(grid)
        unreached = {c: f"node {self.node_of[c]} offline" for c in participants
                     if self.node_of[c] not in online}
        pending = [c for c in participants if c not in unreached]
        clients_of: dict[int, list[int]] = {}
        for c in pending:
            clients_of.setdefault(self.node_of[c], []).append(c)
        arrays = {k: v.detach().cpu().numpy() for k, v in broadcast.items()}
        requests = {node: TrainRequest(exchange, server_round, ids, arrays, self.lineage)
                    for node, ids in sorted(clients_of.items())}
        messages = [Message(request.encode(), node, MessageType.TRAIN)
                    for node, request in requests.items()]
        return Dispatch(messages, clients_of, unreached, requests)

    def collect(self, dispatch: Dispatch, replies: Iterable[Message]) -> Replies:
        """What the replies to ``dispatch`` hold: each upload summed over the participants
        that replied, in increasing client id (``None`` when none did), their diagnostics,
        counts of the run's releases and noise sources, and why each participant without a
        reply has none. Raises :class:`~dpfl.rounds.ClientRefused` when a node refused the
        exchange: its clients sent nothing, every other participant may have (``released``)."""
        uploads: dict[int, State] = {}
        diagnostics: dict[int, dict[str, float]] = {}
        reported: dict[int, dict[str, int]] = {}
        noise: dict[int, str] = {}
        refused: dict[int, ClientRefused] = {}  # node -> its refusal
        failed: dict[int, str] = {}  # node -> its error
        unattributed: list[str] = []  # errors the SuperLink sent in a node's stead
        for message in replies:
            node = message.metadata.src_node_id
            if message.has_error():
                if node in dispatch.clients_of:
                    failed[node] = message.error.reason
                else:
                    unattributed.append(message.error.reason)
                continue
            reply = TrainReply.decode(message.content)
            if isinstance(reply, ClientRefused):
                refused[node] = reply
                continue
            for c, arrays in reply.uploads.items():
                uploads[c] = {k: torch.from_numpy(a.copy()) for k, a in arrays.items()}
            diagnostics.update(reply.diagnostics)
            reported.update(reply.charged)
            noise.update({c: reply.noise for c in dispatch.clients_of.get(node, [])})
        if refused:
            silent = {c for node in refused for c in dispatch.clients_of.get(node, [])}
            raise ClientRefused(sorted(c for r in refused.values() for c in r.clients),
                                "; ".join(dict.fromkeys(r.reason for r in refused.values())),
                                released=[c for c in dispatch.pending if c not in silent])
        lost = {}
        for c in dispatch.pending:
            if c not in uploads:
                node = self.node_of[c]
                why = failed.get(node) or (unattributed[0] if unattributed else
                                           f"no reply within round-timeout="
                                           f"{self.round_timeout:g} s")
                lost[c] = f"node {node}: {why}"
        sums = None
        if uploads:
            ids = sorted(uploads)
            total = RowSum(self.problem.device)
            for part in blocks(len(ids)):
                total.add({k: torch.stack([uploads[c][k] for c in ids[part]])
                           for k in uploads[ids[0]]})
            sums = total.sums
        return Replies(sums, diagnostics, lost=lost, unreached=dict(dispatch.unreached),
                       reported=reported, noise=noise)

    # ---- Flower's Strategy interface: the transport calls dispatch and collect itself ------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """:meth:`dispatch` of the exchange ``config["exchange"]`` to ``config["clients"]``."""
        self.dispatched = self.dispatch(grid, str(config["exchange"]), server_round,
                                        from_record(arrays), [int(c) for c in config["clients"]])
        return self.dispatched.messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The uploads summed over the participants that replied to the last
        :meth:`configure_train` (:meth:`collect`; ``None`` when none did) and, under
        non-private-diagnostics, the participants' diagnostics as ``<name>.<client>``."""
        if self.dispatched is None:
            raise RuntimeError("aggregate_train before configure_train")
        collected = self.collect(self.dispatched, replies)
        metrics = MetricRecord({f"{k}.{c}": v for c, values in collected.diagnostics.items()
                                for k, v in values.items()}) if collected.diagnostics else None
        return (None if collected.sums is None else to_record(collected.sums)), metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []  # evaluation is central, on the server's test set

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        return None

    @staticmethod
    def _raise_on_error(reply: Message) -> None:
        if reply.has_error():
            raise FederationError(f"node {reply.metadata.src_node_id} failed: "
                                  f"{reply.error.reason}")

    # ---- the run -----------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None
              ) -> Result:
        """Discover the nodes, then run the round loop over them from ``initial_arrays``
        (``x``). ``num_rounds`` must be the run config's ``num-server-rounds``; ``timeout``
        (seconds an exchange waits for replies) is its ``round-timeout`` unless given.
        Evaluation is the loop's (central, every ``eval-every`` rounds); ``evaluate_fn`` is
        called then too, with the global model (``x``), and its metrics join the loop's in
        ``Result.evaluate_metrics_serverapp`` and the round's record (``evaluate_fn``). The
        train and evaluate configs are not used."""
        if num_rounds != self.problem.config.run.num_server_rounds:
            raise FederationError(f"num_rounds={num_rounds} but num-server-rounds="
                                  f"{self.problem.config.run.num_server_rounds}")
        if timeout is not None:
            self.round_timeout = timeout
        self.summary()
        own = None if evaluate_fn is None else (
            lambda server_round, x: evaluate_fn(server_round, to_record({"x": x})))
        loop = RoundLoop(self.problem, "flower", echo=self.echo,
                         x0=from_record(initial_arrays)["x"], evaluate_fn=own)
        self.discover(grid, loop.checkpointer.lineage)
        drive(loop, FlowerTransport(self, grid))
        if loop.stop_reason.startswith("min-clients"):
            raise FederationError(f"stopped after round {loop.rounds_done} ({loop.path}): "
                                  f"{loop.stop_reason}")
        result = Result()
        result.arrays = to_record({"x": self.problem.algorithm.global_params(loop.state)})
        for record in loop.records:
            if "test_loss" in record:
                result.evaluate_metrics_serverapp[record["round"]] = MetricRecord(
                    {**{k: record[k] for k in SET_METRICS if record.get(k) is not None},
                     **record.get("evaluate_fn", {})})
        return result


class FlowerTransport:
    """The round loop's transport over a Flower ``Grid``, through the strategy's
    :meth:`~AlgorithmStrategy.dispatch` and :meth:`~AlgorithmStrategy.collect`."""

    def __init__(self, strategy: AlgorithmStrategy, grid: Grid) -> None:
        self.strategy = strategy
        self.grid = grid

    def begin(self, lineage: Lineage, states: State | None) -> dict[int, dict[str, int]]:
        """The lineage every message carries; the clients keep their own states. Returns the
        counts the nodes reported when they were discovered."""
        if states:
            raise ValueError("a Flower run's checkpoint holds no client state")
        self.strategy.lineage = lineage
        return dict(self.strategy.reported)

    def client_states(self) -> State:
        return {}

    def send_and_receive(self, exchange: str, server_round: int, broadcast: State,
                 participants: list[int]) -> Replies:
        self.check_stop()
        dispatch = self.strategy.dispatch(self.grid, exchange, server_round, broadcast,
                                          participants)
        what = f"round {server_round}, exchange {exchange!r}"
        problem = self.strategy.problem
        if problem.config.secure.secure_aggregation and dispatch.requests:
            began, stages = time.monotonic(), itertools.count(1)
            replies = secure_exchange(
                problem, self.grid,
                lambda messages: self.wait(messages, f"{what}, SecAgg+ stage {next(stages)}",
                                           since=began),
                dispatch.requests, problem.survivors if problem.config.secure.distributed_noise
                else 0, nodes_count=not simulated_grid(self.grid))
            replies.unreached.update(dispatch.unreached)
            return replies
        return self.strategy.collect(dispatch, self.wait(dispatch.messages, what))

    def check_stop(self) -> None:
        """Raise :class:`Stopped` when Flower's exit asked the strategy to stop."""
        if self.strategy.stopping is not None:
            raise Stopped(self.strategy.stopping)

    def wait(self, messages: list[Message], what: str, since: float | None = None
             ) -> list[Message]:
        """Send ``messages`` and collect their replies for up to ``round-timeout`` seconds,
        saying every :data:`PROGRESS_EVERY` seconds how many are missing and how long the
        exchange has waited (since ``since``: its start, for an exchange of several stages)
        (as ``Grid.send_and_receive`` does, but not silently)."""
        waiting = set(self.grid.push_messages(messages))
        total, timeout = len(waiting), self.strategy.round_timeout
        replies: list[Message] = []
        start = time.monotonic()
        per = "an exchange" if since is None else "a stage"
        since = start if since is None else since
        pause, say = 0.05, start + PROGRESS_EVERY
        while waiting:
            self.check_stop()
            pulled = list(self.grid.pull_messages(waiting))
            replies += pulled
            waiting -= {m.metadata.reply_to_message_id for m in pulled}
            now = time.monotonic()
            if not waiting or now - start >= timeout:
                break
            if now >= say:
                say += PROGRESS_EVERY
                self.strategy.say(f"{what}: waiting for {len(waiting)} of {total} replies "
                                  f"({now - since:.0f} s; round-timeout={timeout:g} s {per})")
            pause = 0.05 if pulled else min(2 * pause, 1.0)
            time.sleep(min(pause, max(start + timeout - now, 0.0)))
        return replies
