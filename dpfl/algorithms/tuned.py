"""The ``"auto"`` values that follow the run's ε: each algorithm's point selected by the matched-ε
benchmark (``dpfl reproduce benchmark epsilon``, docs/benchmark.md) at the benchmarked ε nearest
the run's, on a log scale (a tie goes to the smaller ε, the more private of the two), in the
benchmarked setting of the run's dataset and partitioner where there is one.

:data:`POINTS` holds the selected points of the MNIST cross-silo IID table, copied from the
benchmark report's ``selected.json``, which every run outside :data:`SETTINGS` (MNIST with
Dirichlet clients, Fashion-MNIST with IID ones, copied from theirs) takes; an algorithm absent
from its table keeps its own ``defaults`` (:mod:`dpfl.algorithms.base`). A Python module, not a
data file, so that Flower's app bundle, which carries the package's Python files, ships it to
every node.
"""

from __future__ import annotations

import math

#: where :data:`POINTS` comes from: the benchmark's dataset, federation, rounds and seeds
SOURCE = ("dpfl reproduce benchmark epsilon: MNIST, 10 IID clients, 200 rounds, seeds 1-3 "
          "(reports/benchmark-epsilon/selected.json)")
#: algorithm -> benchmarked ε -> the selected values of its ``"auto"`` keys
POINTS: dict[str, dict[float, dict[str, float]]] = {
    "adaptdp-fedavg": {
        1.0: {"clip": 1.0, "learning-rate": 0.3},
        2.0: {"clip": 1.0, "learning-rate": 0.3},
        4.0: {"clip": 0.3, "learning-rate": 3.0},
        8.0: {"clip": 0.3, "learning-rate": 3.0},
    },
    "alpha-normec": {
        1.0: {"beta-hat": 0.001, "clip": 1.0, "learning-rate": 0.01},
        2.0: {"beta-hat": 0.001, "clip": 1.0, "learning-rate": 0.01},
        4.0: {"beta-hat": 0.001, "clip": 1.0, "learning-rate": 0.1},
        8.0: {"beta-hat": 0.001, "clip": 1.0, "learning-rate": 0.001},
    },
    "clip-sgd": {
        1.0: {"clip": 0.01, "learning-rate": 0.001},
        2.0: {"clip": 0.001, "learning-rate": 1.0},
        4.0: {"clip": 0.1, "learning-rate": 0.01},
        8.0: {"clip": 0.1, "learning-rate": 0.01},
    },
    "clip21-sgd": {
        1.0: {"clip": 0.001, "learning-rate": 0.01},
        2.0: {"clip": 0.001, "learning-rate": 0.01},
        4.0: {"clip": 0.001, "learning-rate": 0.1},
        8.0: {"clip": 0.001, "learning-rate": 0.001},
    },
    "clip21-sgd2m": {
        1.0: {"clip": 0.001, "learning-rate": 0.01},
        2.0: {"clip": 0.01, "learning-rate": 0.001},
        4.0: {"clip": 0.01, "learning-rate": 0.01},
        8.0: {"clip": 0.001, "learning-rate": 0.001},
    },
    "clip21-sgd2m-plus": {
        1.0: {"clip": 3.0, "clip-inner": 1.0, "learning-rate": 0.3},
        2.0: {"clip": 3.0, "clip-inner": 1.0, "learning-rate": 0.3},
        4.0: {"clip": 0.3, "clip-inner": 0.1, "learning-rate": 10.0},
        8.0: {"clip": 0.3, "clip-inner": 0.1, "learning-rate": 10.0},
    },
    "dp-fedavg": {
        1.0: {"clip": 1.0, "learning-rate": 0.3},
        2.0: {"clip": 1.0, "learning-rate": 0.3},
        4.0: {"clip": 0.3, "learning-rate": 3.0},
        8.0: {"clip": 0.3, "learning-rate": 3.0},
    },
    "dp-fedavg-quantile": {
        1.0: {"clip": 1.0, "learning-rate": 0.01},
        2.0: {"clip": 1.0, "learning-rate": 0.01},
        4.0: {"clip": 1.0, "learning-rate": 0.01},
        8.0: {"clip": 0.01, "learning-rate": 0.01},
    },
    "dp-scaffold": {
        1.0: {"clip": 1.0, "learning-rate": 0.3},
        2.0: {"clip": 1.0, "learning-rate": 0.3},
        4.0: {"clip": 0.3, "learning-rate": 3.0},
        8.0: {"clip": 0.3, "learning-rate": 3.0},
    },
    "dp-sgd": {
        1.0: {"clip": 0.3, "learning-rate": 3.0},
        2.0: {"clip": 1.0, "learning-rate": 1.0},
        4.0: {"clip": 3.0, "learning-rate": 0.3},
        8.0: {"clip": 3.0, "learning-rate": 0.3},
    },
    "dpsgd-gc": {
        1.0: {"clip": 1.0, "learning-rate": 0.3},
        2.0: {"clip": 1.0, "learning-rate": 0.3},
        4.0: {"clip": 0.3, "learning-rate": 3.0},
        8.0: {"clip": 0.3, "learning-rate": 3.0},
    },
    "fedpcdp": {
        1.0: {"clip": 1.0, "learning-rate": 3.0},
        2.0: {"clip": 3.0, "learning-rate": 1.0},
        4.0: {"clip": 1.0, "learning-rate": 3.0},
        8.0: {"clip": 1.0, "learning-rate": 3.0},
    },
    "fedpdp": {
        1.0: {"clip": 1.0, "learning-rate": 3.0},
        2.0: {"clip": 1.0, "learning-rate": 3.0},
        4.0: {"clip": 1.0, "learning-rate": 3.0},
        8.0: {"clip": 3.0, "learning-rate": 1.0},
    },
    "pcdp-sgd": {
        1.0: {"clip": 0.3, "learning-rate": 10.0},
        2.0: {"clip": 3.0, "learning-rate": 1.0},
        4.0: {"clip": 1.0, "learning-rate": 3.0},
        8.0: {"clip": 3.0, "learning-rate": 1.0},
    },
    "pdp-sgd": {
        1.0: {"clip": 3.0, "learning-rate": 1.0},
        2.0: {"clip": 3.0, "learning-rate": 0.3},
        4.0: {"clip": 3.0, "learning-rate": 1.0},
        8.0: {"clip": 3.0, "learning-rate": 1.0},
    },
    "prisma": {
        1.0: {"clip": 1.0, "gamma": 0.5, "learning-rate": 0.3},
        2.0: {"clip": 1.0, "gamma": 0.5, "learning-rate": 0.3},
        4.0: {"clip": 1.0, "gamma": 0.5, "learning-rate": 0.3},
        8.0: {"clip": 1.0, "gamma": 0.5, "learning-rate": 0.3},
    },
    "rpdp-sgd": {
        1.0: {"clip": 0.3, "learning-rate": 30.0},
        2.0: {"clip": 0.1, "learning-rate": 300.0},
        4.0: {"clip": 0.1, "learning-rate": 300.0},
        8.0: {"clip": 0.1, "learning-rate": 300.0},
    },
    "rsdp-sgd": {
        1.0: {"clip": 3.0, "learning-rate": 0.3},
        2.0: {"clip": 1.0, "learning-rate": 1.0},
        4.0: {"clip": 3.0, "learning-rate": 0.3},
        8.0: {"clip": 3.0, "learning-rate": 0.3},
    },
}

