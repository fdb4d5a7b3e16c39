"""A Flower ``Grid`` that delivers messages to the dpfl ClientApp in this process.

It exercises the same strategy, message and ``Context.state`` code as a real
run, without Ray or SuperLink processes, so that contract tests can use
algorithms registered only inside the test process. Messages pushed are delivered
at once; their replies wait to be pulled.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from uuid import uuid4

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

#: what Flower's simulation gives its virtual nodes (dpfl.client.policy.simulated): a policy that
#: trusts the server; a node config that sets ``trust-server`` keeps its own
SIMULATED = {"trust-server": True}


def as_the_server() -> None:
    """Make this process the ServerApp's task of run 1, as Flower's runtime does before a
    ServerApp runs: a ``Message`` built outside such a task is refused by Flower."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1


class InProcessGrid(Grid):
    """Nodes ``1..N`` with the given node configs, each with its own persistent Context; the
    nodes trust the server, as simulated ones do, unless their config says otherwise."""

    def __init__(self, app, run_config: dict, node_configs: list[dict]) -> None:
        self.app = app
        as_the_server()
        self.contexts = {i + 1: Context(run_id=1, node_id=i + 1, node_config={**SIMULATED, **cfg},
                                        state=RecordDict(), run_config=dict(run_config))
                         for i, cfg in enumerate(node_configs)}
        self.outbox: dict[str, Message] = {}  # replies pushed, not pulled yet

    def set_run(self, run_id: int) -> None:  # pragma: no cover - not used in process
        pass

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # pragma: no cover
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def get_nodes(self):  # pragma: no cover
        raise NotImplementedError

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver ``messages`` at once, through :meth:`send_and_receive` (which subclasses
        override to fail, drop or record replies); :meth:`pull_messages` hands the replies
        out."""
        messages = list(messages)
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid4())
        for reply in self.send_and_receive(messages):
            self.outbox[reply.metadata.reply_to_message_id] = reply
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        wanted = set(message_ids)
        return [self.outbox.pop(i) for i in list(self.outbox) if i in wanted]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None
                         ) -> Iterable[Message]:
        replies = []
        for message in messages:  # a copy each, as a real grid delivers them (Flower's SecAgg+
            # workflow sends one record to every node, and its mod pops from it)
            node = message.metadata.dst_node_id
            reply = self.app(copy.deepcopy(message), self.contexts[node])
            replies.append(reply)
        return replies


def run_flower_code_path(values: dict, node_configs: list[dict], *,
                         grid_class: type[InProcessGrid] = InProcessGrid,
                         connect_timeout: float = 120.0):
    """Run ``values`` through the real AlgorithmStrategy and ClientApp over an in-process
    grid with one node per entry of ``node_configs``; returns ``(grid, problem)``."""
    from dpfl.client.app import app as client_app
    from dpfl.problem import cached_problem
    from dpfl.runconfig import RunConfig
    from dpfl.strategies import AlgorithmStrategy
    from dpfl.strategies.algorithm import to_record

    config = RunConfig(values)
    grid = grid_class(client_app, config.as_dict(), node_configs)
    problem = cached_problem(tuple(sorted(config.as_dict().items())))
    strategy = AlgorithmStrategy(problem, connect_timeout=connect_timeout, echo=False)
    strategy.start(grid=grid, initial_arrays=to_record({"x": problem.x0}),
                   num_rounds=int(config["num-server-rounds"]))
    return grid, problem


def assert_flower_equals_engine(tmp_path, values: dict, num_nodes: int) -> None:
    """``values`` run by the engine and over the Flower code path, one node per partition:
    the same final model bit for bit, and the same largest ε."""
    import json

    import torch

    from dpfl.engine import run
    from dpfl.runconfig import RunConfig

    values = {**values, "results-dir": str(tmp_path)}
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    run_flower_code_path({**values, "run-name": "flower"},
                         [{"partition-id": i} for i in range(num_nodes)])
    e, f = (torch.load(tmp_path / name / "model.pt") for name in ("engine", "flower"))
    assert e.keys() == f.keys() and all(torch.equal(e[key], f[key]) for key in e)
    summaries = [json.loads((tmp_path / name / "summary.json").read_text())
                 for name in ("engine", "flower")]
    assert summaries[0]["epsilon_max"] == summaries[1]["epsilon_max"]


def train_message(broadcast: dict, exchange: str, server_round: int, clients: list[int],
                  lineage=None, node: int = 1) -> Message:
    """The server's ``train`` request (:class:`dpfl.wire.TrainRequest`) of ``exchange`` for
    ``clients`` on ``node``, broadcasting the tensors ``broadcast``."""
    from flwr.app import MessageType

    from dpfl.wire import TrainRequest

    arrays = {k: v.detach().cpu().numpy() for k, v in broadcast.items()}
    return Message(TrainRequest(exchange, server_round, list(clients), arrays, lineage).encode(),
                   node, MessageType.TRAIN)
