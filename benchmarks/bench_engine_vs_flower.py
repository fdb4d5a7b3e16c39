"""Engine vs `flwr run`: seconds per round for the same run, and whether the models agree.

DPSGD-GC, 10 clients, the 784-256-10 MLP on MNIST, batch 64.
Both runtimes run the same configuration and seed in this one process tree; the
ratio is taken from this single run, so machine noise affects both alike.

    .venv/bin/python benchmarks/bench_engine_vs_flower.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfl.engine import run  # noqa: E402
from dpfl.launch import flwr_run  # noqa: E402
from dpfl.runconfig import RunConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dpfl-bench-"))
    config = {"algorithm": "dpsgd-gc", "dataset": "mnist", "model": "mlp", "num-partitions": 10,
              "batch-size": 64, "num-server-rounds": args.rounds, "learning-rate": 0.5,
              "clip": 1.0, "epsilon": 8.0, "seed": 0, "results-dir": str(tmp),
              "eval-every": args.rounds}  # evaluate once, at the end, in both runtimes

    started = time.perf_counter()
    code = flwr_run({**config, "run-name": "flower"}, flwr_home=tmp / "flwr-home", timeout=1800)
    flower_total = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"flwr run failed with status {code}")
    started = time.perf_counter()
    run(RunConfig({**config, "run-name": "engine"}), echo=False)
    engine_total = time.perf_counter() - started

    summaries = {name: json.loads((tmp / name / "summary.json").read_text())
                 for name in ("flower", "engine")}
    steady = {name: statistics.median(
        json.loads(line)["seconds"]
        for line in (tmp / name / "rounds.jsonl").read_text().splitlines()[1:])
        for name in ("flower", "engine")}
    models = {name: torch.load(tmp / name / "model.pt") for name in ("flower", "engine")}
    equal = all(torch.equal(models["flower"][k], models["engine"][k]) for k in models["engine"])
    f_round, e_round = steady["flower"], steady["engine"]
    print(f"DPSGD-GC, MNIST MLP 784-256-10, 10 clients, batch 64, {args.rounds} rounds "
          f"(torch threads: {torch.get_num_threads()})\n")
    print("| runtime | s/round (median, rounds 2..T) | s/round (mean, all rounds) "
          "| wall incl. start-up (s) | final test acc |")
    print("|---|---|---|---|---|")
    for label, name, total in (("flwr run (Ray simulation)", "flower", flower_total),
                               ("engine", "engine", engine_total)):
        s = summaries[name]
        print(f"| {label} | {steady[name]:.4f} | {s['seconds_per_round']:.4f} | {total:.1f} | "
              f"{100 * s['test_accuracy']:.2f}% |")
    print(f"\nengine speed-up: {f_round / e_round:.0f}x per round (median), "
          f"{flower_total / engine_total:.0f}x end to end; "
          f"final models bitwise equal: {equal}")


if __name__ == "__main__":
    main()
