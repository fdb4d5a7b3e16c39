"""Runs per hour on 2 cores: one run at a time against runs batched as one (dpfl.engine.many).

Two worker processes (one torch thread each, as `dpfl reproduce` runs a sweep) run the same
runs: one job per run, or one job per batch of runs (`run_many`, equal to the runs alone bit
for bit). Workloads: Clip21's E1 logistic regression on duke (4 clients, runs differing in seed
and step size, as E1's cells do) and the 784-256-10 MLP on MNIST (exact mode, 10 clients,
batch 64, runs differing in seed). The two candidates alternate (`interleaved`); each row is
the runs per hour of a candidate, and the ratio batched / one at a time.
"""

from __future__ import annotations

import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Row, arguments, emit, interleaved, ratios  # noqa: E402

from dpfl.engine import run, run_many  # noqa: E402
from dpfl_reproductions.clip21 import LOGREG_BASE, LOGREG_MODES  # noqa: E402
from dpfl_reproductions.lab import one_thread  # noqa: E402
from dpfl.runconfig import RunConfig  # noqa: E402

SECTION = "many runs"
WORKERS = 2


def logreg(rounds: int, runs: int) -> list[dict]:
    return [{**LOGREG_BASE, **LOGREG_MODES["mini-batch"], "algorithm": "clip21-sgd2m",
             "clip": 1e-2, "beta": 0.5, "num-server-rounds": rounds, "learning-rate": 2.0 ** k,
             "seed": s} for s in range(3) for k in range(runs // 3)]


def mlp(rounds: int, runs: int) -> list[dict]:
    return [{"dataset": "mnist", "model": "mlp", "algorithm": "clip21-sgd2m", "clip": 1e-2,
             "beta": 0.5, "beta-hat": 0.5, "learning-rate": 0.1, "num-partitions": 10,
             "batch-size": 64, "noise-multiplier": 0.1, "num-server-rounds": rounds,
             "eval-every": rounds, "seed": s} for s in range(runs)]


def job(runs: list[dict]) -> None:
    """One worker's job, on one torch thread: a run alone, or runs batched as one."""
    with one_thread():
        if len(runs) == 1:
            run(RunConfig(runs[0]), echo=False)
        else:
            run_many([RunConfig(v) for v in runs])


def sweep(pool: ProcessPoolExecutor, configs: list[dict], batch: int, where: Path) -> None:
    """Every run of ``configs`` on the pool, ``batch`` runs to a job (fresh results folders)."""
    folder = Path(tempfile.mkdtemp(dir=where))
    runs = [{**c, "results-dir": str(folder)} for c in configs]
    jobs = [runs[i:i + batch] for i in range(0, len(runs), batch)]
    for future in [pool.submit(job, chunk) for chunk in jobs]:
        future.result()


def main() -> None:
    args = arguments(__doc__ or "").parse_args()
    repeats = 2 if args.quick else 3
    workloads = {  # name: (configs, runs per batch job)
        "Clip21 E1 logistic regression, duke, 4 clients": (
            logreg(300 if args.quick else 2000, 12), 6),
        "MNIST MLP 784-256-10, 10 clients, batch 64": (mlp(5 if args.quick else 20, 4), 2),
    }
    rows = []
    with tempfile.TemporaryDirectory() as where, \
            ProcessPoolExecutor(max_workers=WORKERS) as pool:
        for name, (configs, batch) in workloads.items():
            times = interleaved({
                "one at a time": lambda: sweep(pool, configs, 1, Path(where)),
                "batched": lambda: sweep(pool, configs, batch, Path(where)),
            }, repeats)
            rounds = configs[0]["num-server-rounds"]
            workload = f"{name}, {len(configs)} runs of {rounds} rounds"
            for candidate, seconds in times.items():
                label = candidate if candidate == "one at a time" else f"batched ({batch} a job)"
                rows.append(Row.of(SECTION, f"runs per hour on {WORKERS} cores, {label}",
                                   workload, "clip21", [3600 * len(configs) / s for s in seconds],
                                   "runs/h"))
            rows.append(Row.of(SECTION, "batched / one at a time (runs per hour)", workload,
                               "clip21", ratios(times["one at a time"], times["batched"]), "×"))
    emit(rows, args.rows)


if __name__ == "__main__":
    main()
