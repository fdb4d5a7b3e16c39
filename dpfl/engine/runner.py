"""The in-process engine: every client batched in this process, same math and seeds as Flower.

:class:`EngineTransport` is the round driver's in-process transport: it keeps every client's
state and runs an exchange for all participants in one batched ``client_step`` through the same
client runtime the Flower client uses, so a seed gives the same model here and under
``flwr run``. ``engine-mode="fast"`` (sweeps) draws the noise of the participants' sum once
instead of once per client: the same distribution of models, not the same numbers. Every
client's state goes into the run's checkpoints, and comes back from them on resume.
"""

from __future__ import annotations

from typing import Any

import torch

from dpfl.algorithms import State
from dpfl.checkpoint import Lineage
from dpfl.problem import Problem, build_problem
from dpfl.rounds.client import ClientRuntime
from dpfl.rounds.driver import RoundDriver
from dpfl.rounds.transport import Replies, per_client, sum_rows
from dpfl.runconfig import RunConfig


class EngineTransport:
    """Every client of ``problem`` in this process."""

    def __init__(self, problem: Problem, *, pooled_noise: bool = False) -> None:
        self.problem = problem
        self.clients = ClientRuntime.of(problem, pooled_noise=pooled_noise)
        self.cohort = problem.full_cohort()
        self.states = problem.algorithm.init_client_state(problem.num_clients)

    def begin(self, lineage: Lineage, states: State | None) -> None:
        """Take over a checkpoint's client states (a resumed run); the lineage names no file
        here: the engine's clients live in the server's checkpoint."""
        if states:
            self.states = {k: states[k].to(v.device) for k, v in self.states.items()}

    def client_states(self) -> State:
        return self.states

    def exchange(self, exchange: str, round: int, broadcast: State,
                 participants: list[int]) -> Replies:
        everyone = len(participants) == self.problem.num_clients  # sorted: no gather/scatter
        positions = torch.tensor(participants, dtype=torch.long)
        cohort = self.cohort if everyone else self.cohort.select(participants)
        rows = self.states if everyone else {k: v[positions] for k, v in self.states.items()}
        uploads, rows, diagnostics = self.clients.step(exchange, round, broadcast, rows, cohort)
        if everyone:
            self.states = dict(rows)
        else:
            for k, v in rows.items():  # idle clients keep their state
                self.states[k][positions] = v
        return Replies(sum_rows(uploads, self.problem.device),
                       per_client(participants, diagnostics))


def run(config: RunConfig, *, echo: bool = True) -> dict[str, Any]:
    """Run ``config`` to the end (or to ``max-epsilon``); returns the summary."""
    problem = build_problem(config)
    transport = EngineTransport(problem, pooled_noise=config["engine-mode"] == "fast")
    return RoundDriver(problem, transport, "engine", echo=echo).run()
