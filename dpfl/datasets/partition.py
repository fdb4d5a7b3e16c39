"""Splitting a training set over clients, through flwr-datasets' partitioners.

The training rows become a Hugging Face table with an ``index`` column (and a
``label`` column for label-based splits); the flwr-datasets partitioner splits
that table and each partition's ``index`` column is returned, sorted. The result
is a pure function of (dataset, partitioner, num_partitions, seed, alpha,
shards_per_partition): all randomness comes from ``seed``.

Registered partitioners:

- ``iid``: ``IidPartitioner`` over the rows shuffled with ``seed`` (the
  partitioner itself cuts contiguous, unshuffled blocks; shuffling first is
  what ``FederatedDataset`` does). Sizes differ by at most one.
- ``contiguous``: ``IidPartitioner`` in file order, unshuffled (the Clip21 LR
  experiments' split: the Clip21 paper's "n equal shards", in file order).
- ``dirichlet``: ``DirichletPartitioner`` (Hsu et al. 2019) with concentration
  ``alpha``, no self-balancing, and ``min_partition_size = min(10, n //
  num_partitions)`` (flwr-datasets' 10, relaxed where that is unattainable):
  flwr-datasets redraws until every partition has that many rows, and after 10
  draws this becomes a ConfigError.
- ``shards``: ``ShardPartitioner`` (McMahan et al. 2017): rows sorted by label,
  cut into shards of ``s = n // (num_partitions · shards_per_partition)`` rows,
  and each partition gets ``shards_per_partition`` random shards, so exactly
  ``shards_per_partition · s`` rows; the rows left over are in no partition.
  A shard that straddles a class boundary (or is larger than a class) holds
  several labels.
- ``natural``: the dataset's own per-client split (:func:`natural_partition`).

``dirichlet`` and ``shards`` split by class label; binary {-1, +1} labels count
as two classes, and regression datasets have no labels to split by.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from collections.abc import Callable
from functools import cache, lru_cache
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from dpfl.datasets.base import Dataset, natural_partition
from dpfl.errors import ConfigError
from dpfl.registry import Registry

if TYPE_CHECKING:  # flwr-datasets and datasets are imported on use (they take a second)
    import datasets as hf
    from flwr_datasets.partitioner import Partitioner

Split = Callable[..., list[np.ndarray]]

PARTITIONERS: Registry[Split] = Registry("partitioner")
BY_LABEL = ("dirichlet", "shards")


def partition(
    dataset: Dataset,
    *,
    partitioner: str,
    num_partitions: int,
    seed: int,
    alpha: float = 0.5,
    shards_per_partition: int = 2,
) -> list[np.ndarray]:
    """Split ``dataset``'s training rows into ``num_partitions`` parts.

    Returns one sorted int64 array of row indices into ``train_x`` per
    partition (fresh copies of a cached result); the arrays are disjoint and,
    except for ``shards`` (see the module docstring), cover every row. Raises
    ConfigError for an unknown partitioner, a partition count outside
    ``1..n``, ``alpha <= 0``, a label-based split of a regression task, or a
    split that would leave a partition empty (no partition is ever empty).
    """
    PARTITIONERS.get(partitioner)  # a ConfigError listing the names, if unknown
    n = dataset.num_train
    if (
        isinstance(num_partitions, bool)
        or not isinstance(num_partitions, int)
        or not 1 <= num_partitions <= n
    ):
        raise ConfigError(
            "num-partitions",
            f"{num_partitions!r} partitions of the {n} training rows of {dataset.name!r}",
            allowed=f"1..{n}",
        )
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise ConfigError(
            "alpha", f"the Dirichlet concentration must be positive, got {alpha!r}", allowed="> 0"
        )
    if partitioner in BY_LABEL and dataset.task == "regression":
        allowed = [
            p
            for p in PARTITIONERS
            if p not in BY_LABEL and (p != "natural" or dataset.client_sizes)
        ]
        raise ConfigError(
            "partitioner",
            f"{partitioner!r} splits by class label, and {dataset.name!r} is a regression task",
            allowed=allowed,
        )
    parts = _split(dataset, partitioner, num_partitions, seed, alpha, shards_per_partition)
    return [part.copy() for part in parts]


@lru_cache(maxsize=32)
def _split(
    dataset: Dataset,
    partitioner: str,
    num_partitions: int,
    seed: int,
    alpha: float,
    shards_per_partition: int,
) -> tuple[np.ndarray, ...]:
    """The split, cached (flwr-datasets takes about a second on MNIST) and kept read-only."""
    parts = PARTITIONERS.get(partitioner)(
        dataset,
        num_partitions=num_partitions,
        seed=seed,
        alpha=alpha,
        shards_per_partition=shards_per_partition,
    )
    for part in parts:
        part.flags.writeable = False
    return tuple(parts)


@cache
def partitioners() -> ModuleType:
    """``flwr_datasets.partitioner``. The package's own ``__init__`` also imports its
    visualisation and metrics modules (seaborn, scipy.stats, matplotlib: about 1.5 s of CPU in
    a fresh process, paid by every ``dpfl run`` and every Flower node's first message of a
    run), which a split never uses. Unless the package is imported already, the partitioners
    are imported beneath a stand-in for the package (its spec, not executed) that is removed
    right after: a later ``import flwr_datasets`` runs the package's ``__init__`` as usual and
    finds the same partitioner modules (another thread importing the package in that moment
    would see the stand-in; neither dpfl nor Flower's runtimes import it elsewhere). Should the
    partitioners ever need a name that only the package's ``__init__`` defines, the plain
    import is used."""
    package = "flwr_datasets"
    if package not in sys.modules and (spec := importlib.util.find_spec(package)) is not None:
        sys.modules[package] = importlib.util.module_from_spec(spec)
        try:
            return importlib.import_module(f"{package}.partitioner")
        except ImportError:
            pass
        finally:
            del sys.modules[package]
    return importlib.import_module(f"{package}.partitioner")


def _table(dataset: Dataset, *, labels: bool = False) -> hf.Dataset:
    import datasets as hf

    columns = {"index": np.arange(dataset.num_train, dtype=np.int64)}
    if labels:
        y = dataset.train_y.numpy()
        columns["label"] = (y > 0).astype(np.int64) if dataset.task == "binary" else y
    return hf.Dataset.from_dict(columns)


def _indices(table: hf.Dataset, partitioner: Partitioner) -> list[np.ndarray]:
    partitioner.dataset = table
    return [
        np.sort(partitioner.load_partition(i).with_format("numpy")[:]["index"].astype(np.int64))
        for i in range(partitioner.num_partitions)
    ]


@PARTITIONERS.register("iid")
def _iid(dataset: Dataset, *, num_partitions: int, seed: int, **_: object) -> list[np.ndarray]:
    iid = partitioners().IidPartitioner(num_partitions)
    return _indices(_table(dataset).shuffle(seed=seed), iid)


@PARTITIONERS.register("contiguous")
def _contiguous(dataset: Dataset, *, num_partitions: int, **_: object) -> list[np.ndarray]:
    return _indices(_table(dataset), partitioners().IidPartitioner(num_partitions))


@PARTITIONERS.register("dirichlet")
def _dirichlet(
    dataset: Dataset, *, num_partitions: int, seed: int, alpha: float, **_: object
) -> list[np.ndarray]:
    min_size = min(10, dataset.num_train // num_partitions)
    partitioner = partitioners().DirichletPartitioner(
        num_partitions,
        partition_by="label",
        alpha=float(alpha),
        seed=seed,
        self_balancing=False,
        min_partition_size=min_size,
    )
    try:
        with warnings.catch_warnings():  # its warning before it gives up: the error says it
            warnings.filterwarnings("ignore", "The specified min_partition_size")
            return _indices(_table(dataset, labels=True), partitioner)
    except ValueError:  # flwr-datasets gives up after 10 draws that leave a partition too small
        raise ConfigError(
            "num-partitions",
            f"{num_partitions} Dirichlet(alpha={alpha}) partitions of "
            f"{dataset.num_train} rows kept leaving a partition with fewer than "
            f"{min_size} rows; use fewer partitions or a larger alpha",
            allowed=f"1..{dataset.num_train}",
        ) from None


@PARTITIONERS.register("shards")
def _shards(
    dataset: Dataset, *, num_partitions: int, seed: int, shards_per_partition: int, **_: object
) -> list[np.ndarray]:
    if (
        isinstance(shards_per_partition, bool)
        or not isinstance(shards_per_partition, int)
        or not (1 <= shards_per_partition <= dataset.num_train // num_partitions)
    ):
        raise ConfigError(
            "shards-per-partition",
            f"{shards_per_partition!r} shards for each of {num_partitions} "
            f"partitions of {dataset.num_train} rows",
            allowed=f"1..{dataset.num_train // num_partitions}",
        )
    partitioner = partitioners().ShardPartitioner(
        num_partitions,
        partition_by="label",
        num_shards_per_partition=shards_per_partition,
        seed=seed,
    )
    return _indices(_table(dataset, labels=True), partitioner)


@PARTITIONERS.register("natural")
def _natural(dataset: Dataset, *, num_partitions: int, **_: object) -> list[np.ndarray]:
    parts = natural_partition(dataset)
    if parts is None:
        raise ConfigError(
            "partitioner",
            f"dataset {dataset.name!r} has no natural per-client split",
            allowed=[p for p in PARTITIONERS if p != "natural"],
        )
    if num_partitions != len(parts):
        raise ConfigError(
            "num-partitions",
            f"dataset {dataset.name!r} has {len(parts)} natural partitions, not {num_partitions}",
            allowed=str(len(parts)),
        )
    return parts
