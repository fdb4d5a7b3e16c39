"""Engine modes: seconds per round of ``engine-mode="exact"`` against ``"fast"``.

The Table-1 workload of the Clip21 reproduction (E3, docs/reproductions.md): MNIST, the
784-256-10 MLP, 25 clients, batch 64, ε = 27 under the 'practice' calibration, one torch
thread (what each `dpfl reproduce` worker gets). The two modes alternate, ``--repeats`` times
each, in this one process; each pair's ratio is one measurement, so machine noise affects
both alike.

    .venv/bin/python benchmarks/bench_engine_modes.py [--quick] [--rows FILE]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Row, arguments, emit, ratios, scratch  # noqa: E402

from dpfl.engine import run  # noqa: E402
from dpfl.runconfig import RunConfig  # noqa: E402

BASE = {"dataset": "mnist", "model": "mlp", "partitioner": "iid", "num-partitions": 25,
        "batch-size": 64, "calibration": "practice", "epsilon": 27.0, "delta": 1e-3,
        "learning-rate": 0.1, "clip": 0.01}
OWN = {"clip-sgd": {}, "clip21-sgd2m": {"beta": 0.5, "beta-hat": 0.01},
       "dpsgd-gc": {"calibration": "accountant", "clip": 1.0}}


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    args = parser.parse_args()
    rounds, repeats = (10, 1) if args.quick else (30, 3)
    torch.set_num_threads(1)
    tmp = scratch("dpfl-bench-modes-")
    rows = []
    for algorithm, own in OWN.items():
        times: dict[str, list[float]] = {"exact": [], "fast": []}
        for repeat in range(repeats):
            for mode in times:
                config = {**BASE, **own, "algorithm": algorithm, "engine-mode": mode,
                          "num-server-rounds": rounds, "eval-every": rounds,
                          "results-dir": str(tmp), "run-name": f"{algorithm}-{mode}-{repeat}"}
                times[mode].append(run(RunConfig(config), echo=False)["seconds_per_round"])
        family = "prisma" if algorithm == "dpsgd-gc" else "clip21"
        workload = f"{algorithm}, MNIST MLP, 25 clients × batch 64, one thread"
        rows += [Row.of("engine modes", "exact ÷ fast, s/round", workload, family,
                        ratios(times["exact"], times["fast"]), "×"),
                 Row.of("engine modes", "fast s/round", workload, family, times["fast"], "s")]
    emit(rows, args.rows)


if __name__ == "__main__":
    main()
