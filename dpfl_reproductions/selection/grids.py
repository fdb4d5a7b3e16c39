"""The grids a selection searches, their edges, and the points next to a point: one grid step
away inside the grid on any axes at once (:func:`neighbours`) or on one axis
(:func:`axis_neighbours`), or one step past its edge (:func:`past_edge`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from dpfl.config import Value

Config = dict[str, Value]
Cell = tuple[Any, ...]  # what a table's cell is keyed by, e.g. (model, method, ε)

BELOW_GRID = 3  # decades a step axis may go below the grid when its smallest step wins


def grid(**axes: Sequence[Value]) -> list[Config]:
    """The Cartesian product of ``axes`` (keys with ``_`` become run-config keys with ``-``)."""
    keys = [k.replace("_", "-") for k in axes]
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*axes.values())]


def grid_floor(low: float) -> float:
    """The smallest value the below-grid hedge may give an axis whose grid minimum is ``low``
    (:data:`BELOW_GRID` decades below it); comparisons allow a relative 1e-9 of rounding."""
    return low / 10**BELOW_GRID


def edge_axes(point: Config, points: list[Config]) -> list[str]:
    """The tuned axes of ``point`` that sit on the edge of the grid ``points`` (empty when
    interior), ``"<axis> below grid"``/``"<axis> above grid"`` for a value outside it (the
    extended hedge of :func:`~dpfl_reproductions.selection.halving.select`; ``" (at the
    limit)"`` added at :data:`BELOW_GRID` decades below, where the hedge stops whether or not it
    still wins); an axis with at most two values has no interior and is never counted as an
    edge."""
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


def neighbours(point: Config, axes: dict[str, tuple[float, ...]]) -> list[Config]:
    """``point`` and every point one grid step away on any of ``axes`` at once (the local
    search of :class:`~dpfl_reproductions.selection.search.Search`)."""
    options = []
    for key, values in axes.items():
        i = values.index(point[key])
        options.append(values[max(0, i - 1): i + 2])
    return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*options)]


def axis_neighbours(point: Config, axes: dict[str, tuple[float, ...]]) -> list[Config]:
    """``point`` and every point one grid step away on exactly one of ``axes``: two an axis,
    2k on k axes where :func:`neighbours` gives 3^k − 1, so that a search over four axes takes
    8 a round, as one over two does with :func:`neighbours`."""
    out = [point]
    for key, values in axes.items():
        i = values.index(point[key])
        out += [{**point, key: values[j]} for j in (i - 1, i + 1) if 0 <= j < len(values)]
    return out


def past_edge(point: Config, searched: list[Config], axes: Sequence[str],
              factor: float = 2.0) -> list[Config]:
    """The points one step (× ``factor`` at the top end, ÷ at the bottom) past each of ``axes``
    at whose end of the points ``searched`` ``point`` sits, one axis at a time and, where
    several are, all of them together; none searched yet (the walk of
    :func:`~dpfl_reproductions.selection.walks.walk_past_edges`)."""
    moves = {}
    for key in axes:
        values = [p[key] for p in searched]
        if point[key] >= max(values):
            moves[key] = point[key] * factor
        elif point[key] <= min(values):
            moves[key] = point[key] / factor
    out = [{**point, key: value} for key, value in moves.items()]
    if len(moves) > 1:
        out.append({**point, **moves})
    return [p for p in out if p not in searched]
