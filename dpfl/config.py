"""The run configuration's vocabulary: keys, types, defaults and checks (a leaf module).

A run-config key is a :class:`Param`. The keys every run reads, whatever the algorithm, are
:data:`COMMON`. An algorithm's own keys are the fields of its frozen hyperparameter dataclass,
each declared with :func:`hyperparameter`; keys several algorithms share (:data:`BATCH_SIZE`,
:data:`LEARNING_RATE`, :data:`CLIP`) are defined here once. :class:`dpfl.runconfig.RunConfig`
assembles the whole schema from these pieces and the registries; this module knows no
algorithm.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shlex
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from dpfl.errors import ConfigError, did_you_mean

Value = bool | int | float | str
T = TypeVar("T")
AUTO = "auto"  # the run-config value of a per-algorithm key left to the algorithm
INT64 = 2**63  # an int key's values lie in [-INT64, INT64)
FLOAT32_TINY, FLOAT32_MAX = 2.0**-126, (2 - 2.0**-23) * 2.0**127  # float32's normal range
SEED_MAX = 2**32 - 1  # the largest seed every dataset loader accepts (scikit-learn's)
MAX_ROUNDS = 10_000_000  # a run's setup walks every round: seconds at this many, hours at 1e12
EPSILON_MAX = 1e6  # beyond it an ε protects nothing, and the accountants' search may not end
FOLDER_NAME = r'[^<>:"/\\|?*\x00-\x1f\x7f]+'  # one path component, portable


@dataclass(frozen=True)
class Param:
    """One run-config key.

    ``check`` returns a problem description, or ``None`` when the value is fine;
    ``choices`` lists the allowed values of a string key; ``symbol`` is the paper's. A
    ``per_algorithm`` key (a learning rate, a clip) defaults to :data:`AUTO`: the selected
    algorithm's own value (its ``defaults``), else ``default``. A float is finite unless the
    key's default is ``inf``, where inf means "none" (no server clip), and 0 or within
    float32's normal range (the runs compute in float32); an int fits 64 bits (a Flower
    ``ConfigRecord`` holds no more).
    """

    key: str
    default: Value
    help: str
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], str | None] | None = None
    symbol: str = ""
    per_algorithm: bool = False

    @property
    def kind(self) -> type:
        return type(self.default)

    @property
    def config_default(self) -> Value:
        """The value a run configuration holds when the key is not given."""
        return AUTO if self.per_algorithm else self.default

    def parse(self, value: object) -> Value:
        if self.per_algorithm and value == AUTO:
            return AUTO
        kind = self.kind
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(
                self.key, f"expected {kind.__name__}, got {type(value).__name__} {value!r}",
                allowed=f'a {kind.__name__}, or "{AUTO}" for the algorithm\'s own value'
                if self.per_algorithm else None)
        if kind is float and math.isnan(value):
            raise ConfigError(self.key, "NaN is not allowed")
        if kind is float and math.isinf(value) and not math.isinf(float(self.default)):
            raise ConfigError(self.key, f"must be a finite number, got {value}")
        if kind is float and math.isfinite(value) and value and not (
                FLOAT32_TINY <= abs(value) <= FLOAT32_MAX):
            raise ConfigError(self.key, f"{value} is outside float32's range, in which runs "
                              f"compute", allowed=f"0, or a magnitude in {FLOAT32_TINY:.4g}.."
                              f"{FLOAT32_MAX:.4g}")
        if kind is int and not -INT64 <= value < INT64:
            raise ConfigError(self.key, f"{value} does not fit a 64-bit integer")
        if self.choices is not None and value not in self.choices:
            raise ConfigError(self.key, f"unknown value {value!r}"
                              f"{did_you_mean(value, self.choices)}", allowed=self.choices)
        if self.check is not None and (problem := self.check(value)) is not None:
            raise ConfigError(self.key, problem)
        return value


def positive(value: float) -> str | None:
    return None if value > 0 else f"must be > 0, got {value}"


def at_least(low: float) -> Callable[[float], str | None]:
    def check(value: float) -> str | None:
        return None if value >= low else f"must be >= {low}, got {value}"

    return check


def at_most(high: float) -> Callable[[float], str | None]:
    def check(value: float) -> str | None:
        return None if value <= high else f"must be <= {high}, got {value}"

    return check


def all_of(*checks: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    """The first problem any of ``checks`` finds."""
    def check(value: Any) -> str | None:
        return next((p for c in checks if (p := c(value)) is not None), None)

    return check


def folder_name(value: str) -> str | None:
    """A plain folder name (or empty): one path component, portable, not ``.`` or ``..``."""
    if value == "" or (re.fullmatch(FOLDER_NAME, value) and value not in (".", "..")
                       and len(value.encode()) <= 255):
        return None
    return (f"must be a plain folder name (no path separators, '.', '..', control "
            f"characters or any of <>:\"|?*; at most 255 bytes), got {value!r}")


def not_empty(value: str) -> str | None:
    return None if value.strip() else "must name a folder (e.g. \"results\" or \".\")"


def open_unit(value: float) -> str | None:
    return None if 0 < value < 1 else f"must be in (0, 1), got {value}"


def unit_interval(value: float) -> str | None:
    return None if 0 < value <= 1 else f"must be in (0, 1], got {value}"


# ---- typed hyperparameters ----------------------------------------------------------------------

def hyperparameter(param: Param) -> Any:
    """A field of a frozen hyperparameter dataclass, read from the run-config key ``param``.

    A value an algorithm fixes (e.g. Clip21-SGD's β = 1) is a ``ClassVar`` of its dataclass
    instead: readable like a field, but not a key the algorithm accepts."""
    return dataclasses.field(default=param.default, metadata={"param": param})


def params_of(cls: type) -> tuple[Param, ...]:
    """The run-config keys of a hyperparameter dataclass, in field order."""
    return tuple(f.metadata["param"] for f in dataclasses.fields(cls))


def build(cls: type[T], values: Mapping[str, Value]) -> T:
    """``cls`` from validated run-config ``values`` (its ``__post_init__`` may raise
    :class:`ConfigError` for combinations of keys that do not go together)."""
    return cls(**{f.name: values[f.metadata["param"].key] for f in dataclasses.fields(cls)})


def values_of(hyperparameters: Any) -> dict[str, Value]:
    """The run-config keys and values of a hyperparameter dataclass instance (the inverse of
    :func:`build`)."""
    return {f.metadata["param"].key: getattr(hyperparameters, f.name)
            for f in dataclasses.fields(hyperparameters)}


# ---- keys --------------------------------------------------------------------------------------

BATCH_SIZE = Param("batch-size", 32, "Per-client mini-batch size, sampled without replacement.",
                   check=at_least(1), symbol="b")
LEARNING_RATE = Param("learning-rate", 2.0, "Server/client step size; \"auto\" = the "
                      "algorithm's default (`dpfl keys ALGORITHM` shows it).", check=positive,
                      symbol="η, γ", per_algorithm=True)
CLIP = Param("clip", 1.0, "Clipping threshold (max grad norm); \"auto\" = the algorithm's "
             "default.", check=positive, symbol="C, τ", per_algorithm=True)
CLIPPING_FUNCTION = Param("clipping-function", "flat", "Per-sample clipping function φ_C(g), "
                          "every one of norm at most C (the same sensitivity and noise): "
                          "'flat' min(1, C/‖g‖)·g, 'auto-s' (Bu et al.) and 'nsgd' (Yang et al.) "
                          "C·g/(‖g‖ + r), 'psac' (Xia et al.) C·g/(‖g‖ + r/(‖g‖ + r)).",
                          choices=("flat", "auto-s", "nsgd", "psac"), symbol="φ")
CLIPPING_STABILITY = Param("clipping-stability", 0.0, "Stability constant r of the clipping "
                           "function; 0 = the function's own (0.01 for auto-s and nsgd, 1e-4 "
                           "for psac); flat has none.",
                           check=lambda v: None if v == 0 or v >= 1e-12 else
                           f"must be 0 (the function's own r) or at least 1e-12, got {v}",
                           symbol="r")
FRACTION_TRAIN = Param("fraction-train", 1.0, "Fraction of clients sampled each round, "
                       "s = round(fraction·n) (at least 1), uniformly without replacement from "
                       "the server's stream.", check=unit_interval, symbol="s/n")

COMMON: tuple[Param, ...] = (
    Param("algorithm", "dpsgd-gc", "Algorithm to run (see the algorithm table)."),
    Param("dataset", "digits", "Training/test data (see the dataset table), or your own "
          "callable by reference, \"package.module:callable\" (docs/your-own-model.md)."),
    Param("model", "mlp", "Model architecture (see the model table), or your own builder by "
          "reference, \"package.module:callable\" (docs/your-own-model.md)."),
    Param("partitioner", "iid", "How the training set is split over clients."),
    Param("alpha", 0.5, "Dirichlet concentration for partitioner=dirichlet.", check=positive),
    Param("shards-per-partition", 2, "Label shards per client for partitioner=shards.",
          check=at_least(1)),
    Param("num-partitions", 10, "Number of clients (data partitions).", check=at_least(1),
          symbol="M, n"),
    Param("num-server-rounds", 30, "Communication rounds.",
          check=all_of(at_least(1), at_most(MAX_ROUNDS)), symbol="T"),
    Param("noise-multiplier", -1.0,
          "Noise std over the clip radius of one clipped vector, i.e. std on the sum of "
          "clipped vectors over the clip (Opacus convention); -1 = calibrate from "
          "epsilon/delta, 0 = no noise.",
          check=lambda v: None if v == -1.0 or v >= 0 else f"must be -1 or >= 0, got {v}",
          symbol="σ"),
    Param("epsilon", 8.0, "Target ε per client for calibration.",
          check=all_of(positive, at_most(EPSILON_MAX)), symbol="ε"),
    Param("delta", 1e-5, "Target δ per client.", check=open_unit, symbol="δ"),
    Param("accountant", "rdp", "Opacus accountant used for calibration and the ledger.",
          choices=("rdp", "prv")),
    Param("calibration", "accountant",
          "How noise is calibrated when noise-multiplier=-1: 'accountant' (Opacus), "
          "'paper' (the paper's proven formula), 'practice' (the formula the paper's "
          "experiments used) or 'noise-size' (the paper's own noise sizes, given directly); "
          "each algorithm lists the ones it offers."),
    Param("calibration-rounds", 0,
          "Calibrate the noise for this many rounds instead of num-server-rounds (0 = "
          "num-server-rounds; never fewer): a run stopped early by design, a search's short "
          "proxy, then carries the noise of the full-length run it stands for; the ledger "
          "charges the rounds that ran.",
          check=at_least(0)),
    Param("max-epsilon", 0.0,
          "Stop the run before a round would take any client's ε above this; 0 = no stop.",
          check=at_least(0.0)),
    Param("min-clients", 0,
          "Real federations: the fewest participants an exchange needs replies from to go on "
          "without the others (clients of a failed or offline SuperNode); 0 = every "
          "participant, so a lost reply stops the run. The engine loses no client.",
          check=at_least(0)),
    Param("min-client-records", 0,
          "A public lower bound on every client's record count: each client's noise is "
          "calibrated and charged as if it held this many records (its sample rate b/n is at "
          "most b/n_min, so its ε is at most the ledger's); a client holding fewer refuses. "
          "Needed by nodes that train on their own data (node config data-path), whose sizes "
          "the server never learns; 0 = each client's own partition size.",
          check=at_least(0), symbol="n_min"),
    Param("secure-aggregation", False,
          "The server sees only the sum of each exchange's uploads: each client's noised upload "
          "is quantised to integers (a grid from its release's radius and noise) and summed "
          "through Flower's SecAgg+ between the nodes (the engine emulates it, bit for bit). "
          "Only for algorithms whose every upload the runtime noises with a fixed radius."),
    Param("distributed-noise", False,
          "With secure-aggregation: split each client's noise over the clients of an exchange, "
          "whose sum holds the draws of at least min-survivors "
          "clients, so each draws std/√min-survivors and the sum carries the release's std. "
          "The run's ε holds against a server that follows the protocol; summary.json also "
          "gives the ε left where it reads one client's upload (epsilon_if_unmasked). Only "
          "for algorithms whose clients' noise never enters their later steps or state "
          "(docs/privacy.md)."),
    Param("min-survivors", 0,
          "distributed-noise: the fewest clients whose noise every released sum holds (an "
          "exchange left with fewer replies stops the run, releasing nothing); 0 = every "
          "participant of an exchange.", check=at_least(0), symbol="n_s"),
    Param("secure-noise", False, "Draw every noise sample, batch and client sample from the "
          "OS CSPRNG, with Opacus' floating-point mitigation (not reproducible; use it in "
          "deployment)."),
    Param("seed", 0, "Run seed: data split, model init, sampling and noise.",
          check=all_of(at_least(0), at_most(SEED_MAX))),
    Param("device", "cpu", "Torch device for the algorithm math.", choices=("cpu", "cuda", "auto")),
    Param("engine-mode", "exact", "'exact': every client draws its own noise, bit for bit as "
          "under flwr run; 'fast' (dpfl run only, for sweeps): the noise of an average is drawn "
          "once, same distribution, different numbers.", choices=("exact", "fast")),
    Param("results-dir", "results", "Folder that receives <run-name>/ for this run.",
          check=not_empty),
    Param("run-name", "", "Results sub-folder name, a plain folder name; empty = "
          "<algorithm>-<dataset>-s<seed>-<time>.", check=folder_name),
    Param("eval-every", 1, "Central evaluation every this many rounds (and the last).",
          check=at_least(1)),
    Param("non-private-diagnostics", False,
          "Let clients send their exact training loss and clipping statistics, and let the "
          "server evaluate on the clients' training data (eval-train): a diagnostic mode with "
          "no privacy guarantee against the server, which the summary and ledger state."),
    Param("eval-train", False, "Also evaluate the full training objective at evaluation "
          "rounds: its loss and gradient norm ‖∇F(x)‖ (needs non-private-diagnostics=true: "
          "the server reads the clients' training data)."),
    Param("eval-norm-quantiles", False, "Also record τ_q = Q_q(‖∇ℓ_z(x)‖²)/mean_z ‖∇ℓ_z(x)‖² over "
          "the whole training set at evaluation rounds, q = 0.5, 0.6, …, 1.0 (the quantile/mean "
          "ratio of the adaptive-clipping paper, Definition 1): a non-private diagnostic, not "
          "privacy-accounted (needs non-private-diagnostics=true)."),
    Param("model-options", "", "Options of the model builder as key=value pairs, e.g. "
          "'bias=false zero_init=true' or 'hidden=512'."),
    Param("dataset-options", "", "Options of the dataset loader as key=value pairs, e.g. "
          "'duplicate=3' (prisma-least-squares: each client's records repeated 3 times) or "
          "'num_validation=1000' (a validation split held out of the training rows, which the "
          "server evaluates beside the test set); \"auto\" = the algorithm's (e.g. "
          "'num_public=100' for the algorithms that project onto public records), else none.",
          per_algorithm=True),
    Param("data-dir", "", "Folder of the datasets; empty = $DPFL_DATA_DIR, else data/ in "
          "dpfl's per-user cache folder ($DPFL_CACHE_DIR, default ~/.cache/dpfl on Linux)."),
    Param("download", False, "Download MNIST, Fashion-MNIST or CIFAR-10 into the data folder "
          "when it does not hold them (once; the next runs read the files there). MNIST and "
          "Fashion-MNIST are downloaded on first use into dpfl's per-user cache anyway (no "
          "data-dir, no $DPFL_DATA_DIR); a folder you name is only read unless this is true."),
    Param("chunk-bytes", 0, "Byte budget for one chunk of per-sample values (activations "
          "autograd keeps, output gradients, per-sample gradients) in per-sample clipping: "
          "chunks shrink so that a step's memory stays near it whatever the batch size; "
          "0 = chunks of 256 samples. Changes only the rounding of sums, not the results' "
          "meaning.", check=at_least(0)),
    Param("nonconvex-reg", 0.0, "λ of the nonconvex regulariser (λ/2)Σx²/(1+x²) per sample.",
          check=at_least(0.0), symbol="λ"),
    Param("checkpoint-every", 0, "Write a checkpoint into the results folder every this many "
          "rounds and at the last one (resume=true, `dpfl run --resume FOLDER`, continues from "
          "it); under Flower each client also keeps its state in files on its own node. "
          "0 = never.", check=at_least(0)),
    Param("resume", False, "Continue the run in results-dir/run-name from its checkpoint "
          "(`dpfl run --resume FOLDER` sets it): the configuration must be the checkpoint's but "
          "for num-server-rounds, checkpoint-every and round-timeout."),
    Param("round-timeout", 3600.0, "Flower: seconds an exchange waits for its replies, with a "
          "line every 30 s saying how many are missing; a reply not in by then is lost, and "
          "min-clients decides whether the run goes on.", check=positive),
)


# ---- the command-line syntax -------------------------------------------------------------------

SYNTAX = ('space-separated key=value pairs, no spaces around "=", a string in "quotes", '
          'a number, true or false')
PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")  # flwr.common.config's own pattern


def parse_overrides(text: Iterable[str] | str) -> dict[str, Value]:
    """Parse ``"key=value key2=value2"`` as ``flwr run --run-config`` does (one item ending in
    ``.toml``: that file), but strictly: text that is not a ``key=value`` pair, a key without a
    value and a key given twice (in one item or over several) are refused, where Flower drops
    the text or lets the last value win; a value TOML cannot read names its key."""
    from dpfl.flower_internals import parse_config_args

    items = [text] if isinstance(text, str) else list(text)
    if not (len(items) == 1 and items[0].endswith(".toml")):
        seen: set[str] = set()
        for item in items:
            for key in _pairs(item):
                if key in seen:
                    raise ConfigError(key, "given twice", allowed="each key once")
                seen.add(key)
    try:
        return dict(parse_config_args(items))
    except Exception as exc:  # flwr raises ValueError/TOML errors on malformed input
        raise ConfigError("run-config", f"cannot parse {' '.join(items)!r}: {exc}",
                          allowed=SYNTAX) from None


def _pairs(item: str) -> list[str]:
    """The keys of ``item``'s ``key=value`` pairs (a table's flattened, ``a.b``), each pair
    checked: only whitespace lies between pairs, and TOML reads the pair."""
    keys: list[str] = []
    end = 0
    for match in PAIR.finditer(item):
        between = item[end:match.start()]
        if between.strip():
            _stray(between)
        if end and not between:
            _stray(match.group(0), "needs a space before it")
        try:
            keys += _flat_keys(tomllib.loads(f"{match.group(1)} = {match.group(2)}"))
        except tomllib.TOMLDecodeError:
            key, value = match.group(1).strip("\"'"), match.group(2)
            known = next((p for p in (*COMMON, BATCH_SIZE, LEARNING_RATE, CLIP, CLIPPING_FUNCTION,
                                      CLIPPING_STABILITY, FRACTION_TRAIN) if p.key == key), None)
            if known is not None and known.kind is not str:  # a word where a number belongs
                what = {bool: "true or false", int: "an integer"}.get(known.kind, "a number")
                example = str(known.default).lower() if known.kind is bool else known.default
                raise ConfigError(key, f"cannot read {match.group(0)!r}: {value!r} is not "
                                  f"{what}", allowed=f"{what}, e.g. {key}={example}" + (
                                      f', or {key}="{AUTO}"' if known.per_algorithm else "")
                                  ) from None
            if re.fullmatch(r"[A-Za-z_][\w.-]*", value):  # a bare word: a string needs quotes
                raise ConfigError(key, f"cannot read {match.group(0)!r}: a string value needs "
                                  f"quotes", allowed=f'{key}="{value}", quoted for the shell as '
                                  f"'{key}=\"{value}\"'") from None
            raise ConfigError(key, f"cannot read {match.group(0)!r}", allowed=SYNTAX) from None
        end = match.end()
    if item[end:].strip():
        _stray(item[end:])
    return keys


def _stray(text: str, problem: str = "is not a key=value pair") -> None:
    """Refuse ``text``, found where a ``key=value`` pair should be."""
    word = text.split()[0]
    if word.endswith("=") and word.strip("=\"'"):
        raise ConfigError(word.rstrip("=").strip("\"'"), "no value after '='", allowed=SYNTAX)
    raise ConfigError("run-config", f"{text.strip()!r} {problem}", allowed=SYNTAX)


def _flat_keys(table: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The keys of a TOML table as Flower flattens them (``a.b`` for ``a = {b = 1}``)."""
    return [key for name, value in table.items()
            for key in (_flat_keys(value, f"{prefix}{name}.") if isinstance(value, dict)
                        else [f"{prefix}{name}"])]


