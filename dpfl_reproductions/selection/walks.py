"""Walking a cell's selected point past the edge of its grid, while that improves it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from dpfl_reproductions.selection.grids import Config, past_edge
from dpfl_reproductions.selection.intervals import mean_std
from dpfl_reproductions.selection.ranking import Ranking, Summary
from dpfl_reproductions.selection.runs import Runner, Runs

K = TypeVar("K")


@dataclass(frozen=True)
class Walked:
    """Where a cell's walk ended: the ranking's value of its point (the mean over the seeds), the
    point, the point's runs (empty where the walk never moved it: its runs are the caller's),
    and whether it still sits at an edge of what was searched."""

    value: float
    point: Config
    runs: list[Summary]
    edge: bool


def walk_past_edges(runner: Runner, start: dict[K, tuple[float, Config]],
                    grids: dict[K, list[Config]], axes: Sequence[str], seeds: Sequence[int],
                    ranking: Ranking, *, factor: float = 2.0, limit: int = 3) -> dict[K, Walked]:
    """Each cell of ``start`` (its selected point and the ranking's value of it) whose point
    sits at an end of its grid on some of ``axes`` runs the points one step past it
    (:func:`~dpfl_reproductions.selection.grids.past_edge`: × or ÷ ``factor``, one axis at a
    time and those at an edge together) on every seed, moves to the best of them where it
    :meth:`~Ranking.improves` on the point's value, and goes on from there, at most ``limit``
    steps. Returns every cell, walked or not."""
    searched = {cell: list(grids[cell]) for cell in start}
    out = {cell: Walked(value, point, [], False) for cell, (value, point) in start.items()}
    moving = list(start)
    for _ in range(limit):
        trial = {cell: past_edge(out[cell].point, searched[cell], axes, factor)
                 for cell in moving}
        jobs = [(cell, p) for cell, points in trial.items() for p in points]
        if not jobs:
            break
        runs = iter(runner.runs(jobs, seeds))
        moving = []
        for cell, points in trial.items():
            searched[cell] += points
            for p in points:
                summaries = next(runs)
                value = ranking.value(summaries)
                if ranking.improves(value, out[cell].value):
                    out[cell] = Walked(value, p, summaries, False)
                    if cell not in moving:
                        moving.append(cell)
    return {cell: replace(w, edge=bool(past_edge(w.point, searched[cell], axes, factor)))
            for cell, w in out.items()}


def walk_past_edge(lab: Runs, best: dict[K, tuple[float, float, Config]], axis: str,
                   values: Sequence[float], seeds: Sequence[int],
                   metric: Callable[[Summary], float], *, factor: float = 2.0,
                   limit: int = 3, **run_options: Any) -> dict[K, tuple[float, float, Config]]:
    """:func:`walk_past_edges` along the one ``axis`` whose grid is ``values``, for a metric
    to minimise: each cell of ``best`` (``(mean, std, point)``, a point of full run
    configurations) whose selected value is an end of ``values`` runs its winner on every seed
    of ``seeds`` with the value multiplied by ``factor`` (divided at the low end), and goes on
    while the mean ``metric`` of the runs' summaries falls, at most ``limit`` times (e.g.
    ``lambda s: -final_accuracy(s, "validation")`` to walk by validation accuracy).
    ``run_options`` go to ``lab.run_many``. Returns every cell, with the mean ± std of its
    point's metric."""
    runner = Runner(lambda cell, point, seed: {**point, "seed": seed},
                    functools.partial(lab.run_many, **run_options))
    walked = walk_past_edges(runner, {cell: (m, p) for cell, (m, _, p) in best.items()},
                             {cell: [{**p, axis: v} for v in values]
                              for cell, (_, _, p) in best.items()},
                             (axis,), seeds, Ranking(metric), factor=factor, limit=limit)
    return {cell: best[cell] if not w.runs else (*mean_std([metric(s) for s in w.runs]), w.point)
            for cell, w in walked.items()}