#: the other benchmarked settings' selected points, by (dataset, partitioner); a run on one of
#: them takes its own table, every other run :data:`POINTS`
SETTINGS: dict[tuple[str, str], dict[str, dict[float, dict[str, float]]]] = {
    ("mnist", "dirichlet"): {  # 10 clients, Dirichlet alpha = 0.1 (reports/benchmark-epsilon)
        "adaptdp-fedavg": {
            1.0: {"clip": 1.0, "learning-rate": 0.3},
            2.0: {"clip": 1.0, "learning-rate": 0.3},
            4.0: {"clip": 0.3, "learning-rate": 3.0},
            8.0: {"clip": 3.0, "learning-rate": 0.3},
        },
        "alpha-normec": {
            1.0: {"beta-hat": 0.001, "clip": 1.0, "learning-rate": 0.01},
            2.0: {"beta-hat": 0.001, "clip": 1.0, "learning-rate": 0.01},
            4.0: {"beta-hat": 0.01, "clip": 1.0, "learning-rate": 0.01},
            8.0: {"beta-hat": 0.001, "clip": 1.0, "learning-rate": 0.001},
        },
        "clip-sgd": {
            1.0: {"clip": 0.001, "learning-rate": 0.01},
            2.0: {"clip": 0.1, "learning-rate": 0.01},
            4.0: {"clip": 0.01, "learning-rate": 0.1},
            8.0: {"clip": 0.1, "learning-rate": 0.01},
        },
        "clip21-sgd": {
            1.0: {"clip": 0.001, "learning-rate": 0.01},
            2.0: {"clip": 0.001, "learning-rate": 0.01},
            4.0: {"clip": 0.01, "learning-rate": 0.01},
            8.0: {"clip": 0.001, "learning-rate": 0.001},
        },
        "clip21-sgd2m": {
            1.0: {"clip": 0.01, "learning-rate": 0.001},
            2.0: {"clip": 0.01, "learning-rate": 0.001},
            4.0: {"clip": 0.1, "learning-rate": 0.001},
            8.0: {"clip": 0.001, "learning-rate": 0.001},
        },
        "clip21-sgd2m-plus": {
            1.0: {"clip": 3.0, "clip-inner": 1.0, "learning-rate": 0.3},
            2.0: {"clip": 0.3, "clip-inner": 0.1, "learning-rate": 10.0},
            4.0: {"clip": 0.3, "clip-inner": 1.0, "learning-rate": 1.0},
            8.0: {"clip": 0.3, "clip-inner": 1.0, "learning-rate": 1.0},
        },
        "dp-fedavg": {
            1.0: {"clip": 1.0, "learning-rate": 0.3},
            2.0: {"clip": 0.3, "learning-rate": 3.0},
            4.0: {"clip": 0.3, "learning-rate": 3.0},
            8.0: {"clip": 3.0, "learning-rate": 0.3},
        },
        "dp-fedavg-quantile": {
            1.0: {"clip": 1.0, "learning-rate": 0.01},
            2.0: {"clip": 1.0, "learning-rate": 0.01},
            4.0: {"clip": 1.0, "learning-rate": 0.01},
            8.0: {"clip": 0.1, "learning-rate": 0.01},
        },
        "dp-scaffold": {
            1.0: {"clip": 1.0, "learning-rate": 0.3},
            2.0: {"clip": 0.3, "learning-rate": 3.0},
            4.0: {"clip": 0.3, "learning-rate": 3.0},
            8.0: {"clip": 3.0, "learning-rate": 0.3},
        },
        "dp-sgd": {
            1.0: {"clip": 3.0, "learning-rate": 0.3},
            2.0: {"clip": 3.0, "learning-rate": 0.3},
            4.0: {"clip": 3.0, "learning-rate": 0.3},
            8.0: {"clip": 3.0, "learning-rate": 0.3},
        },
        "dpsgd-gc": {
            1.0: {"clip": 1.0, "learning-rate": 0.3},
            2.0: {"clip": 0.3, "learning-rate": 3.0},
            4.0: {"clip": 3.0, "learning-rate": 0.3},
            8.0: {"clip": 3.0, "learning-rate": 0.3},
        },
        "fedpcdp": {
            1.0: {"clip": 0.3, "learning-rate": 10.0},
            2.0: {"clip": 3.0, "learning-rate": 1.0},
            4.0: {"clip": 1.0, "learning-rate": 3.0},
            8.0: {"clip": 3.0, "learning-rate": 1.0},
        },
        "fedpdp": {
            1.0: {"clip": 0.3, "learning-rate": 10.0},
            2.0: {"clip": 1.0, "learning-rate": 3.0},
            4.0: {"clip": 3.0, "learning-rate": 1.0},
            8.0: {"clip": 3.0, "learning-rate": 1.0},
        },
        "pcdp-sgd": {
            1.0: {"clip": 3.0, "learning-rate": 0.3},
            2.0: {"clip": 3.0, "learning-rate": 1.0},
            4.0: {"clip": 3.0, "learning-rate": 1.0},
            8.0: {"clip": 1.0, "learning-rate": 3.0},
        },
        "pdp-sgd": {
            1.0: {"clip": 0.3, "learning-rate": 10.0},
            2.0: {"clip": 3.0, "learning-rate": 1.0},
            4.0: {"clip": 3.0, "learning-rate": 1.0},
            8.0: {"clip": 3.0, "learning-rate": 1.0},
        },
        "prisma": {
            1.0: {"clip": 1.0, "gamma": 0.5, "learning-rate": 0.3},
            2.0: {"clip": 1.0, "gamma": 0.5, "learning-rate": 0.3},
            4.0: {"clip": 1.0, "gamma": 0.5, "learning-rate": 0.3},
            8.0: {"clip": 1.0, "gamma": 0.5, "learning-rate": 0.3},
        },
        "rpdp-sgd": {
            1.0: {"clip": 0.3, "learning-rate": 30.0},
            2.0: {"clip": 0.3, "learning-rate": 30.0},
            4.0: {"clip": 0.1, "learning-rate": 300.0},
            8.0: {"clip": 0.1, "learning-rate": 300.0},
        },
        "rsdp-sgd": {
            1.0: {"clip": 3.0, "learning-rate": 0.3},
            2.0: {"clip": 3.0, "learning-rate": 0.3},
            4.0: {"clip": 3.0, "learning-rate": 0.3},
            8.0: {"clip": 3.0, "learning-rate": 0.3},
        },
    },
    ("fashion-mnist", "iid"): {  # 10 IID clients (reports/benchmark-epsilon-fashion-mnist)
        "adaptdp-fedavg": {
            1.0: {"clip": 1.0, "learning-rate": 0.3},
            2.0: {"clip": 0.3, "learning-rate": 3.0},
            4.0: {"clip": 1.0, "learning-rate": 1.0},
            8.0: {"clip": 3.0, "learning-rate": 0.3},
        },
        "alpha-normec": {
            1.0: {"beta-hat": 0.001, "clip": 1.0, "learning-rate": 0.01},
            2.0: {"beta-hat": 0.001, "clip": 1.0, "learning-rate": 0.01},
            4.0: {"beta-hat": 0.001, "clip": 1.0, "learning-rate": 0.1},
            8.0: {"beta-hat": 0.001, "clip": 1.0, "learning-rate": 0.1},
        },
        "clip-sgd": {
            1.0: {"clip": 0.01, "learning-rate": 1.0},
            2.0: {"clip": 0.01, "learning-rate": 1.0},
            4.0: {"clip": 0.01, "learning-rate": 1.0},
            8.0: {"clip": 1.0, "learning-rate": 0.01},
        },
        "clip21-sgd": {
            1.0: {"clip": 0.001, "learning-rate": 0.01},
            2.0: {"clip": 0.001, "learning-rate": 0.01},
            4.0: {"clip": 0.001, "learning-rate": 0.1},
            8.0: {"clip": 0.001, "learning-rate": 0.1},
        },
        "clip21-sgd2m": {
            1.0: {"clip": 0.01, "learning-rate": 0.001},
            2.0: {"clip": 0.01, "learning-rate": 0.01},
            4.0: {"clip": 0.001, "learning-rate": 0.1},
            8.0: {"clip": 0.001, "learning-rate": 0.1},
        },
        "clip21-sgd2m-plus": {
            1.0: {"clip": 3.0, "clip-inner": 1.0, "learning-rate": 0.3},
            2.0: {"clip": 0.3, "clip-inner": 0.1, "learning-rate": 10.0},
            4.0: {"clip": 3.0, "clip-inner": 1.0, "learning-rate": 1.0},
            8.0: {"clip": 3.0, "clip-inner": 1.0, "learning-rate": 1.0},
        },
        "dp-fedavg": {
            1.0: {"clip": 0.3, "learning-rate": 3.0},
            2.0: {"clip": 0.3, "learning-rate": 3.0},
            4.0: {"clip": 3.0, "learning-rate": 0.3},
            8.0: {"clip": 3.0, "learning-rate": 0.3},
        },
        "dp-fedavg-quantile": {
            1.0: {"clip": 1.0, "learning-rate": 0.01},
            2.0: {"clip": 10.0, "learning-rate": 0.01},
            4.0: {"clip": 1.0, "learning-rate": 0.01},
            8.0: {"clip": 0.1, "learning-rate": 0.01},
        },
        "dp-scaffold": {
            1.0: {"clip": 0.3, "learning-rate": 3.0},
            2.0: {"clip": 0.3, "learning-rate": 3.0},
            4.0: {"clip": 3.0, "learning-rate": 0.3},
            8.0: {"clip": 3.0, "learning-rate": 0.3},
        },
        "dp-sgd": {
            1.0: {"clip": 1.0, "learning-rate": 1.0},
            2.0: {"clip": 3.0, "learning-rate": 0.3},
            4.0: {"clip": 3.0, "learning-rate": 0.3},
            8.0: {"clip": 3.0, "learning-rate": 0.3},
        },
        "dpsgd-gc": {
            1.0: {"clip": 1.0, "learning-rate": 0.3},
            2.0: {"clip": 0.3, "learning-rate": 3.0},
            4.0: {"clip": 3.0, "learning-rate": 0.3},
            8.0: {"clip": 3.0, "learning-rate": 0.3},
        },
        "fedpcdp": {
            1.0: {"clip": 3.0, "learning-rate": 0.3},
            2.0: {"clip": 3.0, "learning-rate": 0.3},
            4.0: {"clip": 1.0, "learning-rate": 3.0},
            8.0: {"clip": 1.0, "learning-rate": 3.0},
        },
        "fedpdp": {
            1.0: {"clip": 1.0, "learning-rate": 3.0},
            2.0: {"clip": 3.0, "learning-rate": 1.0},
            4.0: {"clip": 0.3, "learning-rate": 10.0},
            8.0: {"clip": 0.3, "learning-rate": 10.0},
        },
        "pcdp-sgd": {
            1.0: {"clip": 3.0, "learning-rate": 1.0},
            2.0: {"clip": 0.3, "learning-rate": 10.0},
            4.0: {"clip": 1.0, "learning-rate": 3.0},
            8.0: {"clip": 0.3, "learning-rate": 10.0},
        },
        "pdp-sgd": {
            1.0: {"clip": 1.0, "learning-rate": 3.0},
            2.0: {"clip": 0.3, "learning-rate": 10.0},
            4.0: {"clip": 1.0, "learning-rate": 3.0},
            8.0: {"clip": 0.3, "learning-rate": 10.0},
        },
        "prisma": {
            1.0: {"clip": 1.0, "gamma": 0.5, "learning-rate": 0.3},
            2.0: {"clip": 1.0, "gamma": 0.5, "learning-rate": 0.3},
            4.0: {"clip": 1.0, "gamma": 0.5, "learning-rate": 0.3},
            8.0: {"clip": 1.0, "gamma": 0.5, "learning-rate": 0.3},
        },
        "rpdp-sgd": {
            1.0: {"clip": 0.3, "learning-rate": 30.0},
            2.0: {"clip": 0.3, "learning-rate": 100.0},
            4.0: {"clip": 0.3, "learning-rate": 100.0},
            8.0: {"clip": 0.3, "learning-rate": 100.0},
        },
        "rsdp-sgd": {
            1.0: {"clip": 3.0, "learning-rate": 0.3},
            2.0: {"clip": 3.0, "learning-rate": 0.3},
            4.0: {"clip": 1.0, "learning-rate": 1.0},
            8.0: {"clip": 1.0, "learning-rate": 3.0},
        },
    },
}


def points_of(dataset: str, partitioner: str) -> dict[str, dict[float, dict[str, float]]]:
    """The selected points a run on ``dataset`` split by ``partitioner`` takes: its setting's
    (:data:`SETTINGS`), else MNIST IID's (:data:`POINTS`)."""
    return SETTINGS.get((dataset, partitioner), POINTS)


def tuned_value(algorithm: str, key: str, epsilon: float,
                points: dict[str, dict[float, dict[str, float]]] | None = None) -> float | None:
    """``algorithm``'s selected ``key`` at the benchmarked ε nearest ``epsilon`` in ``points``
    (default :data:`POINTS`; None where the algorithm or the key was not benchmarked)."""
    by_epsilon = (POINTS if points is None else points).get(algorithm)
    if not by_epsilon or not epsilon > 0:
        return None
    nearest = min(by_epsilon, key=lambda e: (abs(math.log(e / epsilon)), e))
    return by_epsilon[nearest].get(key)


def followed_keys(algorithm: str) -> set[str]:
    """The keys whose ``"auto"`` value follows ε for ``algorithm`` (none where it was not
    benchmarked)."""
    tables = [POINTS, *SETTINGS.values()]
    return {key for table in tables for point in table.get(algorithm, {}).values()
            for key in point}
