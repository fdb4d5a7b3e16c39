"""``AlgorithmClient``: the algorithm's client side as a Flower ``NumPyClient``.

Its ``fit`` runs one exchange of the configured algorithm for the node's participating clients
(one partition in simulation, or a cohort, in one batched call), keeping each client's algorithm
state and privacy ledger in the node's ``Context.state`` so they survive the ClientApp being
rebuilt every round, and, when the run checkpoints, in files on the node's disk that a resumed
run starts from (:mod:`dpfl.client.state_files`). A client refuses a round that would take its
own ledger past ``max-epsilon`` (:class:`BudgetSpent`): the server's driver stops before such a
round, so an honest server never sees a refusal.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.client import NumPyClient

from dpfl.algorithms import State
from dpfl.client.state_files import StateFiles
from dpfl.errors import ConfigError
from dpfl.privacy import PrivacyLedger
from dpfl.problem import Problem
from dpfl.rounds import ClientRuntime


def node_clients(context: Context) -> list[int]:
    """The client ids this node hosts: node config ``partition-ids`` ("0,3,5", the one
    string a SuperNode's ``--node-config`` can carry); else ``partition-id`` p with
    ``num-partitions`` S (what Flower's simulation sets for each of its S virtual SuperNodes):
    block p of the run config's ``num-partitions`` clients shared by S nodes
    (:func:`node_block`: one client per node when S equals it, cohort SuperNodes when S is
    smaller); else client ``partition-id`` alone."""
    cfg = context.node_config
    if "partition-ids" in cfg:
        return sorted(int(c) for c in str(cfg["partition-ids"]).split(","))
    node = int(cfg["partition-id"])
    if "num-partitions" not in cfg:
        return [node]
    return node_block(node, int(cfg["num-partitions"]), int(context.run_config["num-partitions"]))


def node_block(node: int, nodes: int, clients: int) -> list[int]:
    """Node ``node`` of ``nodes`` sharing clients ``0..clients-1``: the balanced contiguous
    block ``node·clients//nodes`` up to ``(node+1)·clients//nodes`` (blocks in node order,
    disjoint, covering every client, sizes differing by at most one). More nodes than clients
    are refused: a node would host none."""
    if not 0 < nodes <= clients:
        raise ConfigError("num-partitions", f"{clients} clients for {nodes} SuperNodes: a "
                          f"SuperNode would host none; run at most {clients} SuperNodes "
                          f"(simulation: --federation-config \"num-supernodes={clients}\")",
                          allowed=f"at least the {nodes} SuperNodes")
    return list(range(node * clients // nodes, (node + 1) * clients // nodes))


def node_secure_noise(context: Context) -> bool:
    """Node config ``secure-noise``: a node that sets it draws its clients' noise and batches
    from the OS CSPRNG whatever the run config says (a node protects its own data; the
    deployment examples set it on every SuperNode)."""
    value = context.node_config.get("secure-noise", False)
    text = str(value).lower()
    if text not in ("true", "false"):
        raise ConfigError("secure-noise", f"node config value {value!r}", allowed="true, false")
    return text == "true"


class BudgetSpent(RuntimeError):
    """Clients refuse a round: its releases would take their ε past ``max-epsilon``."""

    def __init__(self, clients: list[int]) -> None:
        super().__init__(f"clients {clients} refuse: their privacy budget is spent")
        self.clients = clients


class AlgorithmClient(NumPyClient):
    """Runs the algorithm's client step for ``clients``, some of the node's clients; ``files``
    are the run's state files on this node (None: a server that sends no lineage)."""

    def __init__(self, problem: Problem, context: Context, clients: list[int],
                 files: StateFiles | None = None) -> None:
        self.problem = problem
        self.state = context.state
        self.clients = clients
        self.files = files
        self.runtime = ClientRuntime.of(problem, secure=node_secure_noise(context))

    # ---- persistent per-client state ---------------------------------------------------
    def _load(self) -> tuple[State, list[PrivacyLedger]]:
        """The clients' states and ledgers: from ``Context.state``, else from their state
        files (a resumed run, a restarted node), else fresh."""
        fresh = self.problem.algorithm.init_client_state(len(self.clients))
        rows: dict[str, list[torch.Tensor]] = {k: [] for k in fresh}
        ledgers = []
        cfg = self.problem.config
        for i, c in enumerate(self.clients):
            saved: State | None = None
            ledger = self.state.get(f"dpfl.ledger.{c}")
            if ledger is not None:
                record = self.state.get(f"dpfl.state.{c}")
                saved = None if record is None else {
                    k: torch.from_numpy(a.numpy()) for k, a in record.items()}
                text: str | None = str(ledger["json"])
            elif self.files is not None and (kept := self.files.load(c)) is not None:
                saved, text = kept
            else:
                text = None
            for k in fresh:
                rows[k].append(saved[k] if saved else fresh[k][i])
            ledgers.append(PrivacyLedger.from_json(text) if text is not None
                           else PrivacyLedger(str(cfg["accountant"]),
                                              self.problem.algorithm.relation))
        return {k: torch.stack(v) for k, v in rows.items()}, ledgers

    def _save(self, round: int, states: State, ledgers: list[PrivacyLedger]) -> None:
        for i, c in enumerate(self.clients):
            own = {k: v[i].clone() for k, v in states.items()}  # this client's rows only
            if states:
                self.state[f"dpfl.state.{c}"] = ArrayRecord(
                    {k: Array(v.numpy()) for k, v in own.items()})
            self.state[f"dpfl.ledger.{c}"] = ConfigRecord({"json": ledgers[i].to_json()})
            if self.files is not None:
                self.files.save(c, round, own, ledgers[i].to_json())

    # ---- NumPyClient ---------------------------------------------------------------------
    def fit(self, parameters: list[np.ndarray], config: dict) -> tuple[list[np.ndarray], int,
                                                                      dict]:
        """One exchange: ``parameters`` are its broadcast arrays in their declared order,
        ``config`` holds ``exchange`` and ``round``. Returns the declared uploads, each stacked
        over ``clients`` ``[C, ...]`` and noised, the number of clients (Flower's example count:
        dpfl weights clients equally and does not send it) and, under non-private-diagnostics
        only, each client's diagnostics as ``{"<name>.<client>": value}``."""
        algorithm = self.problem.algorithm
        exchange, round = str(config["exchange"]), int(config["round"])
        spec = algorithm.exchange(exchange)
        broadcast = {k: torch.from_numpy(np.asarray(a))
                     for k, a in zip(spec.broadcast, parameters, strict=True)}
        states, ledgers = self._load()
        limit, delta = float(self.problem.config["max-epsilon"]), float(
            self.problem.config["delta"])
        today = [e.name for e in algorithm.round_exchanges(round)]
        if limit > 0 and exchange == today[0]:  # the round's releases, checked at its start
            spent = [c for c, ledger in zip(self.clients, ledgers, strict=True)
                     if ledger.epsilon_after([r for r in self._releases(c)
                                              if r.exchange in today], delta) > limit]
            if spent:
                raise BudgetSpent(spent)
        uploads, states, diagnostics = self.runtime.step(
            exchange, round, broadcast, states, self.problem.cohort(self.clients))
        for c, ledger in zip(self.clients, ledgers, strict=True):
            for release in self._releases(c, exchange):
                ledger.record(release)
        self._save(round, states, ledgers)
        metrics = {f"{k}.{c}": float(v[i]) for k, v in diagnostics.items()
                   for i, c in enumerate(self.clients)}
        return [uploads[k].numpy() for k in spec.uploads], len(self.clients), metrics

    def _releases(self, client: int, exchange: str | None = None) -> list:
        """What the client is charged for: its own releases, and the server's that cover its
        central uploads (client-level)."""
        central = self.problem.algorithm.central_releases()
        return [r for r in [*self.problem.releases(client), *(
            r for r in self.problem.server_releases() if r.name in central)]
            if exchange in (None, r.exchange)]
