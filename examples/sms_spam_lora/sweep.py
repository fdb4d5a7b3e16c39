"""README.md's experiment: DPSGD-GC fine-tuning MiniLM with LoRA against DPSGD-GC training a
linear head on the frozen encoder at ε = 1 and 8, with non-private LoRA as the reference; each
setting tuned on the same 9-point grid on the validation lines (a best point on the grid's edge
walked past it while that raises the validation accuracy), then run with three fresh seeds on
the test lines.

    python sweep.py --workers 2           # runs what is not archived yet, writes the report
    python sweep.py --reuse report/runs.jsonl.gz   # the report from the committed archive

The reproductions' lab (``dpfl_reproductions.lab.Lab``) runs the configurations in worker
processes, one torch thread each, names each run by a hash of its configuration, archives
every run as it finishes (``runs.jsonl.gz`` in the results folder) and reuses what it finds
there or in ``--reuse`` archives: a stopped sweep resumes where it stopped. ``--smoke`` runs
the same protocol on 200 lines for 2 rounds.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the lab's forked workers import data.py and model.py from here

from data import rows  # noqa: E402

from dpfl.datasets.loading import data_folder  # noqa: E402
from dpfl_reproductions.lab import Lab, sweep_main  # noqa: E402
from dpfl_reproductions.selection import Ranking, Runner, walk_past_edges  # noqa: E402

ROUNDS = 100
COMMON: dict[str, Any] = {
    "dataset": "data:sms_spam", "num-partitions": 10, "num-server-rounds": ROUNDS,
    "batch-size": 16, "delta": 1e-5, "algorithm": "dpsgd-gc"}
# setting: its model and privacy keys (README.md's commands)
SETTINGS: dict[str, dict[str, Any]] = {
    "LoRA, ε = 1": {"model": "model:minilm_lora", "epsilon": 1.0},
    "LoRA, ε = 8": {"model": "model:minilm_lora", "epsilon": 8.0},
    "LoRA, non-private": {"model": "model:minilm_lora", "noise-multiplier": 0},
    "head, ε = 1": {"model": "model:minilm_head", "epsilon": 1.0},
    "head, ε = 8": {"model": "model:minilm_head", "epsilon": 8.0},
}
GRID = [{"learning-rate": lr, "clip": clip} for lr in (1.0, 3.0, 10.0) for clip in (0.1, 0.3, 1.0)]
TUNING_SEED, SEEDS, SPLIT_SEED = 0, (1, 2, 3), 0
#: a best point on an edge of the grid steps past it, × or ÷ the grid's ratio of about 3, on the
#: axes where it sits at an end, while the validation accuracy rises: at most 2 steps
PAST_EDGE_FACTOR, PAST_EDGE_STEPS = 3.0, 2
#: the criterion: validation accuracy at the last round, ties broken by the lower loss (a
#: tuning run's "test" split is the validation lines)
VALIDATION = Ranking(lambda summary: summary["test_accuracy"], higher=True,
                     then=lambda summary: summary["test_loss"])
SMOKE = {"num-server-rounds": 2, "max_samples": 200, "max_test_samples": 20}


def configuration(keys: dict[str, Any], seed: int, *, validation: bool,
                  smoke: bool) -> dict[str, Any]:
    """A run: the tuning runs evaluate once, at the last round (the criterion); the seeds'
    every 20 rounds, for the curves."""
    rounds = SMOKE["num-server-rounds"] if smoke else ROUNDS
    options = [f"split_seed={SPLIT_SEED}", *(["validation=true"] if validation else []),
               *([f"max_samples={SMOKE['max_samples']}",
                  f"max_test_samples={SMOKE['max_test_samples']}"] if smoke else [])]
    return {**COMMON, **keys, "seed": seed, "num-server-rounds": rounds,
            "eval-every": rounds if validation else max(1, rounds // 5),
            "dataset-options": " ".join(options)}


def majority() -> float:
    """The test accuracy of always answering ham on the test lines of the split."""
    messages, _, test = rows(data_dir=data_folder(None), seed=SPLIT_SEED)
    return float((messages.labels[test] == 0).mean())


def curve(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """A run's evaluated rounds and their test accuracy (archived with its summary)."""
    evaluated = [r for r in records if "test_accuracy" in r]
    return {"rounds": [r["round"] for r in evaluated],
            "test_accuracy": [r["test_accuracy"] for r in evaluated]}


