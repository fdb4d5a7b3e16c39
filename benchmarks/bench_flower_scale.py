"""Cohort SuperNodes: ``flwr run`` with many clients per round, on few SuperNodes or one each.

Workload: DPSGD-GC, MNIST with the logistic model (d = 7,850: the MLP's 203,530 make a round
of a thousand Flower messages too slow for this benchmark), iid over C clients (60 records
each at C = 1,000), batch 16, every client in every round, noise multiplier 1 set directly.
The same run goes through ``flwr run`` (Ray simulation, ``dpfl.launch.flwr_run``) twice:
on S cohort SuperNodes, each hosting a block of C/S clients (one message per node and
exchange, one batched client step for its block), and on C SuperNodes of one client each.
Seconds per round are the round driver's (``rounds.jsonl``: broadcast, replies, sum, server
step, ledger), the median of rounds 2..T-1 (the first builds every node's data cache, the
last evaluates). Both
final models must equal the engine's (``torch.equal``), which the benchmark checks.

    .venv/bin/python benchmarks/bench_flower_scale.py [--quick] [--rows FILE]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Row, arguments, emit, round_seconds, scratch  # noqa: E402

from dpfl.engine import run  # noqa: E402
from dpfl.launch import flwr_run  # noqa: E402
from dpfl.runconfig import RunConfig  # noqa: E402

SECTION = "scale"


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=None)
    parser.add_argument("--cohort-nodes", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    clients = args.clients or (100 if args.quick else 1_000)
    cohort = args.cohort_nodes or 10
    folder = scratch("dpfl-bench-flower-scale-")
    values = {"algorithm": "dpsgd-gc", "dataset": "mnist", "model": "logistic",
              "num-partitions": clients, "batch-size": 16, "noise-multiplier": 1.0,
              "clip": 1.0, "num-server-rounds": args.rounds, "seed": 0,
              "results-dir": str(folder)}
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    engine = torch.load(folder / "engine" / "model.pt")
    workload = f"dpsgd-gc, MNIST logistic, {clients:,} clients per round, batch 16"
    rows, times = [], {}
    for nodes in (cohort, clients):
        name = f"flower-{nodes}"
        code = flwr_run({**values, "run-name": name}, num_supernodes=nodes, timeout=3600)
        if code != 0:
            sys.exit(f"flwr run with {nodes} SuperNodes failed (exit status {code})")
        model = torch.load(folder / name / "model.pt")
        if not all(torch.equal(model[k], engine[k]) for k in engine):
            sys.exit(f"flwr run with {nodes} SuperNodes: the model differs from the engine's")
        hosted = f"{nodes:,} SuperNodes × {clients // nodes:,} clients"
        times[nodes] = round_seconds(folder / name)[1:-1]
        rows.append(Row.of(SECTION, f"flwr run s/round, {hosted}", workload, "prisma",
                           times[nodes], "s"))
    rows.append(Row.of(SECTION, f"one client per SuperNode ÷ {cohort} cohort SuperNodes, "
                       "s/round", workload, "prisma",
                       [a / b for a in times[clients] for b in times[cohort]], "×"))
    print(f"models equal to the engine's (torch.equal): {cohort} and {clients} SuperNodes")
    emit(rows, args.rows)


if __name__ == "__main__":
    main()
