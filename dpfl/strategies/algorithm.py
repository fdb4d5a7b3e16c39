"""``AlgorithmStrategy``: a Flower strategy that runs any registered algorithm.

The strategy is thin. ``configure_train`` turns the algorithm's broadcast into
one message per node hosting participants; ``aggregate_train`` splits the
replies by client id and hands them to the shared server runtime, which applies
the algorithm's ``server_step``. Rounds with several exchanges (a statistic
query, then training) send one message round-trip per exchange; ``start`` runs
them in order, evaluates centrally, and stops at ``max-epsilon``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from dpfl.algorithms import State
from dpfl.server.runtime import ServerRuntime, stack_uploads

log = logging.getLogger("dpfl")


class FederationError(RuntimeError):
    """The federation does not match the run configuration, or a client failed."""


class AlgorithmStrategy(Strategy):
    """Drive the run's algorithm over a Flower ``Grid``.

    Parameters
    ----------
    server : ServerRuntime
        Server state, evaluation and results of the run (built from the run config).
    connect_timeout : float (default: 120)
        Seconds to wait for the nodes hosting every client to connect.
    """

    def __init__(self, server: ServerRuntime, connect_timeout: float = 120.0) -> None:
        self.server = server
        self.connect_timeout = connect_timeout
        self.node_of: dict[int, int] = {}
        self.pending: dict[str, list[int]] = {}

    def summary(self) -> None:
        p = self.server.problem
        log.info("dpfl: algorithm %s (%s), %d clients, d=%d", p.algorithm.name,
                 p.algorithm.protection, p.num_clients, p.model.d)

    # ---- node discovery ------------------------------------------------------------------
    def discover(self, grid: Grid) -> None:
        """Map client ids to nodes by asking every node which clients it hosts."""
        wanted = set(range(self.server.problem.num_clients))
        deadline = time.monotonic() + self.connect_timeout
        while True:
            nodes = list(grid.get_node_ids())
            query = [Message(RecordDict({"config": ConfigRecord({})}), n, MessageType.QUERY)
                     for n in nodes if n not in self.node_of.values()]
            for reply in grid.send_and_receive(query, timeout=self.connect_timeout):
                self._raise_on_error(reply)
                for c in reply.content["config"]["clients"]:
                    self.node_of[int(c)] = reply.metadata.src_node_id
            if wanted <= set(self.node_of) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        missing = sorted(wanted - set(self.node_of))
        extra = sorted(set(self.node_of) - wanted)
        if missing or extra:
            raise FederationError(
                f"num-partitions={len(wanted)} but the connected nodes host clients "
                f"{sorted(self.node_of)}; start one SuperNode per partition "
                f"(simulation: --federation-config \"num-supernodes={len(wanted)}\")")

    # ---- one exchange ----------------------------------------------------------------------
    def configure_exchange(self, exchange: str, server_round: int,
                           participants: list[int]) -> list[Message]:
        broadcast = self.server.broadcast(exchange, server_round)
        keys = sorted(broadcast)
        arrays = ArrayRecord({k: Array(broadcast[k].detach().cpu().contiguous().numpy())
                              for k in keys})
        by_node: dict[int, list[int]] = {}
        for c in participants:
            by_node.setdefault(self.node_of[c], []).append(c)
        self.pending[exchange] = list(participants)
        return [Message(RecordDict({"arrays": arrays, "config": ConfigRecord({
                    "exchange": exchange, "round": server_round, "keys": ",".join(keys),
                    "clients": ",".join(str(c) for c in ids)})}), node, MessageType.TRAIN)
                for node, ids in sorted(by_node.items())]

    def aggregate_exchange(self, exchange: str, server_round: int,
                           replies: Iterable[Message]) -> dict[int, dict[str, float]] | None:
        """Apply ``server_step``; returns per-client metrics, or None if a client refused
        the round (its privacy budget would be exceeded)."""
        uploads: dict[int, State] = {}
        metrics: dict[int, dict[str, float]] = {}
        for reply in replies:
            self._raise_on_error(reply)
            m = reply.content["metrics"]
            if int(m["refused"]):
                return None
            ids = [int(c) for c in m["clients"]]
            arrays = reply.content["arrays"]
            keys = [k for k in str(reply.content["config"]["keys"]).split(",") if k]
            for i, c in enumerate(ids):
                uploads[c] = {k: torch.from_numpy(arrays[k].numpy()[i].copy()) for k in keys}
                metrics[c] = {k: float(v[i]) for k, v in m.items()
                              if isinstance(v, list) and k != "clients"}
        missing = sorted(set(self.pending[exchange]) - set(uploads))
        if missing:
            raise FederationError(f"round {server_round}: no reply from clients {missing}")
        self.server.aggregate(exchange, server_round, *stack_uploads(uploads))
        return metrics

    @staticmethod
    def _raise_on_error(reply: Message) -> None:
        if reply.has_error():
            raise FederationError(f"node {reply.metadata.src_node_id} failed: "
                                  f"{reply.error.reason}")

    # ---- Strategy interface ---------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self.configure_exchange("train", server_round,
                                       self.server.participants(server_round))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        metrics = self.aggregate_exchange("train", server_round, replies)
        return self.global_arrays(), None if metrics is None else self._mean(metrics)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []  # evaluation is central, on the server's test set

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        return None

    def global_arrays(self) -> ArrayRecord:
        params = self.server.problem.algorithm.global_params(self.server.state)
        return ArrayRecord({"x": Array(params.detach().cpu().contiguous().numpy())})

    @staticmethod
    def _mean(metrics: dict[int, dict[str, float]]) -> MetricRecord:
        keys = {k for m in metrics.values() for k in m}
        return MetricRecord({k: sum(m[k] for m in metrics.values()) / len(metrics)
                             for k in sorted(keys)})

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None
              ) -> Result:
        """Run every round's exchanges in order; central evaluation; budget stop."""
        self.summary()
        self.discover(grid)
        server, result = self.server, Result()
        server.open()
        for server_round in range(1, num_rounds + 1):
            if server.should_stop(server_round):
                break
            participants = server.participants(server_round)
            metrics: dict[int, dict[str, float]] | None = {}
            for exchange in server.problem.algorithm.exchanges:
                replies = grid.send_and_receive(
                    self.configure_exchange(exchange, server_round, participants),
                    timeout=timeout)
                metrics = self.aggregate_exchange(exchange, server_round, replies)
                if metrics is None:
                    server.stop_reason = f"max-epsilon: a client refused round {server_round}"
                    break
            if metrics is None:
                break
            record = server.end_round(server_round, metrics)
            result.train_metrics_clientapp[server_round] = self._mean(metrics)
            if "test_loss" in record:
                result.evaluate_metrics_serverapp[server_round] = MetricRecord(
                    {k: record[k] for k in ("test_loss", "test_accuracy")
                     if record.get(k) is not None})
        server.finish()
        result.arrays = self.global_arrays()
        return result