def sweep(lab: Lab) -> Path:
    ranked = {}  # setting: its grid points, best first by validation accuracy then loss
    for name, keys in SETTINGS.items():
        runs = lab.run_many([configuration({**keys, **p}, TUNING_SEED, validation=True,
                                           smoke=lab.smoke) for p in GRID])
        ranked[name] = sorted(zip(GRID, runs, strict=True),
                              key=lambda pr: VALIDATION.key([pr[1]]))
    past: list[tuple[str, dict[str, Any]]] = []  # every point tried past an edge, in order
    results: list[dict[str, Any]] = []  # and its run

    def config(name: str, point: dict[str, Any], seed: int) -> dict[str, Any]:
        past.append((name, point))
        return configuration({**SETTINGS[name], **point}, seed, validation=True, smoke=lab.smoke)

    def run_past(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        results.extend(lab.run_many(configs))
        return results[len(results) - len(configs):]

    walked = walk_past_edges(
        Runner(config, run_past), {name: (VALIDATION.value([order[0][1]]), order[0][0])
                                   for name, order in ranked.items()},
        dict.fromkeys(ranked, GRID), ("learning-rate", "clip"), (TUNING_SEED,), VALIDATION,
        factor=PAST_EDGE_FACTOR, limit=PAST_EDGE_STEPS)
    chosen = {name: (w.point, w.runs[0] if w.runs else ranked[name][0][1])
              for name, w in walked.items()}
    finals = {name: lab.run_many([configuration({**SETTINGS[name], **point}, s,
                                                validation=False, smoke=lab.smoke)
                                  for s in SEEDS], derive=curve)
              for name, (point, _) in chosen.items()}
    rows_ = []
    for name, runs in finals.items():
        accuracies = [r["test_accuracy"] for r in runs]
        losses = [r["test_loss"] for r in runs]
        point, tuned = chosen[name]
        where = ("past the grid" + (", still at an edge" if walked[name].edge else "")
                 if point not in GRID else "on the grid")
        epsilon = max(r.get("epsilon_max") or 0.0 for r in runs)
        rows_.append([name, f"{statistics.fmean(accuracies):.2%}",
                      f"{statistics.stdev(accuracies):.2%}",
                      " ".join(f"{a:.2%}" for a in accuracies),
                      f"{statistics.fmean(losses):.4f}", f"{epsilon:.3f}" if epsilon else "∞",
                      f"learning-rate={point['learning-rate']:.3g} clip={point['clip']:.3g} "
                      f"({where})", f"{tuned['test_accuracy']:.2%}"])
    rows_.append(["always ham (on the 1,125 test lines)", f"{majority():.2%}", "", "", "", "∞",
                  "none", ""])
    last = configuration({}, 0, validation=False, smoke=lab.smoke)["num-server-rounds"]
    lab.table(f"Test accuracy and loss at round {last} on the "
              f"{'smoke' if lab.smoke else '1,125'} test lines (split seed {SPLIT_SEED}), "
              f"seeds {', '.join(map(str, SEEDS))}",
              ["setting", "mean accuracy", "std", "per seed", "mean loss", "ε (δ = 1e-5)",
               "chosen point", "validation accuracy of the chosen point (seed 0)"], rows_)
    lab.table("Validation accuracy of every grid point (seed 0), by setting",
              ["setting", *[f"lr {p['learning-rate']:g}, clip {p['clip']:g}" for p in GRID]],
              [[name, *[f"{r['test_accuracy']:.2%}" for p, r in sorted(
                  order, key=lambda pr: GRID.index(pr[0]))]] for name, order in ranked.items()])
    lab.table(f"Steps past the grid's edge (seed 0, validation; × or ÷ {PAST_EDGE_FACTOR:g}, at "
              f"most {PAST_EDGE_STEPS} steps while the accuracy rises)",
              ["setting", "point", "validation accuracy"],
              [[name, f"lr {p['learning-rate']:.3g}, clip {p['clip']:.3g}",
                f"{r['test_accuracy']:.2%}"] for (name, p), r in sorted(
                  zip(past, results, strict=True), key=lambda pr: list(SETTINGS).index(pr[0][0]))]
              or [["none: every setting's best point is inside the grid", "", ""]])
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    for name, runs in finals.items():
        steps = runs[0]["derived"]["rounds"]
        curves = np.array([r["derived"]["test_accuracy"] for r in runs])
        ax.plot(steps, curves.mean(axis=0), "o-", label=name)
    ax.axhline(majority(), color="grey", linestyle=":", label="always ham")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.legend(fontsize="small")
    lab.figure("accuracy", fig, "Test accuracy against rounds at each setting's chosen point, "
               "the mean over the seeds; dotted: always answering ham.")
    return lab.write("SMS spam: MiniLM with LoRA under DPSGD-GC at ε = 1 and 8")


def main(argv: list[str] | None = None) -> int:
    return sweep_main(sweep, argv, description=__doc__.splitlines()[0],
                      results=HERE / "results", smoke="200 lines, 2 rounds")


if __name__ == "__main__":
    raise SystemExit(main())
