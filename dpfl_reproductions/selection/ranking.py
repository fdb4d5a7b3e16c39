"""How a selection ranks points: the metric it reads of a run, on which split, the mean over a
point's seeds, and the tie rule.

Every selection of the reproductions ranks through :class:`Ranking` and :func:`best`. The tie
rule is one: the ranking's ``then`` metric where it has one (the benchmark's validation loss),
else the order the points were given in, the first of equal points winning. That order is the
grid's (so a grid written in increasing order prefers the smaller value of its first axis that
differs, e.g. the smaller step), or, at a rung of successive halving, the previous rung's
ranking.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, TypeVar

Summary = dict[str, Any]  # a run's summary (summary.json, or its archived fields)
# the server's evaluation set a selection ranks by (the ``<split>_accuracy`` of a summary)
Split = Literal["test", "validation"]
T = TypeVar("T")


def final_accuracy(summary: Summary, split: Split = "test") -> float:
    """A run's final accuracy on ``split`` in percent (0 for a run without one, e.g. diverged);
    a ValueError for a run evaluated without that split (a dataset without ``num_validation``),
    which would otherwise rank as 0."""
    if "test_loss" in summary and f"{split}_loss" not in summary:
        raise ValueError(f"the run has no {split} split to rank by: give the dataset option "
                         f"num_{split}")
    acc = summary.get(f"{split}_accuracy")
    return 100 * acc if acc is not None and math.isfinite(acc) else 0.0


def final_loss(summary: Summary, split: Split = "test") -> float:
    """A run's final loss on ``split`` (+∞ for a run without a finite one)."""
    loss = summary.get(f"{split}_loss")
    return loss if loss is not None and math.isfinite(loss) else math.inf


@dataclass(frozen=True)
class Ranking:
    """What a selection ranks a point's runs by.

    ``metric(summary)`` is the number read of a run, better higher where ``higher`` (an
    accuracy), else lower (a loss, a gradient norm); a point's :meth:`value` is the mean of its
    runs' (one per seed), and a point whose mean is not finite ranks last. ``then(summary)``,
    lower first, breaks ties; past it the order the points were given in decides (the module's
    tie rule)."""

    metric: Callable[[Summary], float]
    higher: bool = False
    then: Callable[[Summary], float] | None = None

    def value(self, runs: Sequence[Summary]) -> float:
        """The mean of the runs' metric."""
        return statistics.fmean(self.metric(s) for s in runs)

    def key(self, runs: Sequence[Summary]) -> tuple[float, ...]:
        """A sort key of a point's runs, lower first."""
        value = self.value(runs)
        first = (-value if self.higher else value) if math.isfinite(value) else math.inf
        if self.then is None:
            return (first,)
        then = statistics.fmean(self.then(s) for s in runs)
        return first, then if math.isfinite(then) else math.inf

    def improves(self, value: float, on: float) -> bool:
        """Whether the (finite) mean ``value`` is strictly better than ``on``."""
        return math.isfinite(value) and (value > on if self.higher else value < on)


def accuracy(split: Split = "test") -> Ranking:
    """By final accuracy on ``split``, higher first (the papers' protocol on the test set)."""
    return Ranking(partial(final_accuracy, split=split), higher=True)


def ranked(measured: Iterable[tuple[T, Sequence[Summary]]], ranking: Ranking
           ) -> list[tuple[T, Sequence[Summary]]]:
    """``measured`` (each a point and its runs) best first; equal ones keep their order."""
    return sorted(measured, key=lambda item: ranking.key(item[1]))


def best(measured: Iterable[tuple[T, Sequence[Summary]]], ranking: Ranking) -> T:
    """The best of ``measured`` (each a point and its runs), the first of equal ones."""
    return min(measured, key=lambda item: ranking.key(item[1]))[0]
