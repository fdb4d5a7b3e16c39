"""Cross-device scale: seconds per round and peak memory against the population, 10³ … 10⁶.

Workload: user-level DP-FedAvg (``dp-fedavg-user``, the server's noise, Poisson client
sampling at q = 1,000/n, so about 1,000 clients a round at every population; ε = 4 at
δ = 1/n over the 1,000 rounds it is calibrated for), LEAF's Synthetic(1, 1) task made lazily
(``leaf-synthetic`` with ``lazy=true``: each sampled client's rows made from its own stream in
the round that samples it; the test set is the first 1,000 clients' test rows), the logistic
model (d = 610), batch 10, one local step, evaluation only at the end. Each population runs in
its own process (its peak resident memory is that process's, ``ru_maxrss``), one torch
thread; a round is the round loop's whole round (its ``rounds.jsonl`` clock): the Poisson
draw, making the cohort's rows, the clients' steps, the server's noise, the ledger and the
record. The first round is not counted.

The claim measured: time and memory flat in the population, since a round touches the cohort
and the accounting keeps one history for the population.

    .venv/bin/python benchmarks/bench_population.py [--quick] [--rows FILE]
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Row, arguments, emit, parse, scratch  # noqa: E402

SECTION = "population"
SIZES = (1_000, 10_000, 100_000, 1_000_000)
COHORT = 1_000  # expected clients a round
ROUNDS, QUICK_ROUNDS = 30, 8
WORKLOAD = "dp-fedavg-user, lazy leaf-synthetic, logistic, ~1,000 clients a round"


def one(population: int, rounds: int, folder: Path) -> tuple[list[float], float]:
    """Round seconds (the first dropped) and peak resident MiB of one run, in this process."""
    import torch

    from dpfl.engine import run
    from dpfl.runconfig import RunConfig

    torch.set_num_threads(1)
    run(RunConfig({
        "algorithm": "dp-fedavg-user", "dataset": "leaf-synthetic", "model": "logistic",
        "dataset-options": f"num_clients={population} lazy=true", "partitioner": "natural",
        "num-partitions": population, "fraction-train": min(1.0, COHORT / population),
        "num-server-rounds": rounds, "calibration-rounds": 1_000, "epsilon": 4.0,
        "delta": 1.0 / population, "batch-size": 10, "local-steps": 1,
        "eval-every": rounds, "results-dir": str(folder), "run-name": f"n{population}"}),
        echo=False, plot=False)
    lines = (folder / f"n{population}" / "rounds.jsonl").read_text().splitlines()
    seconds = [json.loads(line)["seconds"] for line in lines][1:]
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":  # a child: one population
        seconds, peak = one(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
        print(json.dumps({"seconds": seconds, "peak": peak}))
        return
    args = parse(arguments(__doc__.splitlines()[0]))
    rounds = QUICK_ROUNDS if args.quick else ROUNDS
    folder = scratch("dpfl-bench-population-")
    rows = []
    for population in SIZES:
        done = subprocess.run([sys.executable, __file__, "--one", str(population), str(rounds),
                               str(folder)], capture_output=True, text=True, check=True)
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        label = f"{population:,} clients"
        rows.append(Row.of(SECTION, f"seconds per round, {label}", WORKLOAD, "user-level",
                           measured["seconds"], "s"))
        rows.append(Row.of(SECTION, f"peak memory, {label}", WORKLOAD, "user-level",
                           [measured["peak"]], "MiB", target="≤ 8 GiB",
                           limit=8 * 1024))
        print(f"{label}: median {statistics.median(measured['seconds']):.3f} s a round, "
              f"peak {measured['peak']:.0f} MiB", flush=True)
    emit(rows, args.rows)


if __name__ == "__main__":
    main()
