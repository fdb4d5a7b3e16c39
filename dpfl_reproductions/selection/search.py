"""A search at one or more tuning seeds: the points of each cell run once a seed and are
remembered, a cell's best by a ranking of its mean over the seeds, and the local search around
it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dpfl_reproductions.selection.grids import Cell, Config, neighbours

#: the points next to a point on a grid's axes (:func:`~.grids.neighbours` or
#: :func:`~.grids.axis_neighbours`)
Neighbourhood = Callable[[Config, dict[str, tuple[float, ...]]], list[Config]]
from dpfl_reproductions.selection.ranking import Ranking, Summary, best
from dpfl_reproductions.selection.runs import Runner


def point_key(point: Config) -> str:
    """A point's name among those searched (its keys sorted)."""
    return ",".join(f"{k}={v}" for k, v in sorted(point.items()))


class Search:
    """The points searched in each cell at the tuning ``seeds``, run by ``runner``:
    ``searched[cell][point_key(point)]`` is the point's runs (one a seed, in ``seeds``' order)
    and the point. A ranking reads a point's mean over its seeds: with several seeds (each
    drawing its own data where the seed draws the dataset) a point does not win by one seed's
    luck."""

    def __init__(self, runner: Runner, seeds: Sequence[int]) -> None:
        if not seeds:
            raise ValueError("a search needs at least one tuning seed")
        self.runner, self.seeds = runner, tuple(seeds)
        self.searched: dict[Cell, dict[str, tuple[list[Summary], Config]]] = {}

    def run(self, points: dict[Cell, list[Config]]) -> None:
        """Run the ``points`` of each cell not searched yet on every seed, and remember them."""
        jobs = [(cell, p) for cell, ps in points.items() for p in ps
                if point_key(p) not in self.searched.setdefault(cell, {})]
        for (cell, p), runs in zip(jobs, self.runner.runs(jobs, self.seeds), strict=True):
            self.searched[cell][point_key(p)] = (runs, p)

    def best(self, cell: Cell, ranking: Ranking) -> Config:
        """The best point searched in ``cell`` by its mean over the seeds (the first searched
        of equal ones)."""
        return best(((p, runs) for runs, p in self.searched[cell].values()), ranking)

    def local(self, ranking: Ranking, axes: Callable[[Cell], dict[str, tuple[float, ...]]],
              limit: int, around: Callable[[Cell], Neighbourhood] = lambda cell: neighbours,
              budget: Callable[[Cell], int | None] = lambda cell: None) -> int:
        """Every neighbour on the grid ``axes(cell)`` of each cell's best (``around(cell)``'s:
        by default one step on any axes at once), until every best is interior to what was
        searched, ``limit`` rounds ran, or a cell has searched ``budget(cell)`` points (the
        neighbours taken in their order up to it); returns how many rounds ran."""
        for step in range(limit):
            todo = {}
            for cell, searched in self.searched.items():
                new = [p for p in around(cell)(self.best(cell, ranking), axes(cell))
                       if point_key(p) not in searched]
                most = budget(cell)
                todo[cell] = new if most is None else new[:max(0, most - len(searched))]
            if not any(todo.values()):
                return step
            self.run(todo)
        return limit
