"""Hyperparameter selection shared by every paper's reproductions.

A reproduction tunes each cell of a paper's table (a model, a method, a privacy level) over a
grid of run configurations, with the paper's protocol "the best single run by test accuracy"
made affordable by running it coarse to fine:

* :func:`select`: successive halving over rungs of growing length (a :class:`StepLadder`),
  keeping points by *step size*, the scale of a point's update and of the noise the model takes
  in per round (the step is a method's own function of its keys: γτβ̂ for the Clip21 family).
  A short proxy run favours large steps, so every step size keeps its best points through the
  short rungs, the last rung hedges towards smaller steps, and where the smallest step wins at
  full length the hedge goes on past it, below the grid if need be (:func:`smaller_steps`).
* :func:`walk_past_edge`: where a cell's selected value of one axis is an end of the grid, the
  winner runs again past it while that improves the metric.
* :func:`seed_runs`: the selected points rerun with fresh seeds, as the table reports them.

Points are ranked on the server's test set by default, the papers' protocol, which every
reproduction keeps; ``split="validation"`` ranks them on the validation split held out of the
training data instead (dataset option ``num_validation``), which a selection that must not see
the test set uses. The reported accuracies (:func:`seed_runs`) are always the test set's.

Grid edges are reported (:func:`edge_axes`): a selected point on the edge of its grid is a
weaker selection than an interior one.
"""

from __future__ import annotations

import itertools
import math
import shlex
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from scipy import stats

from dpfl.config import Value, format_options, format_overrides, parse_options

Config = dict[str, Value]
Cell = tuple[Any, ...]  # what a table's cell is keyed by, e.g. (model, method, ε)
# One rung of successive halving: (epochs, what it passes on: a fraction keeps that share of
# every step size, a count k the best point and the best points at 1/10, …, 1/10^(k−1) of its
# step; :func:`survivors`).
Rung = tuple[int, int | float]

BELOW_GRID = 3  # decades a step axis may go below the grid when its smallest step wins
# the server's evaluation set a selection ranks by (the ``<split>_accuracy`` of a summary)
Split = Literal["test", "validation"]
LEVEL = 0.95  # the confidence of a paired t-interval


class Runs(Protocol):
    """What selection needs of a :class:`~dpfl_reproductions.lab.Lab`."""

    def run_many(self, configs: Sequence[Config], **kwargs: Any) -> list[dict[str, Any]]: ...


def grid(**axes: Sequence[Value]) -> list[Config]:
    """The Cartesian product of ``axes`` (keys with ``_`` become run-config keys with ``-``)."""
    keys = [k.replace("_", "-") for k in axes]
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*axes.values())]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


@dataclass(frozen=True)
class Paired:
    """Per-seed differences of two methods' metric, their mean and the two-sided t-interval of
    the mean (NaN ends with one seed)."""

    differences: tuple[float, ...]
    mean: float
    low: float
    high: float


def paired(ours: Sequence[float], theirs: Sequence[float], level: float = LEVEL) -> Paired:
    """``ours`` − ``theirs`` seed by seed (the same seeds, in the same order) and the t-interval
    mean ± t(1 − (1 − level)/2, n − 1)·s/√n."""
    diffs = tuple(a - b for a, b in zip(ours, theirs, strict=True))
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return Paired(diffs, mean, math.nan, math.nan)
    half = (stats.t.ppf(1 - (1 - level) / 2, len(diffs) - 1) * statistics.stdev(diffs)
            / math.sqrt(len(diffs)))
    return Paired(diffs, mean, mean - half, mean + half)


def command(values: Config) -> str:
    """The ``dpfl run`` line that re-runs ``values`` alone (a shell line: option strings
    written with bare words, so that they nest without escapes)."""
    keep = {k: format_options(parse_options(v)) if k.endswith("-options") and isinstance(v, str)
            else v for k, v in values.items() if k not in ("results-dir", "run-name")}
    return f"dpfl run --run-config {shlex.quote(format_overrides(keep))}"


