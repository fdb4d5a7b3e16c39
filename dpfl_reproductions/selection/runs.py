"""How a selection runs a point: its configuration in a cell at a seed, the lab call that runs
many at once, and the ``dpfl run`` line that reruns one alone."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from dpfl.config import format_options, format_overrides, parse_options
from dpfl_reproductions.selection.grids import Config
from dpfl_reproductions.selection.ranking import Summary

K = TypeVar("K")


class Runs(Protocol):
    """What selection needs of a :class:`~dpfl_reproductions.lab.Lab`."""

    def run_many(self, configs: Sequence[Config], **kwargs: Any) -> list[Summary]: ...


@dataclass(frozen=True)
class Runner:
    """How an experiment runs a point of one of its cells at a seed: ``config(cell, point,
    seed)`` is the run's configuration (a point: a grid point, or one axis' value),
    ``run_many(configs)`` their summaries in order (a lab's
    :meth:`~dpfl_reproductions.lab.Lab.run_many`, or its ``run_batched`` for a simulator)."""

    config: Callable[[Any, Any, int], Config]
    run_many: Callable[[list[Config]], list[Summary]]

    def runs(self, jobs: Sequence[tuple[Any, Any]], seeds: Sequence[int]
             ) -> list[list[Summary]]:
        """Each ``(cell, point)`` of ``jobs`` on every seed, in one call: the runs of each job,
        by seed."""
        summaries = iter(self.run_many([self.config(cell, point, seed) for cell, point in jobs
                                        for seed in seeds]))
        return [[next(summaries) for _ in seeds] for _ in jobs]

    def on_seeds(self, chosen: Mapping[K, Any], seeds: Sequence[int]
                 ) -> dict[K, list[Summary]]:
        """Each cell's point of ``chosen`` on every seed (a confirmation on tuning seeds, or the
        seed runs on fresh ones): the runs of each cell, by seed."""
        return dict(zip(chosen, self.runs(list(chosen.items()), seeds), strict=True))


def command(values: Config) -> str:
    """The ``dpfl run`` line that re-runs ``values`` alone (a shell line: option strings
    written with bare words, so that they nest without escapes)."""
    keep = {k: format_options(parse_options(v)) if k.endswith("-options") and isinstance(v, str)
            else v for k, v in values.items() if k not in ("results-dir", "run-name")}
    return f"dpfl run --run-config {shlex.quote(format_overrides(keep))}"
