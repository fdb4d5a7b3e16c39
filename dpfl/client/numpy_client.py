"""``AlgorithmClient``: the algorithm's client side as a Flower ``NumPyClient``.

Its ``answer`` (and ``fit``, the same as Flower's ``NumPyClient`` gives it) runs one exchange of the configured algorithm for the node's participating clients
(one partition in simulation, or a cohort, in one batched call), under the node's own policy
(:mod:`dpfl.client.policy`): it draws their noise and batches where the policy says, refuses
(:class:`~dpfl.rounds.ClientRefused`) what the policy does not accept, a round that would take
a client past the node's ε cap by the node's own ledger, and a repeated round it would answer
with the same noise but other inputs (:mod:`dpfl.client.node_ledger`), and charges every
release in that ledger before the reply leaves. Each client's algorithm state lives in the
node's ``Context.state``, so that it survives the ClientApp being rebuilt every round, and, when
the run checkpoints, in files on the node's disk that a resumed run starts from
(:mod:`dpfl.client.state_files`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.client import NumPyClient

from dpfl.algorithms import State
from dpfl.allocator import keep_freed_memory
from dpfl.client.node_ledger import (
    LedgerStore,
    NodeLedger,
    broadcast_digest,
    initial_chain,
    input_digest,
    stream_context,
)
from dpfl.client.policy import NodeConfigError, NodePolicy
from dpfl.client.state_files import StateFiles
from dpfl.errors import ConfigError
from dpfl.privacy import Release
from dpfl.problem import Problem
from dpfl.rounds import ClientRefused, ClientRuntime
from dpfl.runconfig import RunConfig

log = logging.getLogger("dpfl")


@dataclass(frozen=True)
class Answer:
    """The node's participating clients' answer to one exchange: each declared upload by name,
    stacked over the clients ``[C, ...]`` and noised; each client's counts of the run's
    releases after it (:meth:`~dpfl.client.node_ledger.NodeLedger.counts`); where the node's
    noise came from (:data:`~dpfl.privacy.randomness.MODES`); and, under
    non-private-diagnostics only, each client's diagnostics by name."""

    uploads: dict[str, np.ndarray]
    charged: dict[int, dict[str, int]]
    noise: str
    diagnostics: dict[int, dict[str, float]]


def node_clients(context: Context) -> list[int]:
    """The client ids this node hosts: node config ``partition-ids`` ("0,3,5", the one
    string a SuperNode's ``--node-config`` can carry); else ``partition-id`` p with
    ``num-partitions`` S (what Flower's simulation sets for each of its S virtual SuperNodes):
    block p of the run config's ``num-partitions`` clients shared by S nodes
    (:func:`node_block`: one client per node when S equals it, cohort SuperNodes when S is
    smaller); else client ``partition-id`` alone."""
    node_config = context.node_config
    if "partition-ids" in node_config:
        return sorted(int(c) for c in str(node_config["partition-ids"]).split(","))
    node = int(node_config["partition-id"])
    if "num-partitions" not in node_config:
        return [node]
    return node_block(node, int(node_config["num-partitions"]),
                      RunConfig(context.run_config).data.num_partitions)