def final_accuracy(summary: dict[str, Any], split: Split = "test") -> float:
    """A run's final accuracy on ``split`` in percent (0 for a run without one, e.g. diverged);
    a ValueError for a run evaluated without that split (a dataset without ``num_validation``),
    which would otherwise rank as 0."""
    if "test_loss" in summary and f"{split}_loss" not in summary:
        raise ValueError(f"the run has no {split} split to rank by: give the dataset option "
                         f"num_{split}")
    acc = summary.get(f"{split}_accuracy")
    return 100 * acc if acc is not None and math.isfinite(acc) else 0.0


@dataclass(frozen=True)
class StepLadder:
    """How :func:`select` ranks a cell's points.

    ``rungs`` run in order, the last one at full length; ``step(point)`` is a point's step size
    (three significant digits, so that equal steps compare equal); ``step_axes`` are the
    run-config keys whose product the step is, which the hedge may divide below the grid;
    ``proxy(point, epochs)`` is the run of ``point`` stopped after ``epochs`` epochs (with the
    full-length run's noise, so that a proxy sees the noise level it is selected for)."""

    rungs: tuple[Rung, ...]
    step: Callable[[Config], float]
    step_axes: tuple[str, ...]
    proxy: Callable[[Config, int], Config]


def keep_count(keep: int | float, n: int) -> int:
    """How many of ``n`` ranked points a rung passes on: ``keep`` itself if an int, else that
    fraction of ``n`` rounded up; at least 1, at most ``n``."""
    count = keep if isinstance(keep, int) else math.ceil(keep * n)
    return max(1, min(n, count))


def survivors(scores: list[tuple[float, Config]], points: list[Config], keep: int | float,
              step: Callable[[Config], float]) -> list[Config]:
    """The points a rung passes on, from its distinct outcomes ``scores`` (best first) among the
    rung's ``points``, by ``step`` size:

    * a fraction ``keep`` keeps that share of every step size's points (of ``points``, rounded
      up), ranked within the step size;
    * a count ``keep`` = k keeps the best point, and the best point whose step is at most
      1/10, 1/100, …, 1/10^(k−1) of its step (when there is one, and not already kept).

    Why: a short proxy run is biased towards large steps. The noise the model carries grows
    with T while the progress a large step buys shows early, so the full-length optimum lies at
    a smaller step than a short run's. The fraction keeps small steps alive through the short
    rungs; the count hedges the full-length rung towards smaller steps, never larger."""
    steps = [(step(p), p) for _, p in scores]
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
    return [p for level, ranked in levels.items()
            for p in ranked[:keep_count(keep, sizes.count(level))]]


def best_within(steps: list[tuple[float, Config]], limit: float) -> Config | None:
    """The first (best-ranked) of ``steps`` (``(step, point)``) whose step is at most ``limit``
    (steps carry 3 significant digits: a relative 1e-9 absorbs the division's rounding)."""
    return next((p for size, p in steps if size <= limit * (1 + 1e-9)), None)


