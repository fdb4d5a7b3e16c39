"""The in-process engine: every client batched in this process, same math and seeds as Flower.

:class:`EngineTransport` is the round loop's in-process transport: it keeps every client's
state and runs an exchange for all participants in one batched ``client_step`` through the same
client runtime the Flower client uses, so a seed gives the same model here and under
``flwr run``. ``engine-mode="fast"`` (sweeps) draws the noise of the participants' sum once
instead of once per client: the same distribution of models, not the same numbers. Every
client's state goes into the run's checkpoints, and comes back from them on resume.
"""

from __future__ import annotations

from typing import Any

import torch

from dpfl.algorithms import Cohort, State
from dpfl.allocator import keep_freed_memory
from dpfl.checkpoint import Lineage
from dpfl.problem import Problem, build_problem
from dpfl.rounds.client import ClientRuntime
from dpfl.rounds.driver import drive
from dpfl.rounds.loop import RoundLoop
from dpfl.rounds.secure_sum import reduction
from dpfl.rounds.transport import Replies, blocks, per_client
from dpfl.runconfig import RunConfig


class EngineTransport:
    """Every client of ``problem`` in this process."""

    def __init__(self, problem: Problem, *, pooled_noise: bool = False) -> None:
        self.problem = problem
        self.clients = ClientRuntime.of(problem, pooled_noise=pooled_noise)
        # a population's rounds gather their own cohorts (Problem.cohort)
        self.cohort = problem.full_cohort() if problem.population is None else None
        self.states = problem.algorithm.init_client_state(problem.num_clients)
        self.blocks: dict[tuple[int, int], Cohort] = {}
        keep_freed_memory()  # each round's [block, d] tensors, reused by the next round

    def begin(self, lineage: Lineage, states: State | None) -> dict[int, dict[str, int]]:
        """Take over a checkpoint's client states (a resumed run); the lineage names no file
        here: the engine's clients live in the server's checkpoint, and no node reports."""
        if states:
            self.states = {k: states[k].to(v.device) for k, v in self.states.items()}
        return {}

    def client_states(self) -> State:
        return self.states

    def send_and_receive(self, exchange: str, server_round: int, broadcast: State,
                 participants: list[int]) -> Replies:
        """One exchange for ``participants``, a block of :data:`~dpfl.rounds.transport.BLOCK`
        clients at a time: each block's uploads are summed (the one reduction,
        :class:`~dpfl.rounds.RowSum`, or under secure aggregation
        :class:`~dpfl.rounds.secure_sum.SecureSum`) before the next block is computed, so a
        round holds one block of uploads and noise whatever the number of clients."""
        everyone = len(participants) == self.problem.num_clients  # sorted: positions = ids
        total = reduction(self.problem, exchange)
        diagnostics: dict[int, dict[str, float]] = {}
        for part in blocks(len(participants)):
            ids = participants[part]
            cohort = (self.problem.cohort(ids) if self.cohort is None
                      else self.block_cohort(part) if everyone else self.cohort.select(ids))
            positions: slice | torch.Tensor = part if everyone else torch.tensor(ids)
            given = {k: v[positions] for k, v in self.states.items()}
            uploads, rows, diagnosed = self.clients.step(exchange, server_round, broadcast, given,
                                                         cohort)
            whole = everyone and part == slice(0, self.problem.num_clients)
            for k, v in rows.items():  # idle clients keep their state
                if whole:  # one block of every client: the new states are the states
                    self.states[k] = v
                elif v is not given[k]:  # the states stay where they are (the CPU)
                    self.states[k][positions] = v.to(self.states[k].device)
            total.add(uploads)
            diagnostics.update(per_client(ids, diagnosed))
        return Replies(total.sums, diagnostics)

    def block_cohort(self, part: slice) -> Cohort:
        """The cohort of the clients in ``part`` (every client's block, kept across rounds)."""
        key = (part.start, part.stop)
        if key not in self.blocks:
            self.blocks[key] = self.cohort.select(range(part.start, part.stop))
        return self.blocks[key]


def run(config: RunConfig, *, echo: bool = True, plot: bool = True) -> dict[str, Any]:
    """Run ``config`` to the end (or to ``max-epsilon``); returns the summary. ``plot``:
    draw the results folder's ``summary.png`` (a sweep's runs skip it: their report draws
    the figures)."""
    problem = build_problem(config)
    transport = EngineTransport(problem, pooled_noise=config.run.engine_mode == "fast")
    return drive(RoundLoop(problem, "engine", echo=echo, plot=plot), transport)
