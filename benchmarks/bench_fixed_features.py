"""The adaptive-clipping reproductions' workload: the engine against the batched simulator of
models linear in fixed features, per task.

For each task, P = 2, one torch thread: the engine's seconds per round over ``--rounds`` rounds of
``dpfl run`` at the level-3 point (DP-FedAvg and AdaptDP-FedAvg, the task's evaluation
schedule), and the simulator's seconds per configuration-round when the whole grid of one seed
(both methods, three levels, every grid point) runs as one batch for the same rounds. All in
this one process.

    .venv/bin/python benchmarks/bench_fixed_features.py [--tasks t2 t3] [--rounds 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import scratch  # noqa: E402

from dpfl.engine import run  # noqa: E402
from dpfl_reproductions.adaptive import LEVELS, METHODS, TASKS, config_of  # noqa: E402
from dpfl_reproductions.fixed_features import simulate  # noqa: E402
from dpfl_reproductions.selection import grid  # noqa: E402
from dpfl.runconfig import RunConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["t1", "t2", "t3"])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = scratch("dpfl-bench-ff-")
    print("| task | engine s/round DP-FedAvg / AdaptDP-FedAvg | batch | simulator s per "
          "configuration-round | speed-up |\n|---|---:|---:|---:|---:|")
    for name in args.tasks:
        task = TASKS[name]
        point = {"learning-rate": task.learning_rates[-1], "clip": task.clips[-1]}
        engine = []
        for method in METHODS:
            values = {**config_of(task, method, 3, point, 0, rounds=args.rounds),
                      "results-dir": str(tmp), "run-name": f"{name}-{method}"}
            engine.append(run(RunConfig(values), echo=False)["seconds_per_round"])
        batch = [config_of(task, m, lv, p, 0, rounds=args.rounds) for m in METHODS
                 for lv in LEVELS for p in grid(learning_rate=task.learning_rates,
                                                clip=task.clips)]
        simulate(batch[:1])  # features and data, once per federation
        started = time.perf_counter()
        simulate(batch)
        per = (time.perf_counter() - started) / (args.rounds * len(batch))
        mean = sum(engine) / len(engine)
        print(f"| {name} | {engine[0]:.4f} / {engine[1]:.4f} | {len(batch)} | {per:.4f} | "
              f"{mean / per:.1f}× |", flush=True)


if __name__ == "__main__":
    main()