def node_block(node: int, nodes: int, clients: int) -> list[int]:
    """Node ``node`` of ``nodes`` sharing clients ``0..clients-1``: the balanced contiguous
    block ``node·clients//nodes`` up to ``(node+1)·clients//nodes`` (blocks in node order,
    disjoint, covering every client, sizes differing by at most one). More nodes than clients
    are refused: a node would host none."""
    if not 0 < nodes <= clients:
        raise ConfigError("num-partitions", f"{clients} clients for {nodes} SuperNodes: a "
                          f"SuperNode would host none",
                          allowed=f"num-partitions of at least {nodes}, or at most {clients} "
                          f"SuperNodes: flwr run --federation-config \"num-supernodes="
                          f"{clients}\", dpfl flower --num-supernodes {clients}")
    return list(range(node * clients // nodes, (node + 1) * clients // nodes))


class AlgorithmClient(NumPyClient):
    """Runs the algorithm's client step for ``clients``, some of the node's clients, under the
    node's policy; ``files`` are the run's state files on this node (None: a server that sends
    no lineage); ``run`` names the run in the node's ledger (its lineage, which a resumed run
    keeps)."""

    def __init__(self, problem: Problem, context: Context, clients: list[int],
                 files: StateFiles | None = None, *, run: str = "", segment: str = "") -> None:
        self.problem = problem
        self.state = context.state
        self.clients = clients
        self.files = files
        self.run = run or f"flower-{context.run_id}"
        self.segment = segment or self.run  # the run's attempt: its start, or a resume
        config = problem.config
        self.policy = NodePolicy.of(context.node_config, config)
        self.context = stream_context(config)
        rng = self.policy.randomness(config.run.seed, self.context)
        self.noise = rng.mode
        self.runtime = ClientRuntime.of(problem, rng=rng)
        keep_freed_memory()  # a cohort node's [clients, d] blocks, reused across messages
        self.store = LedgerStore(self.state, self.ledger_folder())

    def ledger_folder(self) -> Path | None:
        """Where the clients' ledgers are kept (:class:`LedgerStore`): every run's, in the
        node's state folder, for a node that does not trust its server; the run's, beside its
        state files, for one that does and whose run checkpoints; else in ``Context.state``."""
        if not self.policy.trust_server:
            folder = self.policy.state_dir / "ledger"
        elif self.files is not None and self.files.every:
            folder = self.files.folder / "ledger"
        else:
            return None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / ".writable").touch()
        except OSError as error:
            if self.policy.trust_server:  # the run's own ledger: Context.state will do
                log.warning("dpfl: the ledger folder %s cannot be written (%s): a resumed run "
                            "will not see this attempt's releases", folder, error.strerror)
                return None
            raise NodeConfigError("state-dir", f"this node keeps its privacy ledger in "
                                  f"{str(folder)!r}, which cannot be written "
                                  f"({error.strerror})", allowed="a folder this user can "
                                  "write") from None
        return folder

    # ---- what the node accepts -----------------------------------------------------------
    def refusal(self) -> str | None:
        """Why the node refuses every exchange of this run (its policy's algorithms,
        relations, diagnostics and least noise), or None."""
        algorithm = self.problem.algorithm
        multipliers = [r.noise_multiplier for c in self.clients for r in self._releases(c)]
        if math.isfinite(self.policy.max_epsilon) and any(z <= 0 for z in multipliers):
            return (f"node policy max-epsilon={self.policy.max_epsilon:g}: the run's releases "
                    f"without noise (ε = ∞) would pass it")
        return self.policy.refusal(self.problem.config, algorithm.relation) or \
            self.policy.weak_noise(multipliers)

    def counts(self, server_round: int) -> dict[int, dict[str, int]]:
        """How many times each client has been charged each release in this run's rounds up
        to ``server_round`` (what the server reconciles its own ledger with)."""
        with self.store.open(self.clients, write=False) as ledgers:
            return {c: ledgers[c].counts(self.run, server_round) for c in self.clients}

    # ---- persistent per-client state ---------------------------------------------------
    def _load(self) -> tuple[State, list[str]]:
        """The clients' states and their provenance digests: from ``Context.state``, else
        from their state files (a resumed run, a restarted node), else fresh."""
        fresh = self.problem.algorithm.init_client_state(len(self.clients))
        rows: dict[str, list[torch.Tensor]] = {k: [] for k in fresh}
        chains = []
        for i, c in enumerate(self.clients):
            saved: State | None = None
            chain = self.state.get(f"dpfl.chain.{c}")
            if chain is not None:
                record = self.state.get(f"dpfl.state.{c}")
                saved = None if record is None else {
                    k: torch.from_numpy(a.numpy()) for k, a in record.items()}
                chains.append(str(chain["digest"]))
            elif self.files is not None and (kept := self.files.load(c)) is not None:
                saved, text = kept
                chains.append(text)
            else:
                chains.append(initial_chain(self.context, c, self.problem.source))
            for k in fresh:
                rows[k].append(saved[k] if saved else fresh[k][i])
        return {k: torch.stack(v) for k, v in rows.items()}, chains

    def _save(self, server_round: int, states: State, chains: list[str]) -> None:
        for i, c in enumerate(self.clients):
            own = {k: v[i].to("cpu", copy=True) for k, v in states.items()}  # its rows only
            if states:
                self.state[f"dpfl.state.{c}"] = ArrayRecord(
                    {k: Array(v.numpy()) for k, v in own.items()})
            self.state[f"dpfl.chain.{c}"] = ConfigRecord({"digest": chains[i]})
            if self.files is not None:
                self.files.save(c, server_round, own, chains[i])

    # ---- one exchange ----------------------------------------------------------------------
    def answer(self, exchange: str, server_round: int,
               broadcast: dict[str, np.ndarray]) -> Answer:
        """The participating clients' answer to exchange ``exchange`` of round ``server_round``,
        given its ``broadcast`` arrays by name. Raises :class:`~dpfl.rounds.ClientRefused`."""
        algorithm = self.problem.algorithm
        spec = algorithm.exchange(exchange)
        if tuple(broadcast) != spec.broadcast:
            raise ValueError(f"exchange {spec.name!r} broadcasts {spec.broadcast}, got "
                             f"{tuple(broadcast)}")
        tensors = {k: torch.from_numpy(np.asarray(a)) for k, a in broadcast.items()}
        if reason := self.refusal():
            raise ClientRefused(self.clients, reason)
        states, chains = self._load()
        guarded = self.noise != "secure"  # the same noise for the same request
        seen = broadcast_digest(tensors.items()) if guarded else ""
        with self.store.open(self.clients) as ledgers:
            self.check_order(ledgers, exchange, server_round)
            digests = [input_digest(context=self.context, client=c, chain=chain,
                                    server_round=server_round, exchange=exchange, broadcast=seen,
                                    releases=self._releases(c, exchange),
                                    device=str(self.problem.device)) if guarded else chain
                       for c, chain in zip(self.clients, chains, strict=True)]
            new = [c for c, digest in zip(self.clients, digests, strict=True)
                   if not guarded or self.check_replay(ledgers[c], server_round, exchange, digest)]
            self.check_budget(ledgers, new, exchange, server_round)
            uploads, states, diagnostics = self.runtime.step(
                exchange, server_round, tensors, states, self.problem.cohort(self.clients))
            every = self.problem.config.run.checkpoint_every
            for c, digest in zip(self.clients, digests, strict=True):
                ledgers[c].answer(self.run, self.segment, server_round, exchange)
                if c in new:
                    ledgers[c].charge(self.run, server_round, self._releases(c, exchange), every)
                    if guarded:
                        ledgers[c].remember(self.context, server_round, exchange, digest, every)
            self._save(server_round, states, digests)
            charged = {c: ledgers[c].counts(self.run, server_round) for c in self.clients}
        return Answer(
            {k: uploads[k].cpu().numpy() for k in spec.uploads}, charged, self.noise,
            {c: {k: float(v[i]) for k, v in diagnostics.items()}
             for i, c in enumerate(self.clients)} if diagnostics else {})

    # ---- NumPyClient ---------------------------------------------------------------------
    def fit(self, parameters: list[np.ndarray], config: dict) -> tuple[list[np.ndarray], int,
                                                                      dict]:
        """:meth:`answer` as Flower's ``NumPyClient`` gives it: ``parameters`` are the
        exchange's broadcast arrays in their declared order, ``config`` holds ``exchange`` and
        ``round``. Returns the declared uploads in their order, each stacked over ``clients``
        ``[C, ...]`` and noised; the number of clients as the example count (dpfl weights
        clients equally and sends no count); and the diagnostics as Flower's flat metrics,
        ``{"<name>.<client>": value}`` (non-private-diagnostics only)."""
        spec = self.problem.algorithm.exchange(str(config["exchange"]))
        answer = self.answer(spec.name, int(config["round"]),
                             dict(zip(spec.broadcast, parameters, strict=True)))
        return ([answer.uploads[k] for k in spec.uploads], len(self.clients),
                {f"{k}.{c}": v for c, values in answer.diagnostics.items()
                 for k, v in values.items()})

    def check_replay(self, ledger: NodeLedger, server_round: int, exchange: str,
                     digest: str) -> bool:
        """Whether answering ``(round, exchange)`` with inputs ``digest`` is a new release
        (True) or repeats an answer bit for bit (False, nothing new is released); raises
        :class:`~dpfl.rounds.ClientRefused` when it would repeat the noise of an answer to
        other inputs."""
        before = ledger.answered_with(self.context, server_round, exchange)
        if before is None:
            return True
        if before == digest:
            return False
        raise ClientRefused(self.clients, f"replay: round {server_round}, exchange "
                            f"{exchange!r} was answered before with other inputs, and its noise "
                            f"would repeat (noise={self.noise}); a node answers a round once")

    def check_order(self, ledgers: dict[int, NodeLedger], exchange: str,
                    server_round: int) -> None:
        """Refuse an exchange that breaks the algorithm's round structure for one of the
        clients (:meth:`~dpfl.client.node_ledger.NodeLedger.out_of_order`): one it does not
        run in that round, one out of order, a repeat, whatever the node's noise."""
        order = [e.name for e in self.problem.algorithm.round_exchanges(server_round)]
        reasons = {c: ledgers[c].out_of_order(self.run, self.segment, server_round, exchange,
                                              order) for c in self.clients}
        if broken := [c for c, reason in reasons.items() if reason]:
            raise ClientRefused(broken, str(reasons[broken[0]]))

    def check_budget(self, ledgers: dict[int, NodeLedger], clients: list[int], exchange: str,
                     server_round: int) -> None:
        """Refuse exchange ``exchange`` of round ``server_round`` when its releases and those of
        the round's exchanges after it would take one of ``clients`` past the node's ε cap, by
        the node's ledger (its accountant, δ and cap relation): checked before every release,
        so that the round's first exchange admits only a round that fits whole."""
        policy = self.policy
        today = [e.name for e in self.problem.algorithm.round_exchanges(server_round)]
        if math.isinf(policy.max_epsilon):
            return
        rest = today[today.index(exchange):]
        spent = [c for c in clients if ledgers[c].epsilon(
            policy.accountant, policy.delta, [r for r in self._releases(c) if r.exchange in rest],
            relation=policy.cap_relation or self.problem.algorithm.relation
        ) > policy.max_epsilon]
        if spent:
            raise ClientRefused(spent, f"node policy max-epsilon={policy.max_epsilon:g}: "
                                f"round {server_round} would take ε past it "
                                f"(δ={policy.delta:g}, {policy.accountant})")

    def _releases(self, client: int, exchange: str | None = None) -> list[Release]:
        """What the client is charged for: its own releases, and the server's that cover its
        central uploads (client-level) but the population's, which every client is charged each
        round whether it takes part or not (a node learns only the rounds it takes part in:
        the server's ledger keeps them)."""
        algorithm = self.problem.algorithm
        central = algorithm.central_releases().keys() - algorithm.population_releases().keys()
        return [r for r in [*self.problem.releases(client), *(
            r for r in self.problem.server_releases() if r.name in central)]
            if exchange in (None, r.exchange)]
