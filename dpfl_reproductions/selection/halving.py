"""Successive halving: every point of a cell runs a short proxy, the best go on to longer ones,
the last rung at full length (:func:`halving`); and the step ladder that the Clip21
reproductions halve on (:func:`select`), which keeps points by step size and hedges the last
rung towards smaller steps, below the grid if need be."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from dpfl_reproductions.selection.grids import (
    Cell,
    Config,
    edge_axes,
    grid_floor,
)
from dpfl_reproductions.selection.intervals import mean_std
from dpfl_reproductions.selection.ranking import (
    Ranking,
    Split,
    Summary,
    accuracy,
    final_accuracy,
)
from dpfl_reproductions.selection.runs import Runner, Runs

# What a rung passes on: (its points ranked best first, the points it ran) -> the survivors.
Keep = Callable[[list[Config], list[Config]], list[Config]]


@dataclass(frozen=True)
class Rung:
    """One rung of one cell: its ``length`` (what the proxy was given), every point with its
    run in the order they ran, and the distinct ones ranked, best first."""

    length: Any
    runs: list[tuple[Config, Summary]]
    ranked: list[tuple[Config, Summary]]


def top(count: int) -> Keep:
    """A rung that passes on its best ``count`` points."""
    return lambda ranked, points: ranked[:count]


def halving(run_many: Callable[[list[Config]], list[Summary]],
            candidates: dict[Cell, list[Config]], rungs: Sequence[tuple[Any, Keep]],
            proxy: Callable[[Cell, Config, Any], Config], ranking: Ranking, *,
            twins: Callable[[Summary], Hashable] | None = None) -> dict[Cell, list[Rung]]:
    """Successive halving of every cell's ``candidates`` at once (one ``run_many`` a rung): at
    each rung ``(length, keep)`` every surviving point runs ``proxy(cell, point, length)``, the
    runs are ranked by ``ranking`` (equal ones in the order they ran: the grid's at the first
    rung, the previous rung's ranking after) and ``keep`` says which go on. ``twins``: runs with
    equal ``twins(summary)`` count as one, the point with the fewest axes on the cell's grid's
    edge standing for them. Returns each cell's rungs."""
    alive = {cell: list(points) for cell, points in candidates.items()}
    history: dict[Cell, list[Rung]] = {cell: [] for cell in candidates}
    for length, keep in rungs:
        batch = [(cell, p) for cell, points in alive.items() for p in points]
        summaries = run_many([proxy(cell, p, length) for cell, p in batch])
        done: dict[Cell, list[tuple[Config, Summary]]] = {}
        for (cell, p), summary in zip(batch, summaries, strict=True):
            done.setdefault(cell, []).append((p, summary))
        for cell, runs in done.items():
            distinct = runs if twins is None else once(runs, twins, candidates[cell])
            order = sorted(distinct, key=lambda run: ranking.key([run[1]]))
            history[cell].append(Rung(length, runs, order))
            alive[cell] = keep([p for p, _ in order], alive[cell])
    return history


#: the length a confirmation rung records (its runs are the full-length ones)
CONFIRMATION = "confirmation"


def confirmation(run_many: Callable[[list[Config]], list[Summary]],
                 rungs: dict[Cell, list[Rung]], extra: dict[Cell, list[Config]],
                 full: Callable[[Cell, Config], Config], ranking: Ranking,
                 first_best: int) -> dict[Cell, Rung]:
    """The full-length rung that decides each cell after :func:`halving`: the points of its
    last rung, the best ``first_best`` of its first rung's ranking, and its ``extra`` points
    (e.g. the neighbouring cells' winners), each run at full length (``full(cell, point)``;
    a run already made is the lab's archived one), ranked by ``ranking``, ties in that order.
    A proxy rung can then no longer cut a point that is best at full length, as long as it
    ranked among the first rung's best."""
    chosen: dict[Cell, list[Config]] = {}
    for cell, tried in rungs.items():
        points = ([p for p, _ in tried[-1].runs] + [p for p, _ in tried[0].ranked[:first_best]]
                  + extra.get(cell, []))
        chosen[cell] = [p for i, p in enumerate(points) if p not in points[:i]]
    batch = [(cell, p) for cell, points in chosen.items() for p in points]
    summaries = run_many([full(cell, p) for cell, p in batch])
    done: dict[Cell, list[tuple[Config, Summary]]] = {}
    for (cell, p), summary in zip(batch, summaries, strict=True):
        done.setdefault(cell, []).append((p, summary))
    return {cell: Rung(CONFIRMATION, runs, sorted(runs, key=lambda run: ranking.key([run[1]])))
            for cell, runs in done.items()}


def once(runs: list[tuple[Config, Summary]], twins: Callable[[Summary], Hashable],
         points: list[Config]) -> list[tuple[Config, Summary]]:
    """``runs`` with those of equal ``twins(summary)`` counted once, in the place of the first,
    by the point with the fewest axes on the edge of the grid ``points``."""
    kept: list[tuple[Config, Summary]] = []
    where: dict[Hashable, int] = {}
    for p, summary in runs:
        outcome = twins(summary)
        if outcome not in where:
            where[outcome] = len(kept)
            kept.append((p, summary))
        elif len(edge_axes(p, points)) < len(edge_axes(kept[where[outcome]][0], points)):
            kept[where[outcome]] = (p, summary)
    return kept


def same_end(summary: Summary, split: Split = "test") -> Hashable:
    """What makes runs one for :func:`select`: the same accuracy and loss on ``split`` to 6
    significant digits. E.g. Clip-SGD with σ ∝ τ depends on γτ only, so an anti-diagonal of the
    grid would otherwise fill every place of a rung; such invariances are exact in arithmetic,
    not in floating point (measured twins differ by ~1e-8)."""
    loss = summary.get(f"{split}_loss")
    return summary.get(f"{split}_accuracy"), None if loss is None else f"{loss:.6g}"


# ---- the step ladder -------------------------------------------------------------------------

# One rung of the step ladder: (epochs, what it passes on: a fraction keeps that share of every
# step size, a count k the best point and the best points at 1/10, …, 1/10^(k−1) of its step;
# :func:`survivors`).
StepRung = tuple[int, int | float]


@dataclass(frozen=True)
class StepLadder:
    """How :func:`select` halves a cell's points.

    ``rungs`` run in order, the last one at full length; ``step(point)`` is a point's step size
    (three significant digits, so that equal steps compare equal); ``step_axes`` are the
    run-config keys whose product the step is, which the hedge may divide below the grid;
    ``proxy(point, epochs)`` is the run of ``point`` stopped after ``epochs`` epochs (with the
    full-length run's noise, so that a proxy sees the noise level it is selected for)."""

    rungs: tuple[StepRung, ...]
    step: Callable[[Config], float]
    step_axes: tuple[str, ...]
    proxy: Callable[[Config, int], Config]


def keep_count(keep: int | float, n: int) -> int:
    """How many of ``n`` ranked points a rung passes on: ``keep`` itself if an int, else that
    fraction of ``n`` rounded up; at least 1, at most ``n``."""
    count = keep if isinstance(keep, int) else math.ceil(keep * n)
    return max(1, min(n, count))


def survivors(ranked: list[Config], points: list[Config], keep: int | float,
              step: Callable[[Config], float]) -> list[Config]:
    """The points a rung passes on, from its distinct points ``ranked`` (best first) among the
    rung's ``points``, by ``step`` size:

    * a fraction ``keep`` keeps that share of every step size's points (of ``points``, rounded
      up), ranked within the step size;
    * a count ``keep`` = k keeps the best point, and the best point whose step is at most
      1/10, 1/100, …, 1/10^(k−1) of its step (when there is one, and not already kept).

    Why: a short proxy run is biased towards large steps. The noise the model carries grows
    with T while the progress a large step buys shows early, so the full-length optimum lies at
    a smaller step than a short run's. The fraction keeps small steps alive through the short
    rungs; the count hedges the full-length rung towards smaller steps, never larger."""
    steps = [(step(p), p) for p in ranked]
    if isinstance(keep, int):
        kept: list[Config] = []
        for j in range(keep):
            best = best_within(steps, steps[0][0] / 10**j)
            if best is not None and all(best is not p for p in kept):
                kept.append(best)
        return kept
    levels: dict[float, list[Config]] = {}
    for size, p in steps:  # best first, so every level's list is ranked
        levels.setdefault(size, []).append(p)
    sizes = [step(p) for p in points]
    return [p for level, order in levels.items()
            for p in order[:keep_count(keep, sizes.count(level))]]


def best_within(steps: list[tuple[float, Config]], limit: float) -> Config | None:
    """The first (best-ranked) of ``steps`` (``(step, point)``) whose step is at most ``limit``
    (steps carry 3 significant digits: a relative 1e-9 absorbs the division's rounding)."""
    return next((p for size, p in steps if size <= limit * (1 + 1e-9)), None)


def select(lab: Runs, candidates: dict[Cell, list[Config]], ladder: StepLadder,
           split: Split = "test") -> dict[Cell, list[tuple[float, Config]]]:
    """The best single run by accuracy on ``split``, coarse to fine: :func:`halving` over
    ``ladder.rungs``, every proxy at the seed in its point, the :func:`survivors` of a rung
    chosen by step size, runs that end identically (:func:`same_end`) counted once.

    The hedge of the last rung towards smaller steps is extended while it wins: when the best
    last-rung run is also the one with the smallest step, the previous rung's best point with at
    most 1/10 of that step runs too (a selected point at the hedge's own edge is as suspect as
    one at the grid's edge); past the grid's smallest step it goes on below the grid, dividing
    one factor of the step by 10 (:func:`smaller_steps`; :func:`edge_axes` marks such a
    point). Returns, per cell, the last rung's distinct points with their accuracy on ``split``,
    best first."""
    ranking = accuracy(split)
    rungs = [(epochs, functools.partial(survivors, keep=keep, step=ladder.step))
             for epochs, keep in ladder.rungs]
    history = halving(lab.run_many, candidates, rungs,
                      lambda cell, point, epochs: ladder.proxy(point, epochs), ranking,
                      twins=functools.partial(same_end, split=split))
    ranked = {cell: list(rungs[-1].ranked) for cell, rungs in history.items() if rungs}
    previous = {cell: [p for p, _ in rungs[-2].ranked] if len(rungs) > 1 else []
                for cell, rungs in history.items()}
    full = ladder.rungs[-1][0]
    while extend := [(cell, p) for cell, runs in ranked.items()
                     for p in smaller_steps([p for p, _ in runs], previous[cell],
                                            candidates[cell], ladder)]:
        summaries = lab.run_many([ladder.proxy(p, full) for _, p in extend])
        for (cell, p), summary in zip(extend, summaries, strict=True):
            ranked[cell].append((p, summary))
        for cell in {cell for cell, _ in extend}:
            ranked[cell].sort(key=lambda run: ranking.key([run[1]]))
    return {cell: [(ranking.value([summary]), p) for p, summary in runs]
            for cell, runs in ranked.items()}


def smaller_steps(ranked: list[Config], previous: list[Config], points: list[Config],
                  ladder: StepLadder) -> list[Config]:
    """The next points of the extended hedge (:func:`select`), none unless the best of
    ``ranked`` has the smallest step among them: the best of ``previous`` (ranked) with at most
    1/10 of its step; when ``previous`` has none, the best point itself with one of
    ``ladder.step_axes`` (those the grid ``points`` tunes) divided by 10, for every such axis at
    or below the grid's smallest value (at most :data:`BELOW_GRID` decades below it), each not
    run yet. A selected point at the small-step end of the grid is an edge the protocol would
    otherwise never look past; which factor of the step to shrink matters (measured for
    α-NormEC: docs/reproductions.md, "Below the grid"), so every one is tried."""
    step = ladder.step
    winner = ranked[0]
    best = step(winner)
    if best > min(step(p) for p in ranked):
        return []
    inside = best_within([(step(p), p) for p in previous], best / 10)
    if inside is not None:
        return [inside]
    below = []
    for axis in ladder.step_axes:
        values = sorted({float(p[axis]) for p in points if axis in p})
        if len(values) < 2 or float(winner[axis]) > values[0]:
            continue
        value = float(f"{float(winner[axis]) / 10:.3g}")
        if value >= grid_floor(values[0]) * (1 - 1e-9):
            point = {**winner, axis: value}
            if point not in ranked:
                below.append(point)
    return below


def seed_runs(lab: Runs, ranked: dict[Cell, list[tuple[float, Config]]],
              grids: dict[str, list[Config]], seeds: Sequence[int],
              step: Callable[[Config], float], change: Config | None = None
              ) -> dict[Cell, Any]:
    """Each cell's point selected by :func:`select`, with ``change`` applied (e.g. another
    federation), run with fresh ``seeds``: the cells' results (test accuracy mean ± std,
    whatever split ``ranked`` was selected by; the point run; the full-length selection runs
    with their accuracies on that split and ``step`` sizes; grid edges; the ledger's ε).
    ``grids[cell[1]]`` is the cell's grid (cells are keyed ``(model, method, …)``)."""
    chosen = {cell: {**scores[0][1], **(change or {})} for cell, scores in ranked.items()}
    runs = Runner(lambda cell, point, seed: {**point, "seed": seed},
                  lab.run_many).on_seeds(chosen, seeds)
    cells: dict[Cell, Any] = {}
    for cell, summaries in runs.items():
        accs = [final_accuracy(s) for s in summaries]
        tuned, points = ranked[cell][0][1], grids[cell[1]]
        cells[cell] = {
            "accuracy": mean_std(accs), "runs": accs, "selected": chosen[cell],
            "proxy": [[acc, step(p), {k: p[k] for k in points[0]}]
                      for acc, p in ranked[cell]],
            "edge": ", ".join(edge_axes({k: tuned[k] for k in points[0]}, points)),
            "epsilon_accountant": max(s.get("epsilon_max") or 0.0 for s in summaries),
        }
    return cells
