"""Everything a run needs, built from its configuration (the same on every runtime)."""

from __future__ import annotations

import functools
import inspect
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpfl.algorithms import ALGORITHMS, Algorithm, Cohort, check_schema
from dpfl.config import parse_overrides
from dpfl.datasets import DATASETS, Dataset, load_dataset, partition
from dpfl.datasets.loading import PROVIDED
from dpfl.errors import ConfigError
from dpfl.models import MODELS, FlatModel, build_model
from dpfl.privacy import Query, Release, Target, calibrate
from dpfl.runconfig import RunConfig

LOSS_OF_TASK = {"classification": "cross-entropy", "binary": "logistic", "regression": "squared"}


def data_dir(config: RunConfig) -> str:
    """``data-dir``, else ``$DPFL_DATA_DIR``, else a ``shared/data`` folder beside the source
    checkout (where the Makefile points ``DPFL_DATA_DIR``)."""
    if config["data-dir"]:
        return str(config["data-dir"])
    default = Path(__file__).resolve().parents[2] / "shared" / "data"
    return os.environ.get("DPFL_DATA_DIR", str(default))


def resolve_device(config: RunConfig) -> torch.device:
    name = str(config["device"])
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "CUDA is not available on this machine",
                          allowed="cpu, auto" + (", cuda" if torch.cuda.is_available() else ""))
    return torch.device(name)


@dataclass
class Problem:
    """Data, partition, model, algorithm and initial point of a run."""

    config: RunConfig
    dataset: Dataset
    partitions: list[np.ndarray]
    model: FlatModel
    algorithm: Algorithm
    x0: torch.Tensor
    device: torch.device
    _releases: dict[int, list[Release]] = field(default_factory=dict)
    _server: dict[str, list[Release]] = field(default_factory=dict)
    _cohorts: dict[tuple[int, ...], Cohort] = field(default_factory=dict)

    @property
    def num_clients(self) -> int:
        return len(self.partitions)

    def cohort(self, client_ids: list[int]) -> Cohort:
        """The given clients' data, holding only their own rows (cached per client set)."""
        key = tuple(client_ids)
        if key not in self._cohorts:
            self._cohorts[key] = self._gather(client_ids)
        return self._cohorts[key]

    def _gather(self, client_ids: list[int]) -> Cohort:
        rows = np.concatenate([self.partitions[c] for c in client_ids])
        x = self.dataset.train_x[torch.from_numpy(rows)]
        y = self.dataset.train_y[torch.from_numpy(rows)]
        offsets = np.cumsum([0] + [len(self.partitions[c]) for c in client_ids])
        indices = [torch.arange(offsets[i], offsets[i + 1]) for i in range(len(client_ids))]
        return Cohort(list(client_ids), x, y, indices)

    def full_cohort(self) -> Cohort:
        """All clients over the whole training set (the engine's view)."""
        return Cohort(list(range(self.num_clients)), self.dataset.train_x, self.dataset.train_y,
                      [torch.from_numpy(p) for p in self.partitions])

    def releases(self, client: int) -> list[Release]:
        """The calibrated mechanisms of one round of ``client`` (calibrated once per distinct
        data size: a client calibrates from its own record count)."""
        size = len(self.partitions[client])
        if size not in self._releases:
            queries = self.algorithm.queries(size)
            check_schema(self.algorithm, queries)
            self._releases[size] = self._calibrate(queries, size)
        return self._releases[size]

    def server_releases(self) -> list[Release]:
        """The calibrated mechanisms of the server's own noise in one round (client-level: its
        "records" are the clients)."""
        if "server" not in self._server:
            self._server["server"] = self._calibrate(self.algorithm.server_queries(),
                                                     self.num_clients)
        return self._server["server"]

    @functools.cached_property
    def exchange_rounds(self) -> Counter[str]:
        """How many of the run's rounds run each exchange."""
        return Counter(e.name for r in range(1, int(self.config["num-server-rounds"]) + 1)
                       for e in self.algorithm.round_exchanges(r))

    def _calibrate(self, queries: list[Query], num_samples: int) -> list[Release]:
        cfg = self.config
        steps = sum(q.steps * self.exchange_rounds[q.exchange] for q in queries)
        target = Target(epsilon=float(cfg["epsilon"]), delta=float(cfg["delta"]),
                        rounds=int(cfg["num-server-rounds"]), accountant=str(cfg["accountant"]),
                        num_samples=num_samples, steps=steps)
        return calibrate(self.algorithm, queries, target, calibration=str(cfg["calibration"]),
                         noise_multiplier=float(cfg["noise-multiplier"]),
                         options=cfg.calibration_options)


