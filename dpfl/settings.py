"""A run's typed settings: the common run-config keys, parsed once, in groups.

:class:`dpfl.runconfig.RunConfig` checks every key (:data:`dpfl.config.COMMON`, each
algorithm's and each calibration's) and builds these groups from the values, as it builds the
algorithm's hyperparameter dataclass; everything below it reads the groups' fields, never a
string key (Flower's ``PrivacyConfig``-style objects, one per concern). A field is its key with
``_`` for ``-`` (``num-server-rounds`` → ``RunSettings.num_server_rounds``); every common key
belongs to exactly one group (a test holds that).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from dpfl.config import Value

S = TypeVar("S")


@dataclass(frozen=True)
class RunSettings:
    """What runs and where its results go."""

    algorithm: str
    num_server_rounds: int
    seed: int
    engine_mode: str
    results_dir: str
    run_name: str
    checkpoint_every: int
    resume: bool
    round_timeout: float
    min_clients: int


@dataclass(frozen=True)
class DataSettings:
    """Which data, and how it is split over the clients."""

    dataset: str
    dataset_options: str
    partitioner: str
    num_partitions: int
    alpha: float
    shards_per_partition: int
    data_dir: str
    download: bool


@dataclass(frozen=True)
class ModelSettings:
    """The model, and how its per-sample values are computed."""

    model: str
    model_options: str
    device: str
    chunk_bytes: int
    nonconvex_reg: float


@dataclass(frozen=True)
class PrivacySettings:
    """The privacy target, its calibration and accounting, and the clients' public bound."""

    noise_multiplier: float
    epsilon: float
    delta: float
    accountant: str
    calibration: str
    calibration_rounds: int
    max_epsilon: float
    min_client_records: int
    secure_noise: bool

    @property
    def calibrated(self) -> bool:
        """Whether the noise is calibrated to ``epsilon`` (``noise-multiplier=-1``)."""
        return self.noise_multiplier < 0


@dataclass(frozen=True)
class SecureAggregationSettings:
    """SecAgg+ and the noise shares it carries."""

    secure_aggregation: bool
    distributed_noise: bool
    min_survivors: int


@dataclass(frozen=True)
class EvaluationSettings:
    """The server's evaluation, and the diagnostics that give up privacy against it."""

    eval_every: int
    non_private_diagnostics: bool
    eval_train: bool
    eval_norm_quantiles: bool


GROUPS: tuple[type, ...] = (RunSettings, DataSettings, ModelSettings, PrivacySettings,
                            SecureAggregationSettings, EvaluationSettings)


def key_of(field: dataclasses.Field[object]) -> str:
    """The run-config key a settings field is read from."""
    return field.name.replace("_", "-")


def keys_of(group: type) -> tuple[str, ...]:
    return tuple(key_of(f) for f in dataclasses.fields(group))


def build_group(group: type[S], values: Mapping[str, Value]) -> S:
    """``group`` from validated run-config ``values``."""
    return group(**{f.name: values[key_of(f)] for f in dataclasses.fields(group)})
