"""The adaptive-clipping paper's experiments (Fukami, Murata, Niwa, TMLR, §5 and App. E):
``dpfl reproduce adaptive t1|t2|t3|t4``.

Each task trains P = 2 clients (an iid equal split) with DP-FedAvg and AdaptDP-FedAvg at the
three noise levels of the paper's Table 1, given as its relative noise sizes
(``calibration="noise-size"``; T3/T4's printed AdaptDP σ_p = 0.093 is read as 0.0093), b = 100,
τ = 1, δ = 1e-4, over the paper's (clip, η) grid (C for DP-FedAvg, Ĝ for AdaptDP-FedAvg) and
2 seeds (the paper's ± are half-ranges of two runs). A cell (level, method) selects the grid
point with the lowest training loss (the lowest over the rounds of the full objective at x_r,
mean of the seeds), as Table 2 does; its test accuracy is the highest over the rounds.

* **t1** synthetic quadratic: n = 1500 per client, d = 100, (R, K) = (150, 20);
* **t2** UCI Bank Marketing: the whole ``bank-full.csv`` (n_p = 22,605), a frozen random layer of
  width 128, (R, K) = (100, 226);
* **t3** MNIST, **t4** Fashion-MNIST: 1500 training images per client (a stratified subset,
  pixels in [0, 1]), a frozen random layer of width 512, (R, K) = (1000, 15), evaluated every
  10 rounds; Table 3's grid is labelled (100, 15), so the report gives both the lowest loss over
  all rounds and over the first 100.

Then Table 4: P ∈ {2, 4, 6} (1500 records per client) at each cell's selected point, for t1, t3
and t4 (T3/T4 at (100, 15), as the table is labelled); Figure 1, the training loss of the
selected level-3 points per round; Figure 2, C_r and the non-private diagnostic τ_q of the
selected level-3 AdaptDP-FedAvg point per round (a rerun with ``eval-norm-quantiles``). The
training loss and τ_q need ``non-private-diagnostics`` (the server evaluates on the clients'
training data): reproductions only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import matplotlib.pyplot as plt

from dpfl_reproductions import fixed_features
from dpfl_reproductions.lab import Lab
from dpfl_reproductions.registry import experiment
from dpfl_reproductions.selection import (
    Config,
    Ranking,
    Runner,
    best,
    command,
    edge_axes,
    grid,
    paired,
    walk_past_edges,
)

METHODS = ("dp-fedavg", "adaptdp-fedavg")
LABEL = {"dp-fedavg": "DP-FedAvg", "adaptdp-fedavg": "AdaptDP-FedAvg"}
LEVELS = (1, 2, 3)
SEEDS = (0, 1)
#: fresh seeds on which each cell's final selection decides the claim, paired (the selection
#: saw only :data:`SEEDS`)
VERDICT_SEEDS = (2, 3, 4)
CLIENTS = (2, 4, 6)
PER_CLIENT = 1500
CURVE_POINTS = 100  # points of a loss / radius curve kept in the archive
EDGE_STEPS = 3  # steps past the paper's grid (an extension)
EDGE_FACTOR = 2.0
#: a cell's ranking: the lowest training loss over the rounds (mean of the seeds), lower first
LOSS = Ranking(lambda summary: summary["derived"]["min_train_loss"])
COMMON: Config = {"partitioner": "iid", "batch-size": 100, "delta": 1e-4,
                  "calibration": "noise-size", "non-private-diagnostics": True,
                  "eval-train": True}


@dataclass(frozen=True)
class Task:
    """One task of the paper: data and model keys, (R, K), grids, Table 1's noise, and the
    paper's revealed numbers (Tables 2–4; None where held back)."""

    name: str
    data: Config  # dataset and model keys; "{n}" in dataset-options is the training set size
    rounds: int
    local_steps: int
    learning_rates: tuple[float, ...]
    clips: tuple[float, ...]
    dp_noise: tuple[float, ...]  # σ_p of DP-FedAvg per level
    adapt_noise: tuple[tuple[float, float], ...]  # (σ_p, σ_p^C) of AdaptDP-FedAvg per level
    eval_every: int = 1
    table4_rounds: int | None = None  # (R of Table 4); None: the task is not in Table 4
    paper: dict[tuple[str, int], tuple[float, float | None, tuple[float, float]]] = field(
        default_factory=dict)  # (method, level) -> (loss, accuracy %, (clip, η))
    paper_grid: dict[tuple[float, float], tuple[float, ...]] = field(default_factory=dict)
    paper_clients: dict[int, tuple[float, ...]] = field(default_factory=dict)