def options(config: RunConfig, key: str, kind: str, builder: Any) -> dict[str, object]:
    """The run-config key ``key`` (``model-options`` or ``dataset-options``) parsed
    (``key=value`` pairs, keys with ``_`` or ``-``) and checked against the keyword arguments
    of ``builder``, the selected ``kind``'s (a model builder or a dataset loader)."""
    text = str(config[key]).strip()
    if not text:
        return {}
    try:
        parsed = parse_overrides(text)
    except ConfigError as exc:
        raise ConfigError(key, f"cannot parse {text!r} (strings in double quotes)",
                          allowed="space-separated key=value pairs, e.g. "
                                  "'scaling=\"symmetric\" duplicate=3'") from exc
    given = {k.replace("-", "_"): v for k, v in parsed.items()}
    accepted = [p.name for p in inspect.signature(builder).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in PROVIDED]
    for name in given:
        if name not in accepted:
            raise ConfigError(key, f"{kind} {config[kind]!r} has no option {name!r}",
                              allowed=accepted or "none")
    return given


def dataset_of(config: RunConfig) -> Dataset:
    """The run's dataset (cached in-process); raises ConfigError where it is not available."""
    return load_dataset(str(config["dataset"]), seed=int(config["seed"]),
                        data_dir=data_dir(config), download=bool(config["download"]),
                        **options(config, "dataset-options", "dataset",
                                  DATASETS.get(str(config["dataset"]))))


def build_problem(config: RunConfig) -> Problem:
    """Load, partition and initialise; raises ConfigError on bad input."""
    device = resolve_device(config)
    dataset = dataset_of(config)
    parts = partition(dataset, partitioner=str(config["partitioner"]),
                      num_partitions=int(config["num-partitions"]), seed=int(config["seed"]),
                      alpha=float(config["alpha"]),
                      shards_per_partition=int(config["shards-per-partition"]))
    smallest = min(len(p) for p in parts)
    batch_size = config.hyperparameters.batch_size
    if batch_size > smallest:
        raise ConfigError("batch-size", f"{batch_size} exceeds the smallest client's "
                          f"{smallest} records", allowed=f"1..{smallest}")
    module = build_model(str(config["model"]), input_shape=dataset.input_shape,
                         num_classes=dataset.num_classes, seed=int(config["seed"]),
                         **options(config, "model-options", "model",
                                   MODELS.get(str(config["model"])))).to(device)
    model = FlatModel(module, LOSS_OF_TASK[dataset.task],
                      nonconvex_reg=float(config["nonconvex-reg"]))
    public = (None if dataset.public_y is None
              else (dataset.public_x.to(device), dataset.public_y.to(device)))
    algorithm = ALGORITHMS.get(str(config["algorithm"]))(config.hyperparameters, model,
                                                         num_clients=len(parts), public=public)
    algorithm.check_run(int(config["num-server-rounds"]))
    return Problem(config, dataset, parts, model, algorithm, model.initial_params().cpu(), device)


@functools.lru_cache(maxsize=4)
def cached_problem(items: tuple[tuple[str, object], ...]) -> Problem:
    """One Problem per configuration per process (Flower rebuilds ClientApps every round)."""
    return build_problem(RunConfig(dict(items)))
