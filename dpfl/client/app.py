"""The dpfl ``ClientApp``: Message API handlers driving ``AlgorithmClient``.

Replies (records keyed natively):

* to ``query.clients``: ``hosted`` (``clients``: the client ids this node hosts), ``node``
  (``noise``: where its clients' noise comes from, :data:`dpfl.privacy.randomness.MODES`) and
  ``charged.<id>`` per client (its counts of the run's releases, by release name); or
  ``hosted`` with ``refused``, why the node takes no part;
* to ``train``: per participating client ``c`` an ArrayRecord ``client.<c>`` holding its
  declared uploads, noised by its releases, a ConfigRecord ``charged.<c>`` with its counts of
  the run's releases (nothing derived from its data or its size: the number of exchanges the
  server sent it, for the server to reconcile its ledger with) and, under non-private-diagnostics
  only, a MetricRecord ``diagnostics.<c>``; and ``node``; or a ConfigRecord ``refused``
  (``clients``, ``reason``: the node policy key that refuses, :mod:`dpfl.client.policy`), which
  the node also logs.
"""

from __future__ import annotations

import logging

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dpfl.checkpoint import Lineage
from dpfl.client.cache import node_problem
from dpfl.client.numpy_client import AlgorithmClient, Refused, node_clients
from dpfl.client.state_files import StateFiles, state_folder
from dpfl.errors import ConfigError
from dpfl.problem import Problem

app = ClientApp()
log = logging.getLogger("dpfl")


def _problem(context: Context) -> Problem:
    """The node's view of the run, from its node-local cache (see :mod:`dpfl.client.cache`)."""
    return node_problem(tuple(sorted(context.run_config.items())), tuple(node_clients(context)),
                        str(context.node_config.get("data-path", "")))


def _lineage(config: ConfigRecord) -> Lineage | None:
    """The run's lineage, as the server sends it (``segments``, ``starts``; None from a server
    that sends none)."""
    if "segments" not in config:
        return None
    return Lineage(tuple(zip((str(s) for s in config["segments"]),
                             (int(r) for r in config["starts"]), strict=True)))


def _client(config: ConfigRecord, context: Context, problem: Problem,
            clients: list[int]) -> AlgorithmClient:
    """The node's clients ``clients`` for the exchange ``config`` describes: the run's state
    files on this node, named by its lineage, and the run's name in the node's ledger."""
    lineage = _lineage(config)
    files = None if lineage is None else StateFiles(
        state_folder(context.node_config), lineage, int(problem.config["checkpoint-every"]))
    return AlgorithmClient(problem, context, clients, files,
                           run="" if lineage is None else lineage.run)


def _refused(msg: Message, clients: list[int], reason: str) -> Message:
    log.warning("dpfl: this node refuses clients %s: %s", clients, reason)
    return Message(RecordDict({"refused": ConfigRecord({"clients": clients, "reason": reason})}),
                   reply_to=msg)


@app.query("clients")
def hosted(msg: Message, context: Context) -> Message:
    """Tell the server which clients this node hosts and, for the run's lineage the query
    carries, how often each has been charged each release; or (``refused``) why it hosts
    none."""
    config = msg.content["config"] if "config" in msg.content else ConfigRecord()
    try:
        clients = node_clients(context)
        client = _client(config, context, _problem(context), clients)
        if reason := client.refusal():
            raise Refused(clients, reason)
        content = RecordDict({"hosted": ConfigRecord({"clients": clients}),
                              "node": ConfigRecord({"noise": client.noise})})
        lineage = _lineage(config)  # a resumed run's: up to its checkpoint
        for c, counts in client.counts(0 if lineage is None else lineage.start).items():
            content[f"charged.{c}"] = ConfigRecord(counts)
    except (ConfigError, Refused) as error:  # the server stops the run with it, in one line
        reason = error.reason if isinstance(error, Refused) else str(error)
        log.warning("dpfl: this node takes no part in the run: %s", reason)
        content = RecordDict({"hosted": ConfigRecord({"clients": [], "refused": reason})})
    return Message(content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One exchange of the configured algorithm (see :func:`reply`)."""
    return reply(msg, context, _problem(context))


def reply(msg: Message, context: Context, problem: Problem) -> Message:
    """The node's reply to one exchange (see the module docstring)."""
    config = msg.content["config"]
    hosted = set(node_clients(context))
    clients = [int(c) for c in config["clients"] if int(c) in hosted]
    spec = problem.algorithm.exchange(str(config["exchange"]))
    arrays = msg.content["broadcast"]
    if tuple(arrays) != spec.broadcast:
        raise ValueError(f"exchange {spec.name!r} broadcasts {spec.broadcast}, got "
                         f"{tuple(arrays)}")
    try:
        client = _client(config, context, problem, clients)
        uploads, _, metrics = client.fit([arrays[k].numpy() for k in spec.broadcast],
                                         {"exchange": spec.name, "round": int(config["round"])})
    except Refused as refused:
        return _refused(msg, refused.clients, refused.reason)
    except ConfigError as error:  # the node's own config, or the run's on this node's data
        return _refused(msg, clients, str(error))
    content = RecordDict({"node": ConfigRecord({"noise": client.noise})})
    for i, c in enumerate(clients):
        content[f"client.{c}"] = ArrayRecord(
            {k: Array(u[i]) for k, u in zip(spec.uploads, uploads, strict=True)})
        content[f"charged.{c}"] = ConfigRecord(client.charged[c])
        if metrics:
            content[f"diagnostics.{c}"] = MetricRecord(
                {k.rsplit(".", 1)[0]: v for k, v in metrics.items() if k.endswith(f".{c}")})
    return Message(content, reply_to=msg)
