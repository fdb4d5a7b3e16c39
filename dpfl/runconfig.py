"""The run configuration: every key of a run, validated in one place.

One schema serves ``flwr run`` (``[tool.flwr.app.config]`` in pyproject.toml) and ``dpfl run
--run-config``: the common keys (:data:`dpfl.config.COMMON`), every registered algorithm's
hyperparameters and every registered calibration's options. Flower passes every key of
pyproject.toml, so the schema is the union; a key the selected algorithm (or calibration) does
not read is refused when it is set to anything but its default. Bad input raises
:class:`~dpfl.errors.ConfigError` naming the key and what is allowed. The selected algorithm's
typed hyperparameters are built here, and nowhere else.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dpfl.algorithms import ALGORITHMS, Algorithm
from dpfl.algorithms.tuned import points_of, tuned_value
from dpfl.config import AUTO, COMMON, Param, Value, build, params_of
from dpfl.datasets import DATASETS, PARTITIONERS
from dpfl.errors import ConfigError, did_you_mean
from dpfl.models import MODELS
from dpfl.privacy import CALIBRATIONS
from dpfl.reference import is_reference, resolve
from dpfl.registry import Registry
from dpfl.settings import (
    DataSettings,
    EvaluationSettings,
    ModelSettings,
    PrivacySettings,
    RunSettings,
    SecureAggregationSettings,
    build_group,
)

NOISE_KEYS = ("noise-multiplier", "epsilon", "calibration")  # what sets the noise

NAME_MAX = 255  # bytes in one file name (POSIX file systems)


def all_params() -> dict[str, Param]:
    """Every key: the common ones, then every algorithm's and every calibration's own."""
    params = {p.key: p for p in COMMON}
    owned = [(f"algorithm {name}", params_of(ALGORITHMS.get(name).Hyperparameters))
             for name in ALGORITHMS.names()]
    owned += [(f"calibration {c.name}", params_of(c.options))
              for c in CALIBRATIONS.all() if c.options is not None]
    for owner, keys in owned:
        for p in keys:
            if params.setdefault(p.key, p) != p:
                raise ValueError(f"{owner} redefines key {p.key}")
    return params


def defaults() -> dict[str, Value]:
    """What a run configuration holds for the keys not given (``"auto"`` for the per-algorithm
    keys): the ``[tool.flwr.app.config]`` table."""
    return {key: p.config_default for key, p in all_params().items()}


def algorithm_default(algorithm: type[Algorithm], param: Param, epsilon: float | None = None,
                      setting: tuple[str, str] = ("", "")) -> Value:
    """``algorithm``'s value of ``param`` when the run leaves it at its default: at the run's
    ``epsilon`` the benchmark's selected point (:mod:`dpfl.algorithms.tuned`) for its
    ``setting`` (dataset, partitioner) where it has one, else the algorithm's own default, else
    the key's."""
    if not param.per_algorithm:
        return param.default
    tuned = None if epsilon is None else tuned_value(algorithm.name, param.key, epsilon,
                                                     points_of(*setting))
    return tuned if tuned is not None else algorithm.defaults.get(param.key, param.default)


class RunConfig(Mapping[str, Value]):
    """A validated run configuration, parsed into typed settings (:mod:`dpfl.settings`).

    ``run``, ``data``, ``model``, ``privacy``, ``secure`` and ``evaluation`` are the common
    keys' groups; ``hyperparameters`` is the selected algorithm's frozen dataclass;
    ``calibration_options`` the selected calibration's (None when it has no keys of its own).
    The package reads those and nothing else; the read-only mapping of every key to its value
    is the flat form that travels (Flower's run config) and that a caller composes configs in.
    ``reads`` the keys the run reads (the common ones, the algorithm's and the calibration's);
    ``automatic`` the keys left at ``"auto"``, which hold the selected algorithm's values."""

    def __init__(self, values: Mapping[str, object] | None = None) -> None:
        params = all_params()
        given = dict(values or {})
        merged: dict[str, Value] = {key: p.config_default for key, p in params.items()}
        for key, value in given.items():
            if key not in params:
                raise ConfigError(key, "unknown key" + did_you_mean(key, params),
                                  allowed="the keys `dpfl keys` lists")
            merged[key] = params[key].parse(value)
        for key, registry in (("algorithm", ALGORITHMS), ("partitioner", PARTITIONERS)):
            registry.get(merged[key])  # raises ConfigError with the allowed names
        for key, registry in (("dataset", DATASETS), ("model", MODELS)):
            check_choice(key, registry, str(merged[key]))
        algorithm = ALGORITHMS.get(merged["algorithm"])
        calibration = CALIBRATIONS.get(str(merged["calibration"]), algorithm.name)
        own = params_of(algorithm.Hyperparameters)
        used = {p.key for p in COMMON} | {p.key for p in own}
        if calibration.options is not None:
            used |= {p.key for p in params_of(calibration.options)}
        if algorithm.noise_free:  # nothing to calibrate
            used -= set(NOISE_KEYS) | {p.key for c in CALIBRATIONS.all() if c.options is not None
                                       for p in params_of(c.options)}
        which = (f"algorithm {algorithm.name!r}, which adds no noise" if algorithm.noise_free
                 else f"algorithm {algorithm.name!r} with calibration {calibration.name!r}")
        for key in given:  # an unused key may be given at its default (or its fallback)
            if key not in used and merged[key] not in (params[key].config_default,
                                                       params[key].default):
                raise ConfigError(key, f"not used by {which}; leave it at its default "
                                  f"{params[key].config_default!r}",
                                  allowed="its own keys " + ", ".join(p.key for p in own))
        self.reads = frozenset(used)
        self.automatic = tuple(key for key, value in merged.items() if value == AUTO
                               and params[key].per_algorithm)
        # the ε the noise is calibrated to; a run that gives its noise multiplier has none
        target = float(merged["epsilon"]) if float(merged["noise-multiplier"]) < 0 else None
        for key in self.automatic:
            merged[key] = algorithm_default(algorithm, params[key], target,
                                            (str(merged["dataset"]), str(merged["partitioner"])))
        for key in ("eval-train", "eval-norm-quantiles"):
            if merged[key] and not merged["non-private-diagnostics"]:
                raise ConfigError(key, "the server would evaluate on the clients' training "
                                  "data: set non-private-diagnostics=true to allow it (the run "
                                  "then has no privacy guarantee against the server)",
                                  allowed="false")
        self._values = merged
        self.run = build_group(RunSettings, merged)
        self.data = build_group(DataSettings, merged)
        self.model = build_group(ModelSettings, merged)
        self.privacy = build_group(PrivacySettings, merged)
        self.secure = build_group(SecureAggregationSettings, merged)
        self.evaluation = build_group(EvaluationSettings, merged)
        self.hyperparameters: Any = build(algorithm.Hyperparameters, merged)
        self.calibration_options: Any = (None if calibration.options is None
                                         else build(calibration.options, merged))
        check_secure_aggregation(algorithm, self.hyperparameters, merged)

    def __getitem__(self, key: str) -> Value:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def replace(self, **changes: object) -> RunConfig:
        """A copy with some keys changed (keys given with ``_`` or ``-``); a key left at
        ``"auto"`` stays so (it follows a changed algorithm)."""
        values: dict[str, object] = dict(self._values)
        values.update({key: AUTO for key in self.automatic})
        values.update({key.replace("_", "-"): value for key, value in changes.items()})
        return RunConfig(values)

    def as_dict(self) -> dict[str, Value]:
        return dict(self._values)


