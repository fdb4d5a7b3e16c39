"""Engine vs `flwr run`: seconds per round and end to end, same configuration, same final model.

For one algorithm of every family: MNIST, the 784-256-10 MLP, 10 clients, batch 64, evaluation
at the last round only. ``flwr run`` (Ray simulation, one virtual SuperNode per client, through
``dpfl flower``'s launcher) and the engine (``dpfl run``, exact mode) run the same configuration
and seed, alternately, ``--repeats`` times; each pair's ratio is one measurement. Seconds per
round are the median of rounds 2..T-1 of the run's round records (the last evaluates); end to
end is the wall time of the whole command, start-up included. The final models must be bitwise
equal: the benchmark stops if they are not.

    .venv/bin/python benchmarks/bench_engine_vs_flower.py [--quick] [--rows FILE]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Row, arguments, emit, ratios, round_seconds, scratch  # noqa: E402

from dpfl.engine import run  # noqa: E402
from dpfl.launch import flwr_run  # noqa: E402
from dpfl.runconfig import RunConfig  # noqa: E402

FAMILIES = {"clip21": "clip21-sgd2m", "prisma": "dpsgd-gc", "adaptive": "adaptdp-fedavg",
            "quantile": "dp-fedavg-quantile", "scaffold": "dp-scaffold", "projected": "pcdp-sgd"}
QUICK = ("clip21", "prisma", "projected")
BASE = {"dataset": "mnist", "model": "mlp", "num-partitions": 10, "batch-size": 64,
        "epsilon": 8.0, "seed": 0}


def timed(folder: Path, name: str, config: dict, runtime: str) -> tuple[float, float]:
    """(median s/round of rounds 2..T-1, wall seconds) of ``config`` on ``runtime``."""
    values = {**config, "results-dir": str(folder), "run-name": name}
    started = time.perf_counter()
    if runtime == "flower":
        if flwr_run(values, flwr_home=folder / f"{name}-home", timeout=1800) != 0:
            raise SystemExit(f"flwr run of {name} failed")
    else:
        run(RunConfig(values), echo=False)
    wall = time.perf_counter() - started
    return statistics.median(round_seconds(folder / name)[1:-1]), wall


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    repeats, rounds = (1, 4) if args.quick else (args.repeats or 2, 8)
    folder = scratch("dpfl-bench-flower-")
    rows = []
    for family, algorithm in FAMILIES.items():
        if args.quick and family not in QUICK:
            continue
        config = {**BASE, "algorithm": algorithm, "num-server-rounds": rounds,
                  "eval-every": rounds}
        per_round: dict[str, list[float]] = {"flower": [], "engine": []}
        wall: dict[str, list[float]] = {"flower": [], "engine": []}
        for repeat in range(repeats):
            for runtime in ("flower", "engine"):
                r, w = timed(folder, f"{algorithm}-{runtime}-{repeat}", config, runtime)
                per_round[runtime].append(r)
                wall[runtime].append(w)
            models = [torch.load(folder / f"{algorithm}-{rt}-{repeat}" / "model.pt")
                      for rt in ("flower", "engine")]
            if not all(torch.equal(models[0][k], models[1][k]) for k in models[1]):
                raise SystemExit(f"{algorithm}: the engine's model differs from flwr run's")
        med = {k: statistics.median(v) for k, v in per_round.items()}
        workload = (f"{algorithm}, MNIST MLP, 10 clients × batch 64, {rounds} rounds "
                    f"(flwr run {med['flower']:.3f} s/round, engine {med['engine']:.4f}); "
                    f"final models bitwise equal")
        rows += [Row.of("engine vs flwr run", "flwr run ÷ engine, s/round", workload, family,
                        ratios(per_round["flower"], per_round["engine"]), "×"),
                 Row.of("engine vs flwr run", "flwr run ÷ engine, end to end", workload, family,
                        ratios(wall["flower"], wall["engine"]), "×")]
        print(rows[-2].markdown(), flush=True)
    print(f"(torch threads: {torch.get_num_threads()})")
    emit(rows, args.rows)


if __name__ == "__main__":
    main()