def select(lab: Runs, candidates: dict[Cell, list[Config]], ladder: StepLadder,
           split: Split = "test") -> dict[Cell, list[tuple[float, Config]]]:
    """The best single run by accuracy on ``split``, coarse to fine: successive halving over
    ``ladder.rungs``. At each rung every surviving point of every cell runs its proxy (seed as
    in the point), and :func:`survivors` go on, by step size, counting points whose runs end
    identically (same final accuracy and loss on ``split``) once, by the one with the fewest
    axes on the grid's edge.

    The hedge of the last rung towards smaller steps is extended while it wins: when the best
    last-rung run is also the one with the smallest step, the previous rung's best point with at
    most 1/10 of that step runs too (a selected point at the hedge's own edge is as suspect as
    one at the grid's edge); past the grid's smallest step it goes on below the grid, dividing
    one factor of the step by 10 (:func:`smaller_steps`; :func:`edge_axes` marks such a
    point). Returns, per cell, the last rung's distinct points ranked by accuracy on ``split``
    (best first)."""
    alive = {cell: list(points) for cell, points in candidates.items()}
    ranked: dict[Cell, list[tuple[float, Config]]] = {}
    previous: dict[Cell, list[tuple[float, Config]]] = {}
    for epochs, keep in ladder.rungs:
        previous = ranked
        batch = [(cell, p) for cell, points in alive.items() for p in points]
        summaries = lab.run_many([ladder.proxy(p, epochs) for _, p in batch])
        ranked = {}
        seen: dict[Cell, dict[Any, int]] = {}
        for (cell, p), summary in zip(batch, summaries, strict=True):
            # Points whose runs end identically are one run: e.g. Clip-SGD with σ ∝ τ depends on
            # γτ only, so an anti-diagonal of the grid would otherwise fill every place of a
            # rung. "Identically": the same accuracy and the same loss to 6 significant digits
            # (such invariances are exact in arithmetic, not in floating point: measured twins
            # differ by ~1e-8).
            loss = summary.get(f"{split}_loss")
            outcome = (summary.get(f"{split}_accuracy"), None if loss is None else f"{loss:.6g}")
            scores, where = ranked.setdefault(cell, []), seen.setdefault(cell, {})
            if outcome not in where:
                where[outcome] = len(scores)
                scores.append((final_accuracy(summary, split), p))
            elif (len(edge_axes(p, candidates[cell]))
                  < len(edge_axes(scores[where[outcome]][1], candidates[cell]))):
                scores[where[outcome]] = (final_accuracy(summary, split), p)
        for cell, scores in ranked.items():
            scores.sort(key=lambda t: -t[0])  # stable: grid order breaks ties
            alive[cell] = survivors(scores, alive[cell], keep, ladder.step)
    full = ladder.rungs[-1][0]
    while extend := [(cell, p) for cell, scores in ranked.items()
                     for p in smaller_steps(scores, previous.get(cell, []), candidates[cell],
                                            ladder)]:
        summaries = lab.run_many([ladder.proxy(p, full) for _, p in extend])
        for (cell, p), summary in zip(extend, summaries, strict=True):
            ranked[cell].append((final_accuracy(summary, split), p))
        for cell in {cell for cell, _ in extend}:
            ranked[cell].sort(key=lambda t: -t[0])
    return ranked


def grid_floor(low: float) -> float:
    """The smallest value the below-grid hedge may give an axis whose grid minimum is ``low``
    (:data:`BELOW_GRID` decades below it); comparisons allow a relative 1e-9 of rounding."""
    return low / 10**BELOW_GRID


def smaller_steps(scores: list[tuple[float, Config]], previous: list[tuple[float, Config]],
                  points: list[Config], ladder: StepLadder) -> list[Config]:
    """The next points of the extended hedge (:func:`select`), none unless the best of
    ``scores`` has the smallest step among them: the best of ``previous`` (ranked) with at most
    1/10 of its step; when ``previous`` has none, the best point itself with one of
    ``ladder.step_axes`` (those the grid ``points`` tunes) divided by 10, for every such axis at
    or below the grid's smallest value (at most :data:`BELOW_GRID` decades below it), each not
    run yet. A selected point at the small-step end of the grid is an edge the protocol would
    otherwise never look past; which factor of the step to shrink matters (measured for
    α-NormEC: docs/reproductions.md, "Below the grid"), so every one is tried."""
    step = ladder.step
    winner = scores[0][1]
    best = step(winner)
    if best > min(step(p) for _, p in scores):
        return []
    inside = best_within([(step(p), p) for _, p in previous], best / 10)
    if inside is not None:
        return [inside]
    done = [p for _, p in scores]
    below = []
    for axis in ladder.step_axes:
        values = sorted({float(p[axis]) for p in points if axis in p})
        if len(values) < 2 or float(winner[axis]) > values[0]:
            continue
        value = float(f"{float(winner[axis]) / 10:.3g}")
        if value >= grid_floor(values[0]) * (1 - 1e-9):
            point = {**winner, axis: value}
            if point not in done:
                below.append(point)
    return below


