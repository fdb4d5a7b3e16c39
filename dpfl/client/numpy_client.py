"""``AlgorithmClient``: the per-node algorithm interface as a Flower ``NumPyClient``.

Its ``fit`` runs one exchange of the configured algorithm for the node's
clients (one partition in simulation, or a cohort), keeping each client's
algorithm state and privacy ledger in the node's ``Context.state`` so they
survive the ClientApp being rebuilt every round.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.client import NumPyClient

from dpfl.algorithms import State
from dpfl.client.runtime import ClientRuntime, exceeds_budget, new_ledger
from dpfl.privacy import PrivacyLedger
from dpfl.problem import Problem


def node_clients(context: Context) -> list[int]:
    """The client ids this node hosts: node config ``partition-ids`` ("0,3,5") or
    ``partition-id`` (set by Flower's simulation for each virtual SuperNode)."""
    cfg = context.node_config
    if "partition-ids" in cfg:
        return sorted(int(c) for c in str(cfg["partition-ids"]).split(","))
    return [int(cfg["partition-id"])]


def _ids(text: object) -> list[int]:
    return [int(c) for c in str(text).split(",") if c != ""]


class AlgorithmClient(NumPyClient):
    """Runs ``client_step`` for the node's selected clients."""

    def __init__(self, problem: Problem, context: Context) -> None:
        self.problem = problem
        self.state = context.state
        self.clients = node_clients(context)
        self.runtime = ClientRuntime(problem)
        self.upload_keys: list[str] = []

    # ---- persistent per-client state ---------------------------------------------------
    def _load(self, ids: list[int]) -> tuple[State, list[PrivacyLedger]]:
        fresh = self.problem.algorithm.init_client_state(len(ids))
        rows: dict[str, list[torch.Tensor]] = {k: [] for k in fresh}
        ledgers = []
        for i, c in enumerate(ids):
            saved = self.state.get(f"dpfl.state.{c}")
            for k in fresh:
                rows[k].append(torch.from_numpy(saved[k].numpy()) if saved is not None
                               else fresh[k][i])
            ledger = self.state.get(f"dpfl.ledger.{c}")
            ledgers.append(PrivacyLedger.from_json(str(ledger["json"])) if ledger is not None
                           else new_ledger(self.problem))
        return {k: torch.stack(v) for k, v in rows.items()}, ledgers

    def _save(self, ids: list[int], states: State, ledgers: list[PrivacyLedger]) -> None:
        for i, c in enumerate(ids):
            if states:
                self.state[f"dpfl.state.{c}"] = ArrayRecord(
                    {k: Array(v[i].contiguous().numpy()) for k, v in states.items()})
            self.state[f"dpfl.ledger.{c}"] = ConfigRecord({"json": ledgers[i].to_json()})

    # ---- NumPyClient ---------------------------------------------------------------------
    def get_parameters(self, config: dict) -> list[np.ndarray]:
        return [self.problem.x0.numpy()]

    def fit(self, parameters: list[np.ndarray], config: dict) -> tuple[list[np.ndarray], int,
                                                                      dict]:
        """One exchange. ``config``: ``exchange``, ``round``, ``keys`` (names of
        ``parameters``) and ``clients`` (the selected client ids). Metrics hold one
        value per selected client, in the order of ``metrics['clients']``."""
        ids = [c for c in _ids(config["clients"]) if c in self.clients]
        round, exchange = int(config["round"]), str(config["exchange"])
        broadcast = {k: torch.from_numpy(np.asarray(a))
                     for k, a in zip(str(config["keys"]).split(","), parameters, strict=True)}
        states, ledgers = self._load(ids)
        first = exchange == self.problem.algorithm.exchanges[0]
        if first and any(exceeds_budget(self.problem, c, led) for c, led in zip(ids, ledgers)):
            self.upload_keys = []
            return [], 0, {"clients": ids, "refused": 1}
        uploads, states, metrics = self.runtime.step(exchange, round, broadcast, states,
                                                     self.problem.cohort(ids), ledgers)
        self._save(ids, states, ledgers)
        self.upload_keys = sorted(uploads)
        out = {k: [float(x) for x in v] for k, v in metrics.items()}
        out.update(clients=ids, refused=0)
        num_examples = sum(len(self.problem.partitions[c]) for c in ids)
        return [uploads[k].numpy() for k in self.upload_keys], num_examples, out
