"""Which user-level mechanism at which ε, across devices: ``dpfl reproduce benchmark
cross-device``.

The matched-ε protocol of ``benchmark epsilon`` (:mod:`dpfl_reproductions.benchmark`: each
method's own 16 configurations by successive halving on a validation split, a full-length
confirmation, three fresh seeds, paired intervals against the best per ε) in the cross-device
regime: a population of clients too large to visit, a cohort of :data:`COHORT` drawn each round,
and a guarantee for each client's whole data (user-level, ε ∈ :data:`EPSILONS` at δ = 1/n).

* **data**: LEAF's synthetic task in its IID form (``leaf-synthetic`` with ``iid=true``: one
  model labels every client's samples; :mod:`dpfl.datasets.leaf_synthetic` says why the
  per-client models of Synthetic(α, β) leave a global model nothing to learn over a large
  population), each client's rows made when a round samples it (``lazy=true``), populations of
  10⁴ and 10⁶ (:data:`POPULATIONS`); validation on a tenth of the first 1,000 clients' samples,
  test on another tenth; the MLP (hidden 256, d = 18,186), batch 10, :data:`ROUNDS` rounds;
* **methods** (:data:`METHODS`): DP-FedAvg with a fixed clip (``dp-fedavg-user``) and with
  the adaptive quantile clip (``dp-fedavg-quantile``), both Poisson-sampled and amplified;
  DP-FTRL with tree noise and with banded noise over epochs (no amplification), and banded
  noise over Poisson-sampled groups (amplified banded MF); Clip21-SGD2M, whose clients noise
  their own messages (record-level), where its per-client state fits (10⁴ clients; refused
  over a lazy population); DP-SGD, the matched-ε benchmark's record-level reference (each
  client's record-level guarantee, a weaker unit than a user's);
* **the same search** for every method (:data:`GRIDS`), selected on validation at seed 0, then
  seeds 1–3 on the test samples (4–10 where three cannot separate a method from the best:
  :func:`~dpfl_reproductions.benchmark.seed_runs`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dpfl.config import format_options
from dpfl_reproductions import benchmark
from dpfl_reproductions.benchmark import (
    PROBES,
    SELECTION_SEED,
    Cell,
    Plan,
    Setting,
    run_protocol,
)
from dpfl_reproductions.lab import Lab
from dpfl_reproductions.registry import experiment
from dpfl_reproductions.selection import CONFIRMATION, Config, grid

EPSILONS = (1.0, 2.0, 4.0, 8.0)
#: the settings' names and population sizes
POPULATIONS: dict[str, int] = {"population-10k": 10_000, "population-1m": 1_000_000}
COHORT = 100  # expected clients a round
ROUNDS = 300
SEEDS = (1, 2, 3)
DATA = {"iid": True, "lazy": True, "validation_fraction": 0.1, "eval_clients": 1000}
COMMON: Config = {"dataset": "leaf-synthetic", "model": "mlp", "partitioner": "natural",
                  "batch-size": 10, "calibration": "accountant"}
#: method: its run-config keys (a variant of an algorithm is its keys, not a copy)
METHODS: dict[str, Config] = {
    "dp-fedavg-user": {"algorithm": "dp-fedavg-user"},
    "dp-fedavg-quantile": {"algorithm": "dp-fedavg-quantile"},
    "dp-ftrl-tree": {"algorithm": "dp-ftrl", "noise-correlation": "tree"},
    "dp-ftrl-banded": {"algorithm": "dp-ftrl", "noise-correlation": "banded"},
    "dp-ftrl-banded-poisson": {"algorithm": "dp-ftrl", "noise-correlation": "banded",
                               "client-sampling": "poisson"},
    "dp-ftrl-blt": {"algorithm": "dp-ftrl", "noise-correlation": "blt"},
    "clip21-sgd2m": {"algorithm": "clip21-sgd2m"},
    "dp-sgd": {"algorithm": "dp-sgd"},
}
#: methods whose clients keep state: run only where the population fits in memory, eagerly
STATEFUL = ("clip21-sgd2m",)
EAGER_UP_TO = 10_000
#: record-level methods: every client calibrated from the public lower bound of a client's
#: training records (LEAF's fewest samples, 50, less the held-out tenths), one noise for all
RECORD_LEVEL = ("clip21-sgd2m", "dp-sgd")
FEWEST_RECORDS = 41
_USER = {"learning-rate": (0.1, 0.3, 1.0, 3.0), "clip": (0.1, 0.3, 1.0, 3.0)}
GRIDS: dict[str, dict[str, tuple[float, ...]]] = {
    **{m: _USER for m in METHODS if m.startswith("dp-f")},
    "clip21-sgd2m": benchmark.GRIDS["clip21-sgd2m"],
    "dp-sgd": benchmark.GRIDS["dp-sgd"],
}
FAMILIES: dict[str, tuple[str, ...]] = {
    "DP-FedAvg (amplified by sampling)": ("dp-fedavg-user", "dp-fedavg-quantile"),
    "DP-FTRL (correlated noise)": ("dp-ftrl-tree", "dp-ftrl-banded", "dp-ftrl-banded-poisson",
                                   "dp-ftrl-blt"),
    "record-level": ("clip21-sgd2m", "dp-sgd"),
}
SMOKE = {"populations": {"population-200": 200}, "cohort": 20, "rounds": 8,
         "epsilons": (2.0, 8.0), "methods": ("dp-fedavg-user", "dp-ftrl-banded-poisson"),
         "seeds": (1, 2), "grid": {"learning-rate": (0.3, 3.0), "clip": (0.3, 3.0)}}


@dataclass(frozen=True)
class CrossDevicePlan(Plan):
    """The benchmark's plan over populations: ``settings`` name them, ``cohort`` clients are
    expected each round, and a stateful method runs only where the population is small enough
    to hold eagerly."""

    populations: tuple[tuple[str, int], ...] = ()
    cohort: int = COHORT

    def size(self, setting: Setting) -> int:
        return dict(self.populations)[setting.federation]

    def families(self) -> dict[str, tuple[str, ...]]:
        return FAMILIES

    def caption(self, setting: Setting) -> str:
        return f"δ = 1/{self.size(setting):,}"

    def cells(self) -> list[Cell]:
        return [cell for cell in super().cells()
                if cell[1] not in STATEFUL or self.size(cell[0]) <= EAGER_UP_TO]

    def points(self, algorithm: str) -> list[Config]:
        axes = SMOKE["grid"] if self.smoke else GRIDS[algorithm]
        return grid(**{k.replace("-", "_"): v for k, v in axes.items()})

    def config(self, cell: Cell, point: Config, seed: int, share: int = 1) -> Config:
        """``cell``'s run of ``point`` at ``seed``, stopped after a 1/``share`` of the rounds
        with the full-length run's noise, evaluated at its last round only."""
        setting, method, epsilon = cell
        n, rounds = self.size(setting), self.rounds // share
        lazy = method not in STATEFUL
        options = {**DATA, "num_clients": n, "lazy": lazy,
                   **({"eval_clients": min(n, DATA["eval_clients"])} if lazy else {})}
        return {**COMMON, **METHODS[method], "dataset-options": format_options(options),
                "num-partitions": n, "fraction-train": self.cohort / n, "epsilon": epsilon,
                "delta": 1.0 / n, "num-server-rounds": rounds, "calibration-rounds": self.rounds,
                "eval-every": rounds, "seed": seed,
                **({"min-client-records": FEWEST_RECORDS} if method in RECORD_LEVEL else {}),
                **point}


