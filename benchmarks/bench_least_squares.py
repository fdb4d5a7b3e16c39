"""PriSMA's Figure 1 workload: one 32,000-round least-squares run in the vectorised simulator
against the engine, and the simulator's cost per configuration when configurations share a
batch.

M = 10 clients, d = 10, b = 0.1·N, one torch thread. The engine's seconds per round come from
``--engine-rounds`` rounds of ``dpfl run`` (evaluating only at the last), extrapolated to
32,000; the simulator runs the full 32,000 rounds of one configuration, then 100 rounds of
``--batch`` configurations at once. All in this one process.

    .venv/bin/python benchmarks/bench_least_squares.py [--sizes 2000 12000] [--batch 256]
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
from dpfl_reproductions import least_squares  # noqa: E402
from dpfl_reproductions.prisma import config_of  # noqa: E402
from dpfl.runconfig import RunConfig  # noqa: E402

POINT = {"learning-rate": 0.002, "clip": 5.0, "gamma": 0.02, "clip-diff": 0.005}
ROUNDS = 32_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 12000])
    parser.add_argument("--engine-rounds", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = scratch("dpfl-bench-ls-")
    fused = least_squares.compile_kernels()
    print(f"fused kernels: {fused}\n")
    print("| N | engine s/round | engine, 32,000 rounds (extrapolated) | simulator, 32,000 rounds "
          "| speed-up | simulator per configuration-round in a batch of "
          f"{args.batch} |\n|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        values = {**config_of("prisma", {**POINT, "num-server-rounds": ROUNDS}, size, 0),
                  "results-dir": str(tmp), "eval-train": False,
                  "non-private-diagnostics": False}
        short = {**values, "num-server-rounds": args.engine_rounds,
                 "eval-every": args.engine_rounds, "run-name": f"engine-{size}"}
        engine = run(RunConfig(short), echo=False)["seconds_per_round"]
        sweep = least_squares.LeastSquaresSweep(RunConfig(values))
        sweep.run([RunConfig({**values, "num-server-rounds": 20})])  # compile for one config
        started = time.perf_counter()
        sweep.run([RunConfig(values)])
        one = time.perf_counter() - started
        many = [RunConfig({**values, "num-server-rounds": 100,
                           "learning-rate": 0.001 * (1 + k % 9)}) for k in range(args.batch)]
        sweep.run(many[:2])  # compile for this shape before timing
        started = time.perf_counter()
        sweep.run(many)
        per = (time.perf_counter() - started) / (100 * args.batch)
        print(f"| {size} | {engine * 1e3:.2f} ms | {engine * ROUNDS:.0f} s | {one:.1f} s | "
              f"{engine * ROUNDS / one:.1f}× | {per * 1e6:.0f} µs |", flush=True)


if __name__ == "__main__":
    main()
