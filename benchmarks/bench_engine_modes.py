"""Engine modes: seconds per round of ``engine-mode="exact"`` against ``"fast"``.

The Table-1 workload of the Clip21 reproduction (E3, docs/reproductions.md): MNIST, the
784-256-10 MLP, 25 clients, batch 64, ε = 27 under the 'practice' calibration, one torch
thread (what each `dpfl reproduce` worker gets). The two modes alternate, ``--repeats`` times
each, in this one process, and the ratio of their medians is reported, so machine noise
affects both alike.

    .venv/bin/python benchmarks/bench_engine_modes.py [--rounds 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfl.engine import run  # noqa: E402
from dpfl.runconfig import RunConfig  # noqa: E402

BASE = {"dataset": "mnist", "model": "mlp", "partitioner": "iid", "num-partitions": 25,
        "batch-size": 64, "calibration": "practice", "epsilon": 27.0, "delta": 1e-3,
        "learning-rate": 0.1, "clip": 0.01, "beta": 0.5, "beta-hat": 0.01}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="dpfl-bench-modes-"))
    print("| algorithm | exact s/round | fast s/round | speed-up |\n|---|---:|---:|---:|")
    for algorithm in ("clip-sgd", "clip21-sgd2m", "dpsgd-gc"):
        times: dict[str, list[float]] = {"exact": [], "fast": []}
        for repeat in range(args.repeats):
            for mode in times:
                config = {**BASE, "algorithm": algorithm, "engine-mode": mode,
                          "num-server-rounds": args.rounds, "eval-every": args.rounds,
                          "results-dir": str(tmp), "run-name": f"{algorithm}-{mode}-{repeat}"}
                if algorithm == "dpsgd-gc":
                    config.update({"calibration": "accountant", "clip": 1.0})
                times[mode].append(run(RunConfig(config), echo=False)["seconds_per_round"])
        exact, fast = (statistics.median(times[m]) for m in ("exact", "fast"))
        print(f"| {algorithm} | {exact:.4f} | {fast:.4f} | {exact / fast:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
