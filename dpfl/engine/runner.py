"""The in-process engine: every client batched, same math and seeds as Flower.

It drives the algorithm's ``client_step`` over all participants in one call and
``server_step`` on their uploads, round after round, through the same client and
server runtimes the Flower apps use, so that a seed gives the same model here
and under ``flwr run``. ``engine-mode="fast"`` (sweeps) draws the noise of the
clients' average once instead of once per client: the same distribution of
models, not the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch

from dpfl.client.runtime import ClientRuntime, exceeds_budget, new_ledger
from dpfl.config import RunConfig
from dpfl.problem import build_problem
from dpfl.server.runtime import ServerRuntime


def run(config: RunConfig, *, echo: bool = True) -> dict[str, Any]:
    """Run ``config`` to the end (or to ``max-epsilon``); returns the summary."""
    problem = build_problem(config)
    server = ServerRuntime(problem, "engine", echo=echo)
    clients = ClientRuntime(problem, pooled_noise=config["engine-mode"] == "fast")
    cohort = problem.full_cohort()
    states = problem.algorithm.init_client_state(problem.num_clients)
    ledgers = [new_ledger(problem) for _ in range(problem.num_clients)]
    server.open()
    for round in range(1, int(config["num-server-rounds"]) + 1):
        if server.should_stop(round):
            break
        ids = server.participants(round)
        if any(exceeds_budget(problem, c, ledgers[c]) for c in ids):
            server.stop_reason = f"max-epsilon: a client refused round {round}"
            break
        everyone = len(ids) == problem.num_clients  # ids are sorted: no gather/scatter
        positions = torch.tensor(ids, dtype=torch.long)
        part = cohort if everyone else cohort.select(ids)
        for exchange in problem.algorithm.exchanges:
            broadcast = server.broadcast(exchange, round)
            rows = states if everyone else {k: v[positions] for k, v in states.items()}
            uploads, rows, metrics = clients.step(exchange, round, broadcast, rows, part,
                                                  [ledgers[c] for c in ids])
            if everyone:
                states = dict(rows)
            else:
                for k, v in rows.items():  # idle clients keep their state
                    states[k][positions] = v
            server.aggregate(exchange, round, ids, uploads)
        server.end_round(round, {c: {k: float(v[i]) for k, v in metrics.items()}
                                 for i, c in enumerate(ids)})
    return server.finish()
