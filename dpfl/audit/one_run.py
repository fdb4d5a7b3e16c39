"""The one-run audit: many canaries in one training run, each in with probability ½.

Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (arXiv:2305.08846):
m canaries are put into one run, each independently with probability ½ (its coin). After the
run the adversary scores every canary, guesses "in" for the k₊ highest scores and "out" for
the k₋ lowest (abstaining on the rest), and counts its v correct guesses of r = k₊ + k₋. If
the mechanism is (ε, δ)-DP with respect to each canary, v is stochastically no larger than the
correct guesses of ε-randomised response plus a δ term (their §5, the approximate-DP bound):

    P[V ≥ v] ≤ P[Bin(r, q) ≥ v] + 2mδ · max_{1≤i≤v} (1/i)·P[v − i ≤ Bin(r, q) < v],

q = e^ε/(1 + e^ε); :func:`p_value`. The ε lower bound at confidence 1 − α is the largest ε
whose p-value is below α (:func:`epsilon_lower_bound`). Unlike the many-run audit it needs one
real run, and it audits the run as it was configured, sampling included: a canary that the
batches rarely hold is rarely seen, which is the amplification the ledger counts.

Canaries here are gradient canaries (:mod:`dpfl.audit.gradient_canary`), each with its own
coordinate θ_i, all held by the audited client (replace-one: slot i holds the canary or the
anti-canary by its coin; add/remove: the canary or nothing); every other client keeps its
data and the run drives the server as a real run does. The score of canary i is the sum over
rounds of the audited client's model-shaped uploads at θ_i: independent noise per coordinate,
shifted by the clipped canary when it is in. The projection family keeps only the public
gradients' span, which holds the m coordinates' sum and nothing of each alone, so its
canaries are not seen one by one: this audit reads the other algorithms.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.stats import binom

from dpfl.algorithms import State
from dpfl.audit.gradient_canary import canary_problem, scale, with_z
from dpfl.privacy import Randomness, Relation
from dpfl.problem import Problem, build_problem
from dpfl.runconfig import RunConfig


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P[at least ``v`` of ``r`` guesses right] for ``m`` canaries under (ε, δ)-DP (module
    docstring)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 ≤ v ≤ r ≤ m, got v={v}, r={r}, m={m}")
    q = 1 / (1 + math.exp(-epsilon))
    tail = float(binom.sf(v - 1, r, q))
    below = binom.pmf(np.arange(v - 1, -1, -1), r, q).cumsum()  # P[v − i ≤ Bin < v], i = 1..v
    worst = float(np.max(below / np.arange(1, v + 1))) if v else 0.0
    return min(1.0, tail + 2 * m * delta * worst)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float) -> float:
    """The largest ε whose :func:`p_value` is below 1 − ``confidence`` (0 if none is), by
    bisection to 1e-6."""
    alpha = 1 - confidence
    if p_value(m, r, v, 0.0, delta) >= alpha:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(m, r, v, high, delta) < alpha and high < 100:
        low, high = high, 2 * high
    while high - low > 1e-6:
        mid = (low + high) / 2
        low, high = (mid, high) if p_value(m, r, v, mid, delta) < alpha else (low, mid)
    return low


@dataclass(frozen=True)
class OneRunResult:
    """The one-run audit's outcome."""

    algorithm: str
    canaries: int
    guesses: int
    correct: int
    epsilon_lower: float
    confidence: float
    epsilon_ledger: float
    delta: float
    rounds: int
    seconds: float

    def summary(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def federation(source: Problem, client: int, coins: np.ndarray, radius: float) -> Problem:
    """``source``'s federation with client ``client``'s data plus one canary slot per coin
    (module docstring); every other client's data as it was."""
    m, ds = len(coins), source.dataset
    s = scale(source, radius)
    zero = torch.zeros(1, *ds.input_shape, dtype=ds.train_x.dtype)
    out_z = -s if source.algorithm.relation is Relation.REPLACE_ONE else None
    x = [with_z(ds.train_x, slots=m)]
    y = [ds.train_y]
    kept = []
    for i, coin in enumerate(coins):
        if coin or out_z is not None:
            x.append(with_z(zero, s if coin else out_z, m, i))
            y.append(ds.train_y[:1])
            kept.append(ds.num_train + len(kept))
    parts = list(source.partitions)
    parts[client] = np.concatenate([parts[client], np.asarray(kept, dtype=np.int64)])
    return canary_problem(source, torch.cat(x), torch.cat(y), parts, public_z=0.0, slots=m)


def scores(problem: Problem, client: int, slots: int, rounds: int, rng: Randomness
           ) -> np.ndarray:
    """Each canary's score: the sum over rounds of ``client``'s model-shaped uploads at its
    coordinate (the last ``slots`` of the flat vector)."""
    from dpfl.audit import Released, Scorer, play

    class SlotScorer(Scorer):
        def observe(self, unit: torch.Tensor, broadcast: State, uploads: State, state: State,
                    released: list[Released], participants: list[int]) -> None:
            for name, values in uploads.items():
                rows = values.reshape(len(values), -1)
                if rows.shape[1] == problem.model.d:
                    self.scores += rows[client, -slots:].double().cpu()
                    self.scored.add(name)

    scorer = SlotScorer(problem, lambda params: params, slots)
    play(problem, rng, rounds, list(range(problem.num_clients)), scorer)
    if not scorer.scored:
        raise ValueError(f"{problem.algorithm.name}: no model-shaped upload to score; the "
                         f"one-run audit reads the uploads' canary coordinates")
    return scorer.scores.numpy()


def one_run(config: RunConfig, *, canaries: int = 1000, guesses: int = 100,
            confidence: float = 0.95, client: int = 0) -> OneRunResult:
    """The one-run audit of ``config`` on client ``client`` with ``canaries`` canaries and
    ``guesses`` guesses (half "in" on the highest scores, half "out" on the lowest)."""
    from dpfl.audit import canary_radius, ledger_epsilon

    if not 2 <= guesses <= canaries:
        raise ValueError(f"need 2 ≤ guesses ≤ canaries, got {guesses} and {canaries}")
    started = time.perf_counter()
    source = build_problem(config)
    seed = config.run.seed
    coins = Randomness(seed).generator(client, 0, "audit-coins")
    bits = torch.randint(0, 2, (canaries,), generator=coins).numpy().astype(bool)
    problem = federation(source, client, bits, canary_radius(source))
    rounds = config.run.num_server_rounds
    found = scores(problem, client, canaries, rounds,
                   Randomness(seed, secure=config.privacy.secure_noise))
    order = np.argsort(found, kind="stable")
    low, high = order[:guesses // 2], order[len(order) - (guesses - guesses // 2):]
    correct = int((~bits[low]).sum() + bits[high].sum())
    delta = config.privacy.delta
    return OneRunResult(algorithm=source.algorithm.name, canaries=canaries, guesses=guesses,
                        correct=correct,
                        epsilon_lower=epsilon_lower_bound(canaries, guesses, correct, delta,
                                                          confidence),
                        confidence=confidence,
                        epsilon_ledger=ledger_epsilon(problem, [client], rounds), delta=delta,
                        rounds=rounds, seconds=time.perf_counter() - started)