def format_overrides(values: Mapping[str, Value]) -> str:
    """``key=value`` pairs in the syntax ``flwr run --run-config`` parses: a string in double
    quotes, or in single quotes (a TOML literal string) when it holds a double quote."""
    def fmt(v: Value) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            if '"' not in v:
                return f'"{v}"'
            if "'" in v:
                raise ValueError(f"{v!r}: a run-config string holds one kind of quote at most")
            return f"'{v}'"
        return repr(v)

    return " ".join(f"{k}={fmt(v)}" for k, v in values.items())


def parse_options(text: str) -> dict[str, Value]:
    """The ``key=value`` pairs of ``model-options`` or ``dataset-options``: shell-like words,
    each value a number, ``true``/``false``, or a string (bare, ``"quoted"`` or ``'quoted'``,
    which a string with spaces needs). A bare word is its own string, so the options nest in a
    run-config string without escapes: ``dataset-options="num_train=3000 scaling=unit"``."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None
    parsed: dict[str, Value] = {}
    for word in words:
        key, sep, raw = word.partition("=")
        if not sep or not key:
            raise ValueError(f"{word!r} is not key=value")
        if key in parsed:
            raise ValueError(f"{key!r} is given twice")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        parsed[key] = value if isinstance(value, (bool, int, float)) else raw
    return parsed


def format_options(values: Mapping[str, Value]) -> str:
    """``values`` as :func:`parse_options` reads them: strings bare where a bare word reads back
    as the same string, else in double quotes."""
    def fmt(v: Value) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return v if re.fullmatch(r"[A-Za-z_][\w.:/-]*", v) and parse_options(f"k={v}")[
                "k"] == v else '"' + v + '"'
        return repr(v)

    return " ".join(f"{k}={fmt(v)}" for k, v in values.items())
