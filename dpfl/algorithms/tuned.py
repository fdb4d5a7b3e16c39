"""The ``"auto"`` values that follow the run's ε: each algorithm's point selected by the matched-ε
benchmark (``dpfl reproduce benchmark epsilon``, docs/benchmark.md) at the benchmarked ε nearest
the run's, on a log scale (a tie goes to the smaller ε, the more private of the two).

:data:`POINTS` holds the selected points, copied from a benchmark report's ``selected.json`` (its
MNIST cross-silo IID table); an algorithm absent from it keeps its own ``defaults``
(:mod:`dpfl.algorithms.base`). A Python module, not a data file, so that Flower's
app bundle, which carries the package's Python files, ships it to every node.
"""

from __future__ import annotations

import math

#: where :data:`POINTS` comes from: the benchmark's dataset, federation, rounds and seeds
SOURCE = ""
#: algorithm -> benchmarked ε -> the selected values of its ``"auto"`` keys
POINTS: dict[str, dict[float, dict[str, float]]] = {}


def tuned_value(algorithm: str, key: str, epsilon: float,
                points: dict[str, dict[float, dict[str, float]]] | None = None) -> float | None:
    """``algorithm``'s selected ``key`` at the benchmarked ε nearest ``epsilon`` (None where the
    algorithm or the key was not benchmarked)."""
    by_epsilon = (POINTS if points is None else points).get(algorithm)
    if not by_epsilon or not epsilon > 0:
        return None
    nearest = min(by_epsilon, key=lambda e: (abs(math.log(e / epsilon)), e))
    return by_epsilon[nearest].get(key)
