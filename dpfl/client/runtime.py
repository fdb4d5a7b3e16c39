"""The client side of a round, shared by the Flower ClientApp and the engine.

It checks the privacy budget, runs the algorithm's batched ``client_step`` for a
cohort of clients, and records each client's releases in its ledger.
"""

from __future__ import annotations

import torch

from dpfl.algorithms import Cohort, State, StepContext
from dpfl.privacy import PrivacyLedger, Randomness
from dpfl.problem import Problem


def new_ledger(problem: Problem) -> PrivacyLedger:
    cfg = problem.config
    return PrivacyLedger(accountant=str(cfg["accountant"]), relation=problem.algorithm.relation)


def round_events(problem: Problem, client: int) -> list[tuple[float, float, int]]:
    return [(r.noise_multiplier, r.sample_rate, r.steps) for r in problem.releases(client)]


def exceeds_budget(problem: Problem, client: int, ledger: PrivacyLedger) -> bool:
    """Whether one more round would take ``client`` over ``max-epsilon``."""
    limit = float(problem.config["max-epsilon"])
    if limit <= 0:
        return False
    delta = float(problem.config["delta"])
    return ledger.epsilon_after(round_events(problem, client), delta) > limit


class ClientRuntime:
    """Runs exchanges for a cohort of clients and keeps their ledgers honest."""

    def __init__(self, problem: Problem, *, pooled_noise: bool = False) -> None:
        """``pooled_noise``: the engine's ``engine-mode="fast"`` (see
        :meth:`~dpfl.algorithms.StepContext.add_noise`); never set under Flower."""
        self.problem = problem
        cfg = problem.config
        self.rng = Randomness(int(cfg["seed"]), secure=bool(cfg["secure-noise"]))
        self.pooled_noise = pooled_noise

    def step(self, exchange: str, round: int, broadcast: State, states: State, cohort: Cohort,
             ledgers: list[PrivacyLedger]) -> tuple[State, State, dict[str, torch.Tensor]]:
        """One exchange for ``cohort``; ledgers are updated in place."""
        problem = self.problem
        releases = [problem.releases(c) for c in cohort.ids]
        ctx = StepContext(round=round, rng=self.rng, releases=releases, device=problem.device,
                          pooled_noise=self.pooled_noise)
        uploads, states, metrics = problem.algorithm.client_step(exchange, states, broadcast,
                                                                 cohort, ctx)
        delta = float(problem.config["delta"])
        eps, eps_next = [], []
        for client, ledger, rel in zip(cohort.ids, ledgers, releases, strict=True):
            for r in rel:
                if r.exchange == exchange:
                    ledger.record(noise_multiplier=r.noise_multiplier, sample_rate=r.sample_rate,
                                  steps=r.steps)
            eps.append(ledger.epsilon(delta))
            eps_next.append(ledger.epsilon_after(round_events(problem, client), delta))
        metrics = dict(metrics)
        metrics["epsilon"] = torch.tensor(eps, dtype=torch.float64)
        metrics["epsilon-next"] = torch.tensor(eps_next, dtype=torch.float64)
        return uploads, states, metrics
