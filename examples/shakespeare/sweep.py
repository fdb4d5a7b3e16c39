"""The experiment of README.md's "Experiment": four private algorithms against the non-private
run, each tuned on a grid of the same size on the validation split, then run with three fresh
seeds on the held-out speech.

    python sweep.py                       # runs what is not archived yet, writes the report
    python sweep.py --reuse results/runs.jsonl.gz --workers 2

The reproductions' lab (``dpfl_reproductions.lab.Lab``) runs the configurations in worker
processes, one torch thread each, names each run by a hash of its configuration, archives
every run as it finishes (``runs.jsonl.gz`` in the results folder) and reuses what it finds
there or in ``--reuse`` archives: a stopped sweep resumes, and the committed archive
regenerates the report without running anything. ``--smoke`` runs the same protocol on 4
roles for 2 rounds.
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

from data import shakespeare  # noqa: E402

from dpfl.config import parse_options  # noqa: E402
from dpfl.datasets.loading import data_folder  # noqa: E402
from dpfl_reproductions.lab import Lab, sweep_main  # noqa: E402

SETTING: dict[str, Any] = {
    "dataset": "data:shakespeare", "partitioner": "natural", "num-partitions": 180,
    "model": "model:char_attention", "num-server-rounds": 100, "batch-size": 16,
    "eval-every": 10}
PRIVATE: dict[str, Any] = {"epsilon": 8.0, "delta": 1e-5}
# method: its keys at README.md's commands, and the clip key its grid scales
METHODS: dict[str, tuple[dict[str, Any], str]] = {
    "DP-FedAvg": ({"algorithm": "dp-fedavg", "learning-rate": 3.0, "clip": 0.3,
                   "local-steps": 1, **PRIVATE}, "clip"),
    "DPSGD-GC": ({"algorithm": "dpsgd-gc", "learning-rate": 3.0, "clip": 0.3, **PRIVATE},
                 "clip"),
    "PriSMA": ({"algorithm": "prisma", "learning-rate": 0.3, "clip": 1.0, "clip-diff": 0.5,
                "gamma": 0.5, **PRIVATE}, "clip"),
    "Clip21-SGD2M+": ({"algorithm": "clip21-sgd2m-plus", "learning-rate": 10.0, "clip": 0.3,
                       "clip-inner": 0.1, "beta": 0.1, **PRIVATE}, "clip-inner"),
    "non-private": ({"algorithm": "dp-fedavg", "learning-rate": 3.0, "clip": 0.3,
                     "local-steps": 1, "noise-multiplier": 0}, "clip"),
}
SCALES = (1 / 3, 1.0, 3.0)  # of the learning rate and of the clip: 9 points per method
TUNING_SEED, SEEDS = 0, (1, 2, 3)
SMOKE = {"num-partitions": 4, "num-server-rounds": 2, "eval-every": 1,
         "dataset-options": "max_clients=4 max_samples_per_client=32 "
                            "max_test_samples_per_client=16"}


def grid(keys: dict[str, Any], clip: str) -> list[dict[str, Any]]:
    """The method's 9 tuning points: its learning rate and clip key times each scale."""
    return [{**keys, "learning-rate": keys["learning-rate"] * a, clip: keys[clip] * b}
            for a in SCALES for b in SCALES]


def configuration(keys: dict[str, Any], seed: int, validation: bool,
                  smoke: bool) -> dict[str, Any]:
    setting = {**SETTING, **(SMOKE if smoke else {})}
    options = " ".join(filter(None, [setting.pop("dataset-options", ""),
                                     "validation=true" if validation else ""]))
    return {**setting, **keys, "seed": seed,
            **({"dataset-options": options} if options else {})}


def unigram(seed: int, smoke: bool) -> float:
    """The test accuracy of always predicting the training windows' most frequent next
    character (a space)."""
    options = parse_options(configuration({}, seed, False, smoke).get("dataset-options", ""))
    data = shakespeare(data_dir=data_folder(None), seed=seed, **options)
    train_y, test_y = data["train_y"], data["test_y"]
    return float((test_y == np.bincount(train_y).argmax()).mean())


def sweep(lab: Lab) -> Path:
    chosen, tuned = {}, {}
    for name, (keys, clip) in METHODS.items():
        points = grid(keys, clip)
        runs = lab.run_many([configuration(p, TUNING_SEED, True, lab.smoke) for p in points])
        best = max(range(len(points)), key=lambda i: runs[i]["test_accuracy"])
        chosen[name], tuned[name] = (points[best], clip), runs[best]["test_accuracy"]
    finals = {name: lab.run_many([configuration(point, s, False, lab.smoke) for s in SEEDS])
              for name, (point, _) in chosen.items()}
    rows = []
    for name, runs in finals.items():
        accuracies = [r["test_accuracy"] for r in runs]
        point, clip = chosen[name]
        epsilon = max(r.get("epsilon_max") or 0.0 for r in runs)
        rows.append([name, f"{statistics.fmean(accuracies):.2%}",
                     f"{statistics.stdev(accuracies):.2%}",
                     " ".join(f"{a:.2%}" for a in accuracies),
                     f"{epsilon:.3f}" if epsilon else "∞",
                     f"learning-rate={point['learning-rate']:g} {clip}={point[clip]:g}",
                     f"{tuned[name]:.2%}"])
    baseline = [unigram(s, lab.smoke) for s in SEEDS]
    rows.append(["unigram (most frequent character)", f"{statistics.fmean(baseline):.2%}",
                 f"{statistics.stdev(baseline):.2%}", " ".join(f"{a:.2%}" for a in baseline),
                 "∞", "none", ""])
    lab.table("Next-character accuracy on the held-out speech at round "
              f"{configuration({}, 0, False, lab.smoke)['num-server-rounds']}, seeds "
              f"{', '.join(map(str, SEEDS))}",
              ["method", "mean", "std", "per seed", "ε (δ = 1e-5)", "chosen point",
               "validation accuracy of the chosen point (seed 0)"], rows)
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    for i, (name, runs) in enumerate(finals.items()):
        accuracies = [r["test_accuracy"] for r in runs]
        ax.plot([i] * len(accuracies), accuracies, "o", alpha=0.6)
        ax.plot([i - 0.2, i + 0.2], [statistics.fmean(accuracies)] * 2, "k-")
    ax.set_xticks(range(len(finals)), list(finals))
    ax.set_ylabel("test accuracy")
    lab.figure("accuracy", fig, "Each method's test accuracy at its chosen point: a dot per "
               "seed, the bar their mean.")
    return lab.write("Shakespeare by speaking role: private algorithms at ε = 8")


def main(argv: list[str] | None = None) -> int:
    return sweep_main(sweep, argv, description=__doc__.splitlines()[0],
                      results=HERE / "results", smoke="4 roles, 2 rounds")


if __name__ == "__main__":
    raise SystemExit(main())
