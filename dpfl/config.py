"""The run configuration: every key, its type, default and allowed values.

One schema serves ``flwr run`` (``[tool.flwr.app.config]`` in pyproject.toml)
and ``dpfl run --run-config``. Validation happens here and nowhere else: an
unknown key, a value of the wrong type or out of range raises
:class:`~dpfl.errors.ConfigError` naming the key and what is allowed.
Algorithms add their own keys through :attr:`dpfl.algorithms.Algorithm.params`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from dpfl.errors import ConfigError

Value = bool | int | float | str


@dataclass(frozen=True)
class Param:
    """One run-config key.

    ``check`` returns a problem description, or ``None`` when the value is fine;
    ``choices`` lists the allowed values of a string key.
    """

    key: str
    default: Value
    help: str
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], str | None] | None = None
    symbol: str = ""

    @property
    def kind(self) -> type:
        return type(self.default)

    def parse(self, value: object) -> Value:
        kind = self.kind
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(
                self.key, f"expected {kind.__name__}, got {type(value).__name__} {value!r}"
            )
        if kind is float and math.isnan(value):
            raise ConfigError(self.key, "NaN is not allowed")
        if self.choices is not None and value not in self.choices:
            raise ConfigError(self.key, f"unknown value {value!r}", allowed=self.choices)
        if self.check is not None and (problem := self.check(value)) is not None:
            raise ConfigError(self.key, problem)
        return value


def positive(value: float) -> str | None:
    return None if value > 0 else f"must be > 0, got {value}"


def at_least(low: float) -> Callable[[float], str | None]:
    def check(value: float) -> str | None:
        return None if value >= low else f"must be >= {low}, got {value}"

    return check


def open_unit(value: float) -> str | None:
    return None if 0 < value < 1 else f"must be in (0, 1), got {value}"


def unit_interval(value: float) -> str | None:
    return None if 0 < value <= 1 else f"must be in (0, 1], got {value}"


def _names(registry_path: str) -> Callable[[], list[str]]:
    """Lazily list a registry's names (registries import heavy modules)."""

    def names() -> list[str]:
        module_name, attr = registry_path.rsplit(".", 1)
        module = __import__(module_name, fromlist=[attr])
        return getattr(module, attr).names()

    return names


COMMON: tuple[Param, ...] = (
    Param("algorithm", "dpsgd-gc", "Algorithm to run (see the algorithm table)."),
    Param("dataset", "digits", "Training/test data (see the dataset table)."),
    Param("model", "mlp", "Model architecture (see the model table)."),
    Param("partitioner", "iid", "How the training set is split over clients."),
    Param("alpha", 0.5, "Dirichlet concentration for partitioner=dirichlet.", check=positive),
    Param("shards-per-partition", 2, "Label shards per client for partitioner=shards.",
          check=at_least(1)),
    Param("num-partitions", 10, "Number of clients (data partitions).", check=at_least(1),
          symbol="M, n"),
    Param("num-server-rounds", 30, "Communication rounds.", check=at_least(1), symbol="T"),
    Param("batch-size", 32, "Per-client mini-batch size, sampled without replacement.",
          check=at_least(1), symbol="b"),
    Param("learning-rate", 2.0, "Server/client step size.", check=positive, symbol="η, γ"),
    Param("clip", 1.0, "Clipping threshold (max grad norm).", check=positive, symbol="C, τ"),
    Param("noise-multiplier", -1.0,
          "Noise std on the sum of clipped vectors divided by clip (Opacus convention); "
          "-1 = calibrate from epsilon/delta, 0 = no noise.",
          check=lambda v: None if v == -1.0 or v >= 0 else f"must be -1 or >= 0, got {v}",
          symbol="σ"),
    Param("epsilon", 8.0, "Target ε per client for calibration.", check=positive, symbol="ε"),
    Param("delta", 1e-5, "Target δ per client.", check=open_unit, symbol="δ"),
    Param("accountant", "rdp", "Opacus accountant used for calibration and the ledger.",
          choices=("rdp", "prv")),
    Param("calibration", "accountant",
          "How noise is calibrated when noise-multiplier=-1: 'accountant' (Opacus), "
          "'paper' (the paper's proven formula) or 'practice' (the formula the paper's "
          "experiments used); each algorithm lists the ones it supports.",
          choices=("accountant", "paper", "practice")),
    Param("max-epsilon", 0.0,
          "Stop the run before a round would take any client's ε above this; 0 = no stop.",
          check=at_least(0.0)),
    Param("secure-noise", False, "Seed noise and sampling from the OS CSPRNG (not reproducible)."),
    Param("seed", 0, "Run seed: data split, model init, sampling and noise.", check=at_least(0)),
    Param("device", "cpu", "Torch device for the algorithm math.", choices=("cpu", "cuda", "auto")),
    Param("engine-mode", "exact", "'exact': every client draws its own noise, bit for bit as "
          "under flwr run; 'fast' (dpfl run only, for sweeps): the noise of an average is drawn "
          "once, same distribution, different numbers.", choices=("exact", "fast")),
    Param("results-dir", "results", "Folder that receives <run-name>/ for this run."),
    Param("run-name", "", "Results sub-folder name; empty = <algorithm>-<dataset>-s<seed>-<time>."),
    Param("eval-every", 1, "Central evaluation every this many rounds (and the last).",
          check=at_least(1)),
    Param("eval-train", False, "Also evaluate the full training objective at evaluation "
          "rounds: its loss and gradient norm ‖∇F(x)‖."),
    Param("model-options", "", "Options of the model builder as key=value pairs, e.g. "
          "'bias=false zero_init=true' or 'hidden=512'."),
    Param("data-dir", "", "Folder of the offline datasets; empty = $DPFL_DATA_DIR."),
    Param("download", False, "Allow torchvision to download a dataset that is not on disk."),
    Param("nonconvex-reg", 0.0, "λ of the nonconvex regulariser (λ/2)Σx²/(1+x²) per sample.",
          check=at_least(0.0), symbol="λ"),
)