def _mnist(name: str) -> Config:
    return {"dataset": name, "dataset-options": 'num_train={n} scaling="unit"',
            "model": "random-feature-mlp", "model-options": "hidden=512"}


TASKS = {
    "t1": Task("T1: synthetic quadratic",
               {"dataset": "quadratic", "dataset-options": "num-samples={n}",
                "model": "least-squares"},
               150, 20, (0.1, 0.3, 0.5), (0.5, 1.0, 3.0, 5.0), (0.003, 0.006, 0.01),
               ((0.0042, 0.00097), (0.0078, 0.0021), (0.012, 0.0043)), table4_rounds=150,
               paper={("dp-fedavg", 1): (6.73e-6, None, (0.5, 0.3)),
                      ("dp-fedavg", 2): (2.69e-5, None, (0.5, 0.3)),
                      ("dp-fedavg", 3): (7.62e-5, None, (0.5, 0.3)),
                      ("adaptdp-fedavg", 1): (3.34e-7, None, (1.0, 0.1)),
                      ("adaptdp-fedavg", 2): (3.81e-6, None, (3.0, 0.1)),
                      ("adaptdp-fedavg", 3): (1.82e-5, None, (3.0, 0.1))},
               paper_grid={  # Table 3: (η, clip) -> DP Lv.1–3, Adapt Lv.1–3
                   (0.1, 0.5): (3.88, 3.89, 3.91, 3.88, 3.92, 3.93),
                   (0.1, 1.0): (8.11e-6, 3.24e-5, 9.01e-5, 3.34e-7, 4.72e-6, 2.34e-5),
                   (0.1, 3.0): (6.77e-5, 2.71e-4, 7.53e-4, 5.02e-7, 3.81e-6, 1.82e-5),
                   (0.1, 5.0): (1.88e-4, 7.52e-4, 2.09e-3, 2.48e-6, 1.82e-5, 5.30e-5),
                   (0.3, 0.5): (6.73e-6, 2.69e-5, 7.62e-5, 4.29e-6, 9.13e-5, 1.14e-4),
                   (0.3, 1.0): (2.80e-5, 1.12e-4, 3.15e-4, 3.96e-6, 1.69e-4, 2.56e-4),
                   (0.3, 3.0): (2.52e-4, 1.01e-3, 2.83e-3, 3.69e-6, 1.66e-4, 2.49e-4),
                   (0.3, 5.0): (2.80e-3, 2.80e-3, 7.86e-3, 3.94e-6, 1.61e-4, 2.40e-4),
                   (0.5, 0.5): (1.36e-5, 5.44e-5, 1.61e-4, 1.37e-7, 1.77e-4, 2.27e-4),
                   (0.5, 1.0): (5.08e-5, 2.04e-4, 6.19e-4, 1.36e-5, 6.20e-4, 8.91e-4),
                   (0.5, 3.0): (4.57e-4, 1.84e-3, 5.59e-3, 1.18e-5, 6.80e-4, 1.09e-3),
                   (0.5, 5.0): (1.27e-3, 5.10e-3, 1.55e-2, 7.85e-6, 5.99e-4, 8.85e-4)},
               paper_clients={2: (6.73e-6, 2.69e-5, 7.62e-5, 3.34e-7, 3.81e-6, 1.82e-5),
                              4: (4.44e-6, 1.78e-5, 4.93e-5, 2.00e-7, 2.49e-6, 1.23e-5),
                              6: (3.05e-6, 1.22e-5, 3.38e-5, 1.39e-7, 1.72e-6, 7.76e-6)}),
    "t2": Task("T2: UCI Bank Marketing",
               {"dataset": "bank-marketing", "model": "random-feature-mlp",
                "model-options": "hidden=128"},
               100, 226, (0.01, 0.03, 0.1), (0.05, 0.1, 0.5), (0.006, 0.01, 0.03),
               ((0.0077, 0.0025), (0.0103, 0.0078), (0.0524, 0.010))),
    "t3": Task("T3: MNIST, random features", _mnist("mnist"),
               1000, 15, (0.1, 0.3), (0.05, 0.1, 0.5), (0.003, 0.006, 0.01),
               ((0.0041, 0.0011), (0.0093, 0.0021), (0.013, 0.0050)), eval_every=10,
               table4_rounds=100,
               paper={("dp-fedavg", 1): (4.84e-5, 61.50, (0.05, 0.3)),
                      ("dp-fedavg", 2): (5.57e-5, 64.75, (0.05, 0.3)),
                      ("dp-fedavg", 3): (4.06e-4, 57.35, (0.1, 0.1)),
                      ("adaptdp-fedavg", 1): (4.25e-5, 56.50, (0.05, 0.3)),
                      ("adaptdp-fedavg", 2): (4.38e-5, 59.00, (0.05, 0.3)),
                      ("adaptdp-fedavg", 3): (4.02e-5, 60.30, (0.05, 0.3))},
               paper_grid={
                   (0.1, 0.05): (6.91e-4, 5.96e-4, 5.62e-4, 4.49e-4, 3.49e-4, 5.70e-4),
                   (0.1, 0.1): (1.54e-1, 2.86e-4, 4.06e-4, 3.27e-4, 2.22e-4, 2.51e-4),
                   (0.1, 0.5): (7.80e-2, 7.98e-5, 1.28e-1, 2.63e-4, 2.03e-4, 9.16e-5),
                   (0.3, 0.05): (4.84e-5, 5.57e-5, 7.79e-4, 4.25e-5, 3.38e-5, 4.02e-5),
                   (0.3, 0.1): (4.57e-2, 3.10e-2, 9.31e-2, 4.30e-5, 3.97e-5, 4.96e-5),
                   (0.3, 0.5): (2.97e-3, 4.40e-4, 6.32e-2, 2.04e-4, 4.04e-5, 8.36e-5)},
               paper_clients={2: (4.84e-5, 5.57e-5, 4.06e-4, 4.25e-5, 3.38e-5, 4.02e-5),
                              4: (3.79e-5, 4.28e-5, 7.53e-5, 3.09e-5, 3.38e-5, 4.11e-5),
                              6: (4.28e-4, 1.99e-3, 4.29e-3, 1.19e-3, 1.60e-3, 4.51e-3)}),
    "t4": Task("T4: Fashion-MNIST, random features", _mnist("fashion-mnist"),
               1000, 15, (0.03, 0.1, 0.3), (0.05, 0.1, 0.5), (0.003, 0.006, 0.01),
               ((0.0041, 0.0011), (0.0093, 0.0021), (0.013, 0.0050)), eval_every=10,
               table4_rounds=100),
}
# Measured single-thread seconds at P = 2, evaluation included: per configuration-round in a
# simulator batch of the whole grid, and per round in the engine (DP-FedAvg, AdaptDP-FedAvg;
# the three reruns at level 3). The estimate printed before a sweep scales them with P and R.
SIMULATED_SECONDS = {"t1": 0.002, "t2": 0.032, "t3": 0.013, "t4": 0.013}
ENGINE_SECONDS = {"t1": (0.03, 0.04), "t2": (0.34, 0.5), "t3": (0.15, 0.2), "t4": (0.15, 0.2)}


