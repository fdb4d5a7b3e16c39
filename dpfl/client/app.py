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
from collections.abc import Callable, Mapping

import torch
from flwr.app import ConfigRecord, Context, Message
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable

from dpfl.checkpoint import Lineage
from dpfl.client.cache import node_problem
from dpfl.client.numpy_client import AlgorithmClient, node_clients
from dpfl.client.policy import NodeConfigError, NodePolicy
from dpfl.client.state_files import StateFiles, state_folder
from dpfl.config import Value
from dpfl.errors import ConfigError
from dpfl.flower_internals import RECORD_KEY_CONFIGS, SecAggKey, Stage
from dpfl.flower_secagg import install_mask_expansion
from dpfl.problem import Problem
from dpfl.rounds import ClientRefused
from dpfl.rounds.secure_sum import node_vector, quantisations, quiet_flower
from dpfl.runconfig import RunConfig
from dpfl.wire import (
    ClientsQuery,
    Hosted,
    SecureTrainReply,
    TrainReply,
    TrainRequest,
    encode_refusal,
)

install_mask_expansion()  # before Flower's secaggplus_mod masks anything
app = ClientApp()
log = logging.getLogger("dpfl")


def _problem(context: Context) -> Problem:
    """The node's view of the run, from its node-local cache (see :mod:`dpfl.client.cache`).
    A node that sets its own ``min-client-records`` compares the run's with it first, by the
    two values alone: the node reads its data only for a run that trains under the node's own
    bound, so that no refusal depends on how many records it holds."""
    own = context.node_config.get("min-client-records")
    declared = RunConfig(context.run_config).privacy.min_client_records
    if own is not None and str(own) != str(declared):
        raise NodeConfigError("min-client-records", f"the node trains under its own bound, "
                              f"{own}, and the run declares {declared}", allowed=str(own))
    return node_problem(tuple(sorted(context.run_config.items())), tuple(node_clients(context)),
                        str(context.node_config.get("data-path", "")))


def _client(lineage: Lineage | None, context: Context, problem: Problem,
            clients: list[int]) -> AlgorithmClient:
    """The node's clients ``clients`` in the run of ``lineage``: the run's state files on this
    node, named by its lineage, and the run's name in the node's ledger (None: a server that
    sends no lineage)."""
    files = None if lineage is None else StateFiles(
        state_folder(context.node_config), lineage, problem.config.run.checkpoint_every)
    return AlgorithmClient(problem, context, clients, files,
                           run="" if lineage is None else lineage.run,
                           segment="" if lineage is None else lineage.current)


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


#: the node's own record of its last SecAgg+ exchange: how many participants its sum held
SECURE_STATE = "dpfl.secure"


def secure_stages(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's ``secaggplus_mod`` for the messages of its stages (they carry its configs), and
    for those only: dpfl's plain requests go to the handler as they are. Before the unmask
    stage a node that does not trust the server checks its own rule for distributed noise: the
    sum about to be unmasked must hold at least ``min-survivors`` clients' shares of the noise,
    which it counts as its own participants plus one for every other node still active (each
    hosts at least one); else it sends no share, so that nothing is unmasked. A node that
    trusts the server (node config ``trust-server``, a simulated one) leaves the count to the
    server, which knows every node's participants."""
    configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
    if configs is None:
        return call_next(msg, context)
    if configs.get(SecAggKey.STAGE) == Stage.UNMASK:
        problem = _problem(context)
        if problem.config.secure.distributed_noise and not NodePolicy.of(
                context.node_config, problem.config).trust_server:
            own = context.state.config_records.get(SECURE_STATE, {}).get("participants", 0)
            held = int(own) + len(configs.get(SecAggKey.ACTIVE_NODE_ID_LIST, [])) - 1
            if held < problem.survivors:
                reason = (f"distributed-noise: the sum to unmask holds at least {held} clients' "
                          f"noise shares, min-survivors={problem.survivors}: this node sends no "
                          f"share to unmask it")
                log.warning("dpfl: this node %s", reason)
                raise ClientRefused(node_clients(context), reason)
    with quiet_flower():
        return secaggplus_mod(msg, context, call_next)


@app.train(mods=[secure_stages])
def train(msg: Message, context: Context) -> Message:
    """One exchange of the configured algorithm (see :func:`reply`); a run this node does not
    build (its own config's, or the run's on this node's data) is refused as at discovery,
    whichever request comes first."""
    try:
        problem = _problem(context)
    except ConfigError as error:
        return _refused(msg, ClientRefused(node_clients(context), str(error)), "refuses")
    return reply(msg, context, problem)


def reply(msg: Message, context: Context, problem: Problem) -> Message:
    """The node's :class:`~dpfl.wire.TrainReply` to one exchange, or its refusal."""
    request = TrainRequest.decode(msg.content)
    hosted = set(node_clients(context))
    clients = [c for c in request.clients if c in hosted]
    spec = problem.algorithm.exchange(request.exchange)
    secure = RECORD_KEY_CONFIGS in msg.content.config_records  # through SecAgg+'s mod
    try:
        if problem.config.secure.distributed_noise and not secure:
            raise ClientRefused(clients, "distributed-noise: this node adds a share of its "
                                "noise only to uploads that Flower's SecAgg+ masks, and this "
                                "request came without it")
        answer = _client(request.lineage, context, problem, clients).answer(
            spec.name, request.server_round, dict(request.broadcast))
    except (ClientRefused, ConfigError) as error:  # ConfigError: the node's own config, or
        # the run's on this node's data
        refused = error if isinstance(error, ClientRefused) else ClientRefused(clients,
                                                                               str(error))
        log.warning("dpfl: this node refuses clients %s: %s", refused.clients, refused.reason)
        content = (SecureTrainReply.refusal(refused, len(spec.uploads)) if secure
                   else encode_refusal(refused))
        return Message(content, reply_to=msg)
    if secure:
        grids = quantisations(problem, spec.name)
        context.state.config_records[SECURE_STATE] = ConfigRecord({"participants": len(clients)})
        return Message(SecureTrainReply(
            [node_vector(grids[k], torch.as_tensor(answer.uploads[k])) for k in spec.uploads],
            answer.charged, answer.noise).encode(), reply_to=msg)
    return Message(TrainReply(
        {c: {k: answer.uploads[k][i] for k in spec.uploads} for i, c in enumerate(clients)},
        answer.charged, answer.noise, answer.diagnostics).encode(), reply_to=msg)


def client_app(run_config: Callable[[Context], Mapping[str, Value]]) -> ClientApp:
    """A ClientApp that answers as :data:`app` does, for the run ``run_config(context)`` gives,
    whatever run config Flower gives the app: a user's own app, whose run config holds its own
    keys (:class:`dpfl.PrivateFederation`). Each handler sees the node's context (its node
    config, state and run) with that run config."""
    own = ClientApp()

    def ours(context: Context) -> Context:
        return Context(run_id=context.run_id, node_id=context.node_id,
                       node_config=context.node_config, state=context.state,
                       run_config=dict(run_config(context)))

    def stages(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        return secure_stages(msg, ours(context), call_next)

    own.query("clients")(lambda msg, context: hosted(msg, ours(context)))
    own.train(mods=[stages])(train)  # the mod hands the handler its context
    return own