def all_params() -> dict[str, Param]:
    """Common keys plus every registered algorithm's own keys."""
    from dpfl.algorithms import ALGORITHMS

    params = {p.key: p for p in COMMON}
    for name in ALGORITHMS.names():
        for p in ALGORITHMS.get(name).params:
            if p.key in params and params[p.key] != p:
                raise ValueError(f"algorithm {name} redefines key {p.key}")
            params[p.key] = p
    return params


def defaults() -> dict[str, Value]:
    return {key: p.default for key, p in all_params().items()}


class RunConfig(Mapping[str, Value]):
    """A validated run configuration (read-only mapping of key to value)."""

    def __init__(self, values: Mapping[str, object] | None = None) -> None:
        params = all_params()
        merged: dict[str, Value] = {key: p.default for key, p in params.items()}
        for key, value in (values or {}).items():
            if key not in params:
                raise ConfigError(key, "unknown key", allowed="the keys listed in README.md")
            merged[key] = params[key].parse(value)
        self._values = merged
        self._check_choices()

    def _check_choices(self) -> None:
        from dpfl.algorithms import ALGORITHMS
        from dpfl.datasets import DATASETS, PARTITIONERS
        from dpfl.models import MODELS

        for key, registry in (("algorithm", ALGORITHMS), ("dataset", DATASETS),
                              ("model", MODELS), ("partitioner", PARTITIONERS)):
            registry.get(self._values[key])  # raises ConfigError with the allowed names
        algorithm = ALGORITHMS.get(self._values["algorithm"])
        if self._values["calibration"] not in algorithm.calibrations:
            raise ConfigError("calibration", f"{self._values['calibration']!r} is not offered "
                              f"by algorithm {algorithm.name!r}", allowed=algorithm.calibrations)

    def __getitem__(self, key: str) -> Value:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def replace(self, **changes: object) -> RunConfig:
        """A copy with some keys changed (keys given with ``_`` or ``-``)."""
        values: dict[str, object] = dict(self._values)
        values.update({key.replace("_", "-"): value for key, value in changes.items()})
        return RunConfig(values)

    def as_dict(self) -> dict[str, Value]:
        return dict(self._values)


def check_runtime(config: RunConfig, runtime: str) -> None:
    """Refuse settings the ``runtime`` ('engine' or 'flower') cannot honour."""
    if runtime != "engine" and config["engine-mode"] != "exact":
        raise ConfigError("engine-mode", f"{config['engine-mode']!r} is for the in-process "
                          "engine (dpfl run) only; under Flower every client adds its own noise",
                          ["exact"])


def parse_overrides(text: Iterable[str] | str) -> dict[str, Value]:
    """Parse ``"key=value key2=value2"`` exactly as ``flwr run --run-config`` does."""
    from flwr.common.config import parse_config_args

    items = [text] if isinstance(text, str) else list(text)
    try:
        return dict(parse_config_args(items))
    except Exception as exc:  # flwr raises ValueError/TOML errors on malformed input
        raise ConfigError("run-config", f"cannot parse {' '.join(items)!r}: {exc}",
                          allowed='space-separated key=value pairs, strings in "quotes"') from None
