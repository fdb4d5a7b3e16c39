"""The PCDP-SGD paper's Fig. 3: normalised and adaptive clipping functions with and without
pre-projection (Sha, Liu, Liu, Chen, "PCDP-SGD: Improving the Convergence of Differentially
Private SGD via Projection in Advance", arXiv:2312.03792 v1, §6.3, Fig. 3): ``dpfl reproduce
pcdp clipping-functions``.

The paper replaces DP-SGD's per-sample clipping by DP-PSAC (Xia et al., AAAI 2023, r = 1e-4),
NSGD (Yang et al. 2022, r = 0.01) and Auto-S (Bu et al. 2022, r = 0.01), each with and without
pre-projection onto the public records' subspace (PCDP-SGD's step: φ applied to V Vᵀ g_i, the
noise projected), centralized, MNIST at σ = 22 (its ε = 0.31) and Fashion-MNIST at σ = 18
(ε = 0.38), 4 runs each, "the same learning rate γ"; it reports that without projection the
three hover around 50% and depend on r, and that pre-projection "significantly enhances" each
and narrows the gap between them. Here, in the protocol of the tuned federated tables
(:mod:`dpfl_reproductions.pcdp_tuned`):

* the setting is ``centralized-mnist`` / ``centralized-fmnist``'s (:mod:`dpfl_reproductions.pcdp`:
  10,000 private images, 100 public, the paper's CNN, 80 epochs of 40 steps of 250, the
  optimizer's ``code`` reading), ``clipping-function`` set, φ scaled by the clip c = 0.01 (the
  sensitivity the noise is calibrated for, c·σ: the functions' "threshold 1" with learning rate
  γ·c);
* each of the 6 variants (3 functions × with and without pre-projection) per dataset selects its
  learning rate from one grid (:data:`LEARNING_RATES`, the same budget for each) on a
  validation split of 5,000 images outside the private subset at seed 0, never the test set;
* the selected points run on seeds 1–3; per function, pre-projection's paired difference in test
  accuracy (PCDP-SGD − DP-SGD, seed by seed: a seed gives both the same data, public records
  and initial model) with its 95% t-interval decides "pre-projection enhances φ": confirmed
  when the interval lies above 0, refuted below, undecided across it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from dpfl_reproductions.lab import Lab
from dpfl_reproductions.pcdp import SETTINGS, Setting, config_of, interval
from dpfl_reproductions.registry import experiment
from dpfl_reproductions.selection import (
    LEVEL,
    Config,
    Runner,
    accuracy,
    best,
    command,
    decided,
    final_accuracy,
    mean_std,
    paired,
)

#: dataset: its setting and the paper's σ for Fig. 3
DATASETS: dict[str, tuple[Setting, float]] = {
    "mnist": (SETTINGS["centralized-mnist"], 22.0),
    "fashion-mnist": (SETTINGS["centralized-fmnist"], 18.0),
}
FUNCTIONS = ("psac", "nsgd", "auto-s")  # each at its own r, the paper's
LABEL = {"psac": "DP-PSAC", "nsgd": "NSGD", "auto-s": "Auto-S"}
PROJECTIONS = {"none": "dp-sgd", "pre-projection": "pcdp-sgd"}
LEARNING_RATES = (0.3, 1.0, 3.0)  # γ; the paper's γ = 1 in the middle
SELECTION_SEED, SEEDS = 0, (1, 2, 3)
NUM_VALIDATION = 5000
SMOKE = {"datasets": ("mnist",), "functions": ("auto-s",), "learning_rates": (1.0, 3.0),
         "seeds": (1, 2), "validation": 100}

Cell = tuple[str, str, str]  # (dataset, function, projection)


@dataclass(frozen=True)
class Plan:
    cells: tuple[Cell, ...]
    learning_rates: tuple[float, ...]
    seeds: tuple[int, ...]
    validation: int
    smoke: bool

    def config(self, cell: Cell, learning_rate: float, seed: int) -> Config:
        """``cell``'s run at ``learning_rate`` and ``seed``, with the validation split, its last
        round evaluated."""
        dataset, function, projection = cell
        setting, sigma = DATASETS[dataset]
        values = config_of(setting, PROJECTIONS[projection], sigma, seed, "code",
                           smoke=self.smoke, num_validation=self.validation)
        return {**values, "clipping-function": function, "learning-rate": learning_rate,
                "eval-every": values["num-server-rounds"]}


def plan_of(lab: Lab) -> Plan:
    """What ``--only`` leaves (``--smoke``: MNIST's Auto-S with and without pre-projection, two
    learning rates, two seeds, the pcdp experiments' smoke sizes)."""
    smoke = lab.smoke
    datasets = lab.restrict("dataset", SMOKE["datasets"] if smoke else list(DATASETS))
    functions = lab.restrict("function", SMOKE["functions"] if smoke else FUNCTIONS)
    projections = lab.restrict("projection", list(PROJECTIONS))
    seeds = lab.restrict("seed", SMOKE["seeds"] if smoke else SEEDS)
    return Plan(tuple((d, f, p) for d in datasets for f in functions for p in projections),
                SMOKE["learning_rates"] if smoke else LEARNING_RATES,
                tuple(int(s) for s in seeds), SMOKE["validation"] if smoke else NUM_VALIDATION,
                smoke)


@experiment("pcdp", "clipping-functions", "Fig. 3: DP-PSAC, NSGD and Auto-S clipping with and "
            "without pre-projection, each at its own learning rate selected on validation, "
            "centralized MNIST (σ = 22) and Fashion-MNIST (σ = 18)",
            axes=("dataset", "function", "projection", "seed"))
def clipping_functions(lab: Lab) -> str:
    plan = plan_of(lab)
    runner = Runner(plan.config, lab.run_many)
    runs = len(plan.cells) * (len(plan.learning_rates) + len(plan.seeds))
    print(f"pcdp/clipping-functions: {runs} runs ({len(plan.cells)} cells × "
          f"({len(plan.learning_rates)} learning rates + {len(plan.seeds)} seeds))", flush=True)
    jobs = [(cell, lr) for cell in plan.cells for lr in plan.learning_rates]
    selection: dict[Cell, dict[float, dict[str, Any]]] = {}
    for (cell, lr), (summary,) in zip(jobs, runner.runs(jobs, [SELECTION_SEED]), strict=True):
        selection.setdefault(cell, {})[lr] = summary
    chosen = {cell: best(((lr, [runs[lr]]) for lr in sorted(runs)), accuracy("validation"))
              for cell, runs in selection.items()}
    seeds = runner.on_seeds(chosen, plan.seeds)
    report(lab, plan, selection, chosen, seeds)
    return "PCDP-SGD paper, Fig. 3: clipping functions with and without pre-projection"


def report(lab: Lab, plan: Plan, selection: dict[Cell, dict[float, dict[str, Any]]],
           chosen: dict[Cell, float], seeds: dict[Cell, list[dict[str, Any]]]) -> None:
    lab.text(f"""
## Protocol

Centralized, the PCDP experiments' setting (10,000 private images, 100 public, the paper's CNN,
80 epochs of 40 steps of 250, the clip c = 0.01 scaling every φ); σ = 22 on MNIST and 18 on
Fashion-MNIST (noise multipliers fixed, as the paper's; ε below by the RDP accountant). Each
variant's learning rate is selected from {', '.join(f'{g:g}' for g in plan.learning_rates)} by
final validation accuracy ({plan.validation:,} images outside the private subset) at seed
{SELECTION_SEED}, the same {len(plan.learning_rates)} runs for each; the test set is read only by
seeds {', '.join(map(str, plan.seeds))}. Pre-projection is PCDP-SGD's step (φ applied to the
gradient projected onto the public records' 100-dimensional subspace, the noise projected);
without it, DP-SGD's.
""")
    rows = []
    for cell in plan.cells:
        dataset, function, projection = cell
        mean, std = mean_std([final_accuracy(s) for s in seeds[cell]])
        edge = " (edge)" if chosen[cell] in (min(plan.learning_rates),
                                             max(plan.learning_rates)) else ""
        rows.append([dataset, LABEL[function], projection, f"{chosen[cell]:g}{edge}",
                     f"{final_accuracy(selection[cell][chosen[cell]], 'validation'):.2f}",
                     f"{mean:.2f} ± {std:.2f}",
                     f"{statistics.fmean(float(s['epsilon_max']) for s in seeds[cell]):.3g}"])
    lab.table(f"Test accuracy (%), mean ± std over seeds {', '.join(map(str, plan.seeds))}, at "
              f"each variant's selected learning rate (edge: an end of the grid)",
              ["dataset", "function", "projection", "γ", "validation (seed 0)", "test", "ε"],
              rows)
    verdicts = []
    for dataset in dict.fromkeys(d for d, _, _ in plan.cells):
        for function in dict.fromkeys(f for d, f, _ in plan.cells if d == dataset):
            pair = [(dataset, function, p) for p in PROJECTIONS]
            if not all(c in seeds for c in pair):
                continue
            diff = paired([final_accuracy(s) for s in seeds[pair[1]]],
                          [final_accuracy(s) for s in seeds[pair[0]]])
            verdicts.append([dataset, LABEL[function], f"{diff.mean:+.2f}", interval(diff),
                             decided(diff)])
    lab.table(f"Does pre-projection enhance each clipping function? PCDP-SGD − DP-SGD in test "
              f"accuracy (points), paired by seed, {LEVEL:.0%} t-interval",
              ["dataset", "function", "mean difference", "interval", "verdict"], verdicts)
    first = plan.cells[0]
    lab.text(f"Rerun a cell alone, e.g. {LABEL[first[1]]} on {first[0]} ({first[2]}): "
             f"`{command(plan.config(first, chosen[first], plan.seeds[0]))}`")
