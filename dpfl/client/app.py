"""The dpfl ``ClientApp``: Message API handlers driving ``AlgorithmClient``.

It answers the server's two requests (:mod:`dpfl.wire`): ``query.clients``
(:class:`~dpfl.wire.ClientsQuery`) with the clients the node hosts and their counts of the run's
releases (:class:`~dpfl.wire.Hosted`), and ``train`` (:class:`~dpfl.wire.TrainRequest`) with
its participating clients' noised uploads (:class:`~dpfl.wire.TrainReply`); either with a
refusal (:class:`~dpfl.rounds.ClientRefused`: the node-policy key that refuses, which the node
also logs).
"""

from __future__ import annotations

import logging

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from dpfl.checkpoint import Lineage
from dpfl.client.cache import node_problem
from dpfl.client.numpy_client import AlgorithmClient, node_clients
from dpfl.client.state_files import StateFiles, state_folder
from dpfl.errors import ConfigError
from dpfl.problem import Problem
from dpfl.rounds import ClientRefused
from dpfl.wire import ClientsQuery, Hosted, TrainReply, TrainRequest, encode_refusal

app = ClientApp()
log = logging.getLogger("dpfl")


def _problem(context: Context) -> Problem:
    """The node's view of the run, from its node-local cache (see :mod:`dpfl.client.cache`)."""
    return node_problem(tuple(sorted(context.run_config.items())), tuple(node_clients(context)),
                        str(context.node_config.get("data-path", "")))


def _client(lineage: Lineage | None, context: Context, problem: Problem,
            clients: list[int]) -> AlgorithmClient:
    """The node's clients ``clients`` in the run of ``lineage``: the run's state files on this
    node, named by its lineage, and the run's name in the node's ledger (None: a server that
    sends no lineage)."""
    files = None if lineage is None else StateFiles(
        state_folder(context.node_config), lineage, int(problem.config["checkpoint-every"]))
    return AlgorithmClient(problem, context, clients, files,
                           run="" if lineage is None else lineage.run)


def _refused(msg: Message, refused: ClientRefused, what: str) -> Message:
    log.warning("dpfl: this node %s: %s", what, refused.reason)
    return Message(encode_refusal(refused), reply_to=msg)


@app.query("clients")
def hosted(msg: Message, context: Context) -> Message:
    """Tell the server which clients this node hosts and, for the run's lineage the query
    carries, how often each has been charged each release; or why it hosts none."""
    lineage = ClientsQuery.decode(msg.content).lineage
    clients: list[int] = []
    try:
        clients = node_clients(context)
        client = _client(lineage, context, _problem(context), clients)
        if reason := client.refusal():
            raise ClientRefused(clients, reason)
        # a resumed run's counts: up to its checkpoint
        counts = client.counts(0 if lineage is None else lineage.start)
    except ClientRefused as refused:  # the server stops the run with it, in one line
        return _refused(msg, refused, "takes no part in the run")
    except ConfigError as error:
        return _refused(msg, ClientRefused(clients, str(error)), "takes no part in the run")
    return Message(Hosted(clients, counts).encode(), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One exchange of the configured algorithm (see :func:`reply`)."""
    return reply(msg, context, _problem(context))


def reply(msg: Message, context: Context, problem: Problem) -> Message:
    """The node's :class:`~dpfl.wire.TrainReply` to one exchange, or its refusal."""
    request = TrainRequest.decode(msg.content)
    hosted = set(node_clients(context))
    clients = [c for c in request.clients if c in hosted]
    spec = problem.algorithm.exchange(request.exchange)
    if tuple(request.broadcast) != spec.broadcast:
        raise ValueError(f"exchange {spec.name!r} broadcasts {spec.broadcast}, got "
                         f"{tuple(request.broadcast)}")
    try:
        client = _client(request.lineage, context, problem, clients)
        uploads, _, metrics = client.fit(list(request.broadcast.values()),
                                         {"exchange": spec.name, "round": request.server_round})
    except ClientRefused as refused:
        return _refused(msg, refused, f"refuses clients {refused.clients}")
    except ConfigError as error:  # the node's own config, or the run's on this node's data
        return _refused(msg, ClientRefused(clients, str(error)), f"refuses clients {clients}")
    return Message(TrainReply(
        {c: {k: u[i] for k, u in zip(spec.uploads, uploads, strict=True)}
         for i, c in enumerate(clients)},
        {c: client.charged[c] for c in clients}, client.noise,
        {c: {k.rsplit(".", 1)[0]: v for k, v in metrics.items() if k.endswith(f".{c}")}
         for c in clients} if metrics else {}).encode(), reply_to=msg)
