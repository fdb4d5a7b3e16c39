"""Seed statistics of the selected points: mean ± std, and paired differences with their
t-interval."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats

LEVEL = 0.95  # the confidence of a paired t-interval


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


def paired(ours: Sequence[float], theirs: Sequence[float], level: float = LEVEL, *,
           common: bool = False) -> Paired:
    """``ours`` − ``theirs`` seed by seed (the same seeds, in the same order) and the t-interval
    mean ± t(1 − (1 − level)/2, n − 1)·s/√n. ``common``: over the seeds both have, where one
    list runs further along the same seeds (a second stage of seeds run for some cells only)."""
    if common:
        n = min(len(ours), len(theirs))
        ours, theirs = ours[:n], theirs[:n]
    diffs = tuple(a - b for a, b in zip(ours, theirs, strict=True))
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return Paired(diffs, mean, math.nan, math.nan)
    half = (stats.t.ppf(1 - (1 - level) / 2, len(diffs) - 1) * statistics.stdev(diffs)
            / math.sqrt(len(diffs)))
    return Paired(diffs, mean, mean - half, mean + half)


def decided(diff: Paired, *, competitive: bool = False) -> str:
    """A claim decided by the paired interval of its difference: "refuted" when the interval
    lies below 0; else "confirmed" when it lies above 0, or for a claim of being competitive
    (not worse) whenever it does not lie below; else "undecided". "undecided (one seed)" without
    an interval."""
    if math.isnan(diff.low):
        return "undecided (one seed)"
    if diff.high < 0:
        return "refuted"
    return "confirmed" if competitive or diff.low > 0 else "undecided"