def check_choice(key: str, registry: Registry[Any], value: str) -> None:
    """A ConfigError unless ``value`` of ``key`` (``model``, ``dataset``) is a registered name
    or a reference to a callable that imports (:func:`dpfl.reference.resolve`)."""
    if is_reference(value):
        resolve(key, value)
    elif value not in registry:
        names = ", ".join(registry.names())
        raise ConfigError(key, f"unknown value {value!r}{did_you_mean(value, registry)}",
                          allowed=f"{names}, or package.module:callable (your own)")


def check_secure_aggregation(algorithm: type[Algorithm], hp: Any,
                             values: Mapping[str, Value]) -> None:
    """Refuse ``secure-aggregation`` for an algorithm whose server cannot see only sums
    (:meth:`~dpfl.algorithms.Algorithm.secure_aggregation_refusal`), ``distributed-noise``
    without it, a ``min-survivors`` above the clients of an exchange, and ``min-survivors``
    without ``distributed-noise``."""
    survivors = int(values["min-survivors"])
    if values["distributed-noise"] and not values["secure-aggregation"]:
        raise ConfigError("distributed-noise", "each client would add a fraction of its noise "
                          "to an upload the server sees: it needs secure-aggregation=true",
                          allowed="false")
    if survivors and not values["distributed-noise"]:
        raise ConfigError("min-survivors", "is read only with distributed-noise=true",
                          allowed="0")
    if not values["secure-aggregation"]:
        return
    if values["non-private-diagnostics"]:
        raise ConfigError("non-private-diagnostics", "the clients' diagnostics would travel "
                          "beside the securely summed uploads, in clear", allowed="false")
    if (reason := algorithm.secure_aggregation_refusal(hp)) is not None:
        raise ConfigError("secure-aggregation", f"algorithm {algorithm.name!r} cannot have "
                          f"its uploads summed securely: {reason}", allowed="false")
    participants = algorithm.participants_per_round(hp, int(values["num-partitions"]))
    if participants < 2:
        raise ConfigError("secure-aggregation", f"{participants} client an exchange: the sum of "
                          f"one upload is that upload", allowed="false, or at least 2 clients "
                          "an exchange")
    if survivors > participants:
        raise ConfigError("min-survivors", f"{survivors} exceeds the {participants} clients of "
                          f"an exchange", allowed=f"0..{participants}")


def check_runtime(config: RunConfig, runtime: str) -> None:
    """Refuse settings the ``runtime`` ('engine' or 'flower') cannot honour, and a
    ``results-dir`` in which this process cannot create the run's folder (tried in its deepest
    existing folder, and undone: nothing is left behind)."""
    if runtime != "engine" and config.run.engine_mode != "exact":
        raise ConfigError("engine-mode", f"{config['engine-mode']!r} is for the in-process "
                          "engine (dpfl run) only; under Flower every client adds its own noise",
                          ["exact"])
    if config.secure.secure_aggregation and config.run.engine_mode != "exact":
        raise ConfigError("engine-mode", "secure aggregation quantises each client's noised "
                          "upload, so every client draws its own noise", ["exact"])
    folder = Path(config.run.results_dir).expanduser()
    try:
        if any(len(os.fsencode(part)) > NAME_MAX for part in folder.parts):
            raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not existing.is_dir():
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        # what the run will do below it, in a folder of its own: concurrent runs that share
        # results-dir never see each other's check
        os.rmdir(tempfile.mkdtemp(dir=existing))
    except OSError as exc:
        raise ConfigError("results-dir", f"cannot create a folder in {str(folder)!r}: "
                          f"{exc.strerror}", allowed="a folder this user can write") from None
    run = folder / config.run.run_name
    if config.run.run_name and run.exists() and not run.is_dir():
        raise ConfigError("run-name", f"{str(run)!r} is a file", allowed="a new name")
