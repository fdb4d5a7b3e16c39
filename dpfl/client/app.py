"""The dpfl ``ClientApp``: Message API handlers driving ``AlgorithmClient``."""

from __future__ import annotations

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dpfl.checkpoint import Lineage
from dpfl.client.cache import node_problem
from dpfl.client.numpy_client import AlgorithmClient, BudgetSpent, node_clients
from dpfl.client.state_files import StateFiles, state_folder
from dpfl.errors import ConfigError
from dpfl.problem import Problem

app = ClientApp()


def _problem(context: Context) -> Problem:
    """The node's view of the run, from its node-local cache (see :mod:`dpfl.client.cache`)."""
    return node_problem(tuple(sorted(context.run_config.items())), tuple(node_clients(context)),
                        str(context.node_config.get("data-path", "")))


@app.query("clients")
def hosted(msg: Message, context: Context) -> Message:
    """Tell the server which clients this node hosts, or (``refused``) why it hosts none."""
    try:
        hosted = ConfigRecord({"clients": node_clients(context)})
    except ConfigError as error:  # the server stops the run with it, in one line
        hosted = ConfigRecord({"clients": [], "refused": str(error)})
    return Message(RecordDict({"hosted": hosted}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One exchange of the configured algorithm (see :func:`reply`)."""
    return reply(msg, context, _problem(context))


def _state_files(config: ConfigRecord, context: Context, problem: Problem) -> StateFiles | None:
    """The run's state files on this node, from the lineage the server sends (``segments``,
    ``starts``; none from a server that sends none)."""
    if "segments" not in config:
        return None
    lineage = Lineage(tuple(zip((str(s) for s in config["segments"]),
                                (int(r) for r in config["starts"]), strict=True)))
    return StateFiles(state_folder(context.node_config), lineage,
                      int(problem.config["checkpoint-every"]))


def reply(msg: Message, context: Context, problem: Problem) -> Message:
    """The node's reply to one exchange: per participating client ``c``, an ArrayRecord
    ``client.<c>`` holding its declared uploads, noised by its releases, and a ConfigRecord
    ``ledger.<c>`` with its own ledger (public: the releases it was charged, for the server to
    check against its own; and, under non-private-diagnostics only, a MetricRecord
    ``diagnostics.<c>``); or a ConfigRecord ``refused`` naming the clients whose privacy budget
    is spent."""
    config = msg.content["config"]
    hosted = set(node_clients(context))
    clients = [int(c) for c in config["clients"] if int(c) in hosted]
    spec = problem.algorithm.exchange(str(config["exchange"]))
    arrays = msg.content["broadcast"]
    if tuple(arrays) != spec.broadcast:
        raise ValueError(f"exchange {spec.name!r} broadcasts {spec.broadcast}, got "
                         f"{tuple(arrays)}")
    client = AlgorithmClient(problem, context, clients, _state_files(config, context, problem))
    try:
        uploads, _, metrics = client.fit([arrays[k].numpy() for k in spec.broadcast],
                                         {"exchange": spec.name, "round": int(config["round"])})
    except BudgetSpent as spent:
        return Message(RecordDict({"refused": ConfigRecord({"clients": spent.clients})}),
                       reply_to=msg)
    content = RecordDict()
    for i, c in enumerate(clients):
        content[f"client.{c}"] = ArrayRecord(
            {k: Array(u[i]) for k, u in zip(spec.uploads, uploads, strict=True)})
        content[f"ledger.{c}"] = ConfigRecord(
            {"json": str(context.state[f"dpfl.ledger.{c}"]["json"])})
        if metrics:
            content[f"diagnostics.{c}"] = MetricRecord(
                {k.rsplit(".", 1)[0]: v for k, v in metrics.items() if k.endswith(f".{c}")})
    return Message(content, reply_to=msg)