def noise_of(task: Task, method: str, level: int) -> Config:
    if method == "dp-fedavg":
        return {"noise-size": task.dp_noise[level - 1]}
    sigma, statistic = task.adapt_noise[level - 1]
    return {"noise-size": sigma, "statistic-noise-size": statistic}


def config_of(task: Task, method: str, level: int, point: Config, seed: int, *,
              clients: int = 2, rounds: int | None = None, smoke: bool = False) -> Config:
    data = {k: v.replace("{n}", str((60 if smoke else PER_CLIENT) * clients))
            if isinstance(v, str) else v for k, v in task.data.items()}
    steps = 2 if smoke else task.local_steps
    return {**COMMON, **data, "algorithm": method, "num-partitions": clients,
            "num-server-rounds": rounds or (3 if smoke else task.rounds),
            "local-steps": steps, "batch-size": 20 if smoke else 100,
            "eval-every": 1 if smoke else task.eval_every, "seed": seed,
            **noise_of(task, method, level), **point}


def derive(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """What the report reads of a run's rounds: the lowest training loss (over all rounds and
    over the first 100), the highest test accuracy, the last ε by both accountants, and curves
    of the training loss, C_r and τ_q thinned to about CURVE_POINTS points."""
    evaluated = [r for r in rounds if r.get("train_loss_full") is not None]
    losses = [r["train_loss_full"] for r in evaluated]
    accuracy = [r["test_accuracy"] for r in evaluated if r.get("test_accuracy") is not None]
    stride = max(1, math.ceil(len(evaluated) / CURVE_POINTS))
    curve = [[r["round"], r["train_loss_full"], r["clip"]] for r in evaluated[::stride]]
    if evaluated and curve[-1][0] != evaluated[-1]["round"]:
        curve.append([evaluated[-1]["round"], evaluated[-1]["train_loss_full"],
                      evaluated[-1]["clip"]])
    return {
        "min_train_loss": _finite_min(losses),
        "min_train_loss_100": _finite_min([r["train_loss_full"] for r in evaluated
                                           if r["round"] <= 100]),
        "final_train_loss": losses[-1] if losses else math.nan,
        "max_test_accuracy": max(accuracy) if accuracy else None,
        "epsilon_by_accountant": rounds[-1].get("epsilon_by_accountant") if rounds else None,
        "curve": curve,
        "tau_q": [[r["round"], r["tau_q_nonprivate"]] for r in evaluated[::stride]
                  if "tau_q_nonprivate" in r],
    }


def _finite_min(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return min(finite) if finite else math.inf


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.3g}" if math.isfinite(value) else "diverged"


class Sweep:
    """The grid of one task at P = 2 and two seeds, and each cell's selection."""

    def __init__(self, lab: Lab, name: str, task: Task | None = None) -> None:
        self.lab = lab
        self.name = name
        self.task = task or TASKS[name]
        smoke = lab.smoke
        self.methods = lab.restrict("method", METHODS)
        self.levels = [int(v) for v in lab.restrict("level", (3,) if smoke else LEVELS)]
        rates, clips = self.task.learning_rates, self.task.clips
        self.points = grid(learning_rate=rates[-2:] if smoke else rates,
                           clip=clips[1:3] if smoke else clips)

    def config(self, method: str, level: int, point: Config, seed: int, **kwargs: Any) -> Config:
        return config_of(self.task, method, level, point, seed, smoke=self.lab.smoke, **kwargs)

    def estimate(self) -> float:
        """Single-thread seconds by the measured cost model: the grid and Table 4 in the
        simulator, the level-3 reruns in the engine."""
        rounds = 3 if self.lab.smoke else self.task.rounds
        per = SIMULATED_SECONDS[self.name]
        grid_seconds = per * rounds * len(self.methods) * len(self.levels) * len(
            self.points) * len(SEEDS)
        table4 = sum(per * p / 2 * (self.task.table4_rounds or 0) for p in CLIENTS[1:]
                     ) * len(self.methods) * len(self.levels) * len(SEEDS)
        reruns = rounds * (sum(ENGINE_SECONDS[self.name]) + ENGINE_SECONDS[self.name][1])
        return grid_seconds + table4 + reruns

    @property
    def runner(self) -> Runner:
        """A cell's (method, level) run of a point at a seed, in the simulator."""
        return Runner(lambda cell, point, seed: self.config(*cell, point, seed),
                      lambda configs: batched(self.lab, configs))

    def run(self) -> dict[tuple[str, int], tuple[Config, list[dict[str, Any]]]]:
        """Every grid point of every cell on both seeds; the selected point of each cell by
        :data:`LOSS` (the first in grid order of equal ones) with its runs' summaries."""
        jobs = [((m, lv), p) for m in self.methods for lv in self.levels for p in self.points]
        self.scores: dict[tuple[str, int], dict[tuple[float, float], list[dict]]] = {}
        measured: dict[tuple[str, int], list[tuple[tuple[Config, list[dict]], list[dict]]]] = {}
        for (cell, p), runs in zip(jobs, self.runner.runs(jobs, SEEDS), strict=True):
            self.scores.setdefault(cell, {})[(p["learning-rate"], p["clip"])] = runs
            measured.setdefault(cell, []).append(((p, runs), runs))
        return {cell: best(items, LOSS) for cell, items in measured.items()}

    def extend(self, chosen: dict[tuple[str, int], tuple[Config, list[dict[str, Any]]]]
               ) -> dict[tuple[str, int], tuple[Config, list[dict[str, Any]], bool]]:
        """Each cell's selection walked past the edge of the paper's grid on η and C (×/÷
        :data:`EDGE_FACTOR`, one axis at a time and both together: :func:`walk_past_edges`),
        both seeds, while the mean lowest training loss improves, at most EDGE_STEPS steps;
        per cell the point, its runs and whether it is still on the edge of what was
        searched."""
        walked = walk_past_edges(
            self.runner, {cell: (LOSS.value(runs), p) for cell, (p, runs) in chosen.items()},
            {cell: self.points for cell in chosen}, ("learning-rate", "clip"), SEEDS, LOSS,
            factor=EDGE_FACTOR, limit=1 if self.lab.smoke else EDGE_STEPS)
        return {cell: (w.point, w.runs or chosen[cell][1], w.edge) for cell, w in walked.items()}


def simulate(configs: list[Config]) -> list[dict[str, Any]]:
    """:func:`fixed_features.simulate` with each summary's :func:`derive` numbers (the
    evaluated rounds themselves are not kept)."""
    summaries = fixed_features.simulate(configs)
    for summary in summaries:
        summary["derived"] = derive(summary.pop("rounds"))
    return summaries


def batched(lab: Lab, configs: list[Config]) -> list[dict[str, Any]]:
    """``configs`` in the simulator, the configurations of one federation in one batch."""
    return lab.run_batched(configs, federation=fixed_features.federation, simulate=simulate)


def report_extension(lab: Lab, sweep: Sweep,
                     chosen: dict[tuple[str, int], tuple[Config, list[dict[str, Any]]]],
                     extended: dict[tuple[str, int], tuple[Config, list[dict[str, Any]], bool]]
                     ) -> None:
    rows, ratios = [], []
    for cell, (point, runs, edge) in extended.items():
        grid_point, grid_runs = chosen[cell]
        rows.append([f"Lv.{cell[1]}", LABEL[cell[0]],
                     f"{loss_cell(grid_runs)} at (C={grid_point['clip']:g}, "
                     f"η={grid_point['learning-rate']:g})",
                     f"{loss_cell(runs)} at (C={point['clip']:g}, η={point['learning-rate']:g})"
                     + (" still on the edge" if edge else ""), accuracy_cell(runs)])
    for level in sweep.levels:
        if all((m, level) in extended for m in METHODS):
            dp, adapt = (statistics.fmean(s["derived"]["min_train_loss"]
                                          for s in extended[(m, level)][1]) for m in METHODS)
            ratios.append(f"Lv.{level}: {dp / adapt:.3g}×")
    lab.table(f"Past the paper's grid (an extension): each cell's selection walked past the "
              f"grid's edge, one step (×/÷ {EDGE_FACTOR:g}) per axis at a time, while the "
              f"lowest training loss improves ({1 if lab.smoke else EDGE_STEPS} steps at most)",
              ["level", "method", "paper's grid", "extended", "test accuracy"], rows)
    if ratios:
        lab.text("DP-FedAvg / AdaptDP-FedAvg at the extended selections: " + "; ".join(ratios)
                 + ".")


def report_verdict(lab: Lab, sweep: Sweep,
                   extended: dict[tuple[str, int], tuple[Config, list[dict[str, Any]], bool]]
                   ) -> None:
    """The claim (AdaptDP-FedAvg reaches a lower training loss than DP-FedAvg) at each level,
    by the docs' rule: each method at its own final selection (the extended one), on
    :data:`VERDICT_SEEDS`, which no selection saw; per seed log10(DP-FedAvg's lowest training
    loss / AdaptDP-FedAvg's), its mean and 95% t-interval; confirmed where the interval lies
    above 0, refuted where below."""
    levels = [lv for lv in sweep.levels if all((m, lv) in extended for m in METHODS)]
    runs = sweep.runner.on_seeds({(m, lv): extended[(m, lv)][0] for lv in levels
                                  for m in METHODS}, VERDICT_SEEDS)
    rows = []
    for level in levels:
        losses = {m: [LOSS.metric(s) for s in runs[(m, level)]] for m in METHODS}
        cells = [loss_cell([{"derived": {"min_train_loss": v}} for v in losses[m]])
                 for m in METHODS]
        if not all(math.isfinite(v) and v > 0 for vs in losses.values() for v in vs):
            rows.append([f"Lv.{level}", *cells, "–", "undecided (a run diverged)"])
            continue
        result = paired(*([math.log10(v) for v in losses[m]] for m in METHODS))
        verdict = ("confirmed" if result.low > 0 else "refuted" if result.high < 0
                   else "undecided (interval contains 1×)")
        rows.append([f"Lv.{level}", *cells, f"{10 ** result.mean:.3g}× [{10 ** result.low:.3g}, "
                     f"{10 ** result.high:.3g}]", verdict])
    lab.table(f"Verdict: AdaptDP-FedAvg's training loss below DP-FedAvg's, each at its final "
              f"selection, on seeds {', '.join(map(str, VERDICT_SEEDS))} (not the selection's), "
              f"paired: DP-FedAvg / AdaptDP-FedAvg, mean and 95% interval of the per-seed ratio "
              f"(geometric)", ["level", "DP-FedAvg (mean ± half-range)",
                               "AdaptDP-FedAvg (mean ± half-range)", "ratio", "verdict"], rows)


def loss_cell(runs: list[dict[str, Any]], key: str = "min_train_loss") -> str:
    values = [s["derived"][key] for s in runs]
    mean = statistics.fmean(values)
    if not math.isfinite(mean):
        return "diverged"
    return f"{mean:.3g} ± {(max(values) - min(values)) / 2:.2g}"


def accuracy_cell(runs: list[dict[str, Any]]) -> str:
    values = [s["derived"]["max_test_accuracy"] for s in runs]
    if any(v is None for v in values):
        return "–"
    values = [100 * v for v in values]
    return f"{statistics.fmean(values):.2f} ± {(max(values) - min(values)) / 2:.2f}"


def reproduce(lab: Lab, name: str, task: Task | None = None) -> str:
    """Tables 2–4 and Figures 1–2 of task ``name`` (``task``: another specification of it, e.g.
    another model, in place of :data:`TASKS`'s)."""
    sweep = Sweep(lab, name, task)
    task = sweep.task
    estimate = sweep.estimate()
    print(f"adaptive/{name}: ≈ {estimate / 3600:.2f} h single-thread (the measured cost "
          f"model)", flush=True)
    lab.text(f"# {task.name}\n\nCost estimate before the sweep: {estimate / 3600:.2f} h "
             f"single-thread ({len(sweep.points)} grid points × {len(sweep.levels)} levels × "
             f"{len(sweep.methods)} methods × {len(SEEDS)} seeds"
             + (", then Table 4's P = 4 and 6)." if task.table4_rounds else ")."))
    chosen = sweep.run()
    report_table2(lab, sweep, chosen)
    report_grid(lab, sweep)
    if task.table4_rounds and len(sweep.methods) == 2:
        report_clients(lab, sweep, chosen)
    report_figures(lab, sweep, chosen)
    extended = sweep.extend(chosen)
    report_extension(lab, sweep, chosen, extended)
    report_verdict(lab, sweep, extended)
    return f"AdaptDP-FedAvg {task.name}"


def report_table2(lab: Lab, sweep: Sweep,
                  chosen: dict[tuple[str, int], tuple[Config, list[dict[str, Any]]]]) -> None:
    task = sweep.task
    long = task.table4_rounds is not None and task.table4_rounds < task.rounds
    rows = []
    for (method, level), (point, runs) in chosen.items():
        paper = task.paper.get((method, level))
        eps = runs[0]["derived"]["epsilon_by_accountant"] or {}
        edges = edge_axes(point, sweep.points)
        rows.append([f"Lv.{level}", LABEL[method], loss_cell(runs),
                     *([loss_cell(runs, "min_train_loss_100")] if long else []),
                     accuracy_cell(runs), f"(C={point['clip']:g}, η={point['learning-rate']:g})"
                     + (f" edge: {', '.join(edges)}" if edges else ""),
                     "–" if paper is None else f"{paper[0]:.3g}"
                     + ("" if paper[1] is None else f" / {paper[1]:.2f}")
                     + f" at (C={paper[2][0]:g}, η={paper[2][1]:g})",
                     " / ".join(f"{eps[a]:.3g}" for a in ("rdp-wor", "rdp") if a in eps)])
    lab.table(f"Table 2: lowest training loss (mean ± half-range of {len(SEEDS)} seeds) and "
              f"highest test accuracy (%) over the rounds at each cell's selected point",
              ["level", "method", f"train loss, R = {task.rounds}",
               *(["train loss, r ≤ 100"] if long else []), "test accuracy", "selected",
               "paper (loss / acc at selected)", "ε: paper's accountant / Opacus"], rows)
    ratios = []
    for level in sweep.levels:
        if all((m, level) in chosen for m in METHODS):
            dp, adapt = (statistics.fmean(s["derived"]["min_train_loss"]
                                          for s in chosen[(m, level)][1]) for m in METHODS)
            paper = [task.paper.get((m, level)) for m in METHODS]
            ratios.append((level, dp / adapt,
                           paper[0][0] / paper[1][0] if paper[0] and paper[1] else None))
    if ratios:
        wins = sum(ratio > 1 for _, ratio, _ in ratios)
        lab.text(f"AdaptDP-FedAvg's training loss below DP-FedAvg's: **{wins} of "
                 f"{len(ratios)} levels** (DP-FedAvg / AdaptDP-FedAvg: " + "; ".join(
                     f"Lv.{lv}: {r:.3g}×" + ("" if p is None else f" (paper {p:.3g}×)")
                     for lv, r, p in ratios) + ").")
    lab.text("Reruns of the selected points (seed 0):\n\n" + "\n".join(
        f"- Lv.{level}, {LABEL[method]}: `{command(sweep.config(method, level, point, 0))}`"
        for (method, level), (point, _) in chosen.items()))


def report_grid(lab: Lab, sweep: Sweep) -> None:
    task = sweep.task
    cells = [(m, lv) for m in METHODS for lv in LEVELS if (m, lv) in sweep.scores]
    rows = []
    for p in sweep.points:
        key = (p["learning-rate"], p["clip"])
        paper = task.paper_grid.get(key)
        rows.append([f"{key[0]:g}", f"{key[1]:g}", *[
            _fmt(statistics.fmean(s["derived"]["min_train_loss"] for s in sweep.scores[c][key]))
            + ("" if paper is None else
               f" ({_fmt(paper[(METHODS.index(c[0])) * 3 + c[1] - 1])})")
            for c in cells]])
    lab.table("Table 3: lowest training loss at every grid point (mean of the seeds; the "
              "paper's in brackets)", ["η", "C or Ĝ", *[f"{LABEL[m]} Lv.{lv}"
                                                        for m, lv in cells]], rows)


def report_clients(lab: Lab, sweep: Sweep,
                   chosen: dict[tuple[str, int], tuple[Config, list[dict[str, Any]]]]) -> None:
    task = sweep.task
    clients = CLIENTS[:2] if lab.smoke else CLIENTS
    rounds = 3 if lab.smoke else task.table4_rounds
    configs = {(cell, p): [sweep.config(*cell, point, s, clients=p, rounds=rounds)
                           for s in SEEDS]
               for cell, (point, _) in chosen.items() for p in clients}
    flat = [c for cs in configs.values() for c in cs]
    summaries = iter(batched(lab, flat))
    results = {k: [next(summaries) for _ in v] for k, v in configs.items()}
    cells = list(chosen)
    rows = []
    for p in clients:
        paper = task.paper_clients.get(p)
        rows.append([p, *[loss_cell(results[(c, p)]) + (
            "" if paper is None else f" ({paper[METHODS.index(c[0]) * 3 + c[1] - 1]:.3g})")
            for c in cells]])
    per_client = 60 if lab.smoke else PER_CLIENT
    lab.table(f"Table 4: lowest training loss against the number of clients P ({per_client} "
              f"records each, R = {rounds}, the P = 2 selections; the paper's in brackets)",
              ["P", *[f"{LABEL[m]} Lv.{lv}" for m, lv in cells]], rows)


def report_figures(lab: Lab, sweep: Sweep,
                   chosen: dict[tuple[str, int], tuple[Config, list[dict[str, Any]]]]) -> None:
    """Figure 1 (the simulator's loss curves at the level-3 selections, seed 0); the same two
    runs in the engine (each its `dpfl run` line: the simulator checked at full length, and the
    cost per round, Table 6); Figure 2 from a third engine run of AdaptDP-FedAvg's selection
    with the non-private τ_q diagnostic."""
    level = max(sweep.levels)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for method in sweep.methods:
        point, runs = chosen[(method, level)]
        curve = runs[0]["derived"]["curve"]
        ax.plot([c[0] for c in curve], [c[1] for c in curve], label=LABEL[method])
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("training loss of x_r")
    ax.legend()
    lab.figure(f"figure1-{sweep.name}", fig, f"Figure 1: training loss per round at the "
               f"selected Lv.{level} points (seed 0)")
    # engine-mode="exact" (the default) spelled out: a run of its own, not the simulated one
    engine = {m: {**sweep.config(m, level, chosen[(m, level)][0], 0), "engine-mode": "exact"}
              for m in sweep.methods}
    diagnosed = ({**engine["adaptdp-fedavg"], "eval-norm-quantiles": True}
                 if "adaptdp-fedavg" in engine else None)
    reruns = lab.run_many([*engine.values(), *([diagnosed] if diagnosed else [])],
                          derive=derive)
    rows = []
    for (method, config), summary in zip(engine.items(), reruns, strict=False):
        simulated = chosen[(method, level)][1][0]["derived"]["min_train_loss"]
        rows.append([LABEL[method], f"{summary['derived']['min_train_loss']:.6g}",
                     f"{simulated:.6g}", f"{summary['seconds_per_round']:.4f}"])
    lab.table(f"The Lv.{level} selections (seed 0) in the engine: lowest training loss against "
              f"the simulator's, and the cost per round (Table 6; one thread, evaluation "
              f"included)", ["method", "engine", "simulator", "s / round"], rows)
    if diagnosed is None:
        return
    point = chosen[("adaptdp-fedavg", level)][0]
    derived = reruns[-1]["derived"]
    curve, tau = derived["curve"], derived["tau_q"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot([c[0] for c in curve], [c[2] for c in curve])
    left.set_xlabel("round")
    left.set_ylabel("C_r")
    for q in (tau[0][1] if tau else {}):
        right.plot([t[0] for t in tau], [t[1][q] for t in tau], label=f"q = {q}")
    right.set_yscale("log")
    right.set_xlabel("round")
    right.set_ylabel("τ_q (non-private diagnostic)")
    right.legend()
    lab.figure(f"figure2-{sweep.name}", fig, f"Figure 2: C_r and τ_q per round, AdaptDP-FedAvg "
               f"at its selected Lv.{level} point (seed 0; τ_q is a non-private diagnostic)")
    final = tau[-1][1] if tau else {}
    lab.text(f"C_r: {_fmt(curve[0][2])} in round {curve[0][0]}, {_fmt(curve[-1][2])} in round "
             f"{curve[-1][0]} (Ĝ = {point['clip']:g}). τ_q at the last evaluated round: "
             + ", ".join(f"τ_{q} = {v:.3g}" for q, v in final.items()) + ".")


for _name, _task in TASKS.items():
    experiment("adaptive", _name, f"AdaptDP-FedAvg vs DP-FedAvg, {_task.name}: Tables 2–4, "
               f"Figures 1–2", axes=("method", "level"))(
        lambda lab, name=_name: reproduce(lab, name))