def edge_axes(point: Config, points: list[Config]) -> list[str]:
    """The tuned axes of ``point`` that sit on the edge of the grid ``points`` (empty when
    interior), ``"<axis> below grid"``/``"<axis> above grid"`` for a value outside it (the
    extended hedge of :func:`select`; ``" (at the limit)"`` added at :data:`BELOW_GRID` decades
    below, where the hedge stops whether or not it still wins); an axis with at most two values
    has no interior and is never counted as an edge."""
    edges = []
    for key in points[0]:
        values = sorted({p[key] for p in points})
        if point[key] < values[0]:
            capped = point[key] <= grid_floor(values[0]) * (1 + 1e-9)
            edges.append(f"{key} below grid{' (at the limit)' if capped else ''}")
        elif point[key] > values[-1]:
            edges.append(f"{key} above grid")
        elif len(values) > 2 and point[key] in (values[0], values[-1]):
            edges.append(key)
    return edges


def seed_runs(lab: Any, ranked: dict[Cell, list[tuple[float, Config]]],
              grids: dict[str, list[Config]], seeds: Sequence[int],
              step: Callable[[Config], float], change: Config | None = None
              ) -> dict[Cell, Any]:
    """Each cell's selected point, with ``change`` applied (e.g. another federation), run with
    fresh ``seeds``: the cells' results (test accuracy mean ± std, whatever split ``ranked`` was
    selected by; the point run; the full-length selection runs with their accuracies on that
    split and ``step`` sizes; grid edges; the ledger's ε). ``grids[cell[1]]`` is the cell's grid
    (cells are keyed ``(model, method, …)``)."""
    chosen = {cell: {**scores[0][1], **(change or {})} for cell, scores in ranked.items()}
    reruns = {cell: [{**chosen[cell], "seed": s} for s in seeds] for cell in ranked}
    summaries = iter(lab.run_many([c for runs in reruns.values() for c in runs]))
    cells: dict[Cell, Any] = {}
    for cell, runs in reruns.items():
        accs = [final_accuracy(next(summaries)) for _ in runs]
        tuned, points = ranked[cell][0][1], grids[cell[1]]
        cells[cell] = {
            "accuracy": mean_std(accs), "runs": accs, "selected": chosen[cell],
            "proxy": [[acc, step(p), {k: p[k] for k in points[0]}]
                      for acc, p in ranked[cell]],
            "edge": ", ".join(edge_axes({k: tuned[k] for k in points[0]}, points)),
            "epsilon_accountant": max((lab.summary(r) or {}).get("epsilon_max") or 0.0
                                      for r in runs),
        }
    return cells


def walk_past_edge(lab: Runs, best: dict[Cell, tuple[float, float, Config]], axis: str,
                   values: Sequence[float], seeds: Sequence[int],
                   metric: Callable[[dict[str, Any]], float], *, factor: float = 2.0,
                   limit: int = 3, **run_options: Any) -> dict[Cell, tuple[float, float, Config]]:
    """Selection with ``axis`` past the grid ``values`` (increasing), for a metric to minimise:
    each cell of ``best`` (``(mean, std, point)``) whose selected value is an end of ``values``
    runs its winner with the value multiplied by ``factor`` (divided at the low end), every
    seed, and goes on while the new value has the lower mean ``metric`` of the runs'
    summaries, at most ``limit`` times (e.g. ``lambda s: -final_accuracy(s, "validation")``
    to walk by validation accuracy). ``run_options`` go to ``lab.run_many``. Returns every
    cell, extended or not."""
    out = dict(best)
    frontier = {key: b for key, b in best.items() if b[2][axis] in (values[0], values[-1])}
    for _ in range(limit):
        trial = {key: {**p, axis: p[axis] * (factor if p[axis] >= values[-1] else 1 / factor)}
                 for key, (_, _, p) in frontier.items()}
        summaries = iter(lab.run_many([{**p, "seed": s} for p in trial.values() for s in seeds],
                                      **run_options))
        frontier = {}
        for key, point in trial.items():
            m, sd = mean_std([metric(next(summaries)) for _ in seeds])
            if math.isfinite(m) and m < out[key][0]:
                out[key] = frontier[key] = (m, sd, point)
    return out
