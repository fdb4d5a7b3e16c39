"""Every algorithm at its defaults: final test accuracy and loss (and the initial model's loss)
on each dataset, ε = 8, the in-process engine, written as a Markdown table.

    .venv/bin/python benchmarks/bench_defaults.py [--datasets digits mnist fashion-mnist]
        [--seeds 0 1 2] [--workers 2] [--out reports/defaults]

A run is ``dpfl run --run-config 'algorithm="X" dataset="Y" seed=S'``: everything else at its
default (10 IID clients, 30 rounds, ε = 8 calibrated by the RDP accountant, δ = 1e-5, and the
algorithm's own values of the "auto" keys, docs/defaults.md). The table gives the
mean over seeds; ``--out`` also keeps every run's numbers (``runs.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfl.algorithms import ALGORITHMS  # noqa: E402
from dpfl.config import format_overrides  # noqa: E402

DATASETS = ("digits", "mnist", "fashion-mnist")


def one(job: tuple[str, str, int, str]) -> dict:
    import torch

    from dpfl.engine import run
    from dpfl.runconfig import RunConfig

    algorithm, dataset, seed, folder = job
    torch.set_num_threads(1)
    config = RunConfig({"algorithm": algorithm, "dataset": dataset, "seed": seed,
                        "results-dir": folder})
    summary = run(config, echo=False)
    return {"algorithm": algorithm, "dataset": dataset, "seed": seed,
            "own_defaults": {k: config[k] for k in ALGORITHMS.get(algorithm).defaults},
            **{k: summary[k] for k in ("initial_test_loss", "test_loss", "test_accuracy",
                                       "epsilon_max", "wall_seconds", "warnings")}}


def cell(runs: list[dict]) -> str:
    accuracy = statistics.mean(100 * r["test_accuracy"] for r in runs)
    start = statistics.mean(r["initial_test_loss"] for r in runs)
    loss = statistics.mean(r["test_loss"] for r in runs)
    return f"{accuracy:.1f} ({start:.2f} → {loss:.3g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--algorithms", nargs="+", default=ALGORITHMS.names())
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    with (tempfile.TemporaryDirectory(prefix="dpfl-bench-defaults-") as folder,
          ProcessPoolExecutor(args.workers) as pool):
        runs = list(pool.map(one, [(a, d, s, folder) for a in args.algorithms
                                   for d in args.datasets for s in args.seeds]))
    wall = time.perf_counter() - started
    lines = [f"Test accuracy (%) after 30 rounds at the defaults, ε = 8 (δ = 1e-5, RDP), mean "
             f"over seed(s) {', '.join(map(str, args.seeds))}; in brackets the test loss of "
             f"the initial model → the final one. {len(runs)} runs, {wall / 60:.1f} min on "
             f"{args.workers} worker(s).", "",
             "| algorithm | its own defaults | " + " | ".join(args.datasets) + " |",
             "|---|---|" + "---|" * len(args.datasets)]
    for a in args.algorithms:
        mine = [r for r in runs if r["algorithm"] == a]
        cells = [cell([r for r in mine if r["dataset"] == d]) for d in args.datasets]
        own = format_overrides(mine[0]["own_defaults"]) or "(the fallbacks)"
        lines.append(f"| {a} | {own} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(table + "\n")
        (args.out / "runs.json").write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