def plan_of(lab: Lab) -> CrossDevicePlan:
    """What ``--only`` leaves of the benchmark (``--smoke``: 200 clients, 20 a round, two
    methods, ε = 2 and 8, a 2 × 2 grid, 8 rounds)."""
    smoke = lab.smoke
    offered = SMOKE["populations"] if smoke else POPULATIONS
    names = lab.restrict("population", list(offered))
    methods = lab.restrict("method", SMOKE["methods"] if smoke else list(METHODS))
    epsilons = [float(e) for e in lab.restrict("epsilon", SMOKE["epsilons"] if smoke
                                                else EPSILONS)]
    seeds = [int(s) for s in lab.restrict("seed", SMOKE["seeds"] if smoke else SEEDS)]
    return CrossDevicePlan(
        settings=tuple(Setting("leaf-synthetic", name) for name in names),
        algorithms=tuple(methods), epsilons=tuple(epsilons), seeds=tuple(seeds),
        rounds=SMOKE["rounds"] if smoke else ROUNDS, validation=0, smoke=smoke,
        populations=tuple((name, offered[name]) for name in names),
        cohort=SMOKE["cohort"] if smoke else COHORT)


@experiment("benchmark", "cross-device", "Which user-level mechanism at which ε across devices: "
            "DP-FedAvg (fixed and adaptive clip), DP-FTRL (tree, banded, amplified banded) and "
            "record-level references over 10⁴ and 10⁶ clients, tuned alike",
            axes=("population", "method", "epsilon", "seed"))
def cross_device(lab: Lab) -> str:
    plan = plan_of(lab)
    report_protocol(lab, plan)
    run_protocol(lab, plan, "benchmark/cross-device")
    return "Which user-level mechanism at which ε across devices"


def report_protocol(lab: Lab, plan: CrossDevicePlan) -> None:
    sizes = ", ".join(f"{n:,} ({name})" for name, n in plan.populations)
    stateful = ", ".join(m for m in plan.algorithms if m in STATEFUL)
    lab.text(f"""
## Protocol

LEAF's synthetic task in its IID form (one model labels every client's samples) over
populations of {sizes} clients, each client's rows made when a round samples it; about
{plan.cohort} clients a round (`fraction-train` = {plan.cohort}/n), {plan.rounds} rounds, the
MLP, batch 10. User-level (ε, δ = 1/n) for the DP-FedAvg and DP-FTRL methods, record-level
(ε, δ = 1/n) per client for the record-level references, the noise calibrated by the RDP
accountant for the {plan.rounds}-round run. Each method's own {len(plan.points(
        plan.algorithms[0]))} configurations by successive halving on the validation samples of
the first 1,000 clients at seed {SELECTION_SEED} (a quarter of the rounds, the best 4 half,
the best 2 all; every proxy with the full-length run's noise), then a confirmation at full
length ({CONFIRMATION}) of those 2, the quarter rung's best 4 and the neighbouring ε's
points, which decides; then seeds {', '.join(map(str, plan.seeds))} on their test samples.
The cost estimate's probes run {PROBES[0]} and {PROBES[1]} rounds.
""" + (f"\n{stateful} keeps a state on every client: it runs only over populations of at most "
       f"{EAGER_UP_TO:,}, held in memory (a lazy population refuses it).\n" if stateful else ""))
