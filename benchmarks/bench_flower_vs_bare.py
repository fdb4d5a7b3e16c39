"""dpfl's Flower path against bare Flower, both under `flwr run` (Ray simulation), no DP in either.

The bare app (``benchmarks/bare_flower_app``: Flower's ``FedAvg`` and a ClientApp written as
Flower's PyTorch quickstart is) and dpfl (``dpsgd-gc`` with ``noise-multiplier=0`` and a clip
no gradient reaches, so nothing is noised or clipped, though the per-sample norms are still
computed) run the same MLP (784-256-10), the same MNIST data, ``NODES`` virtual SuperNodes of
one client each, one SGD step of batch 32 a round, ``ROUNDS`` rounds, alternately, ``--repeats``
times each. Seconds per round: the ServerApp's wall time between rounds (the bare app's
``evaluate_fn`` marks; dpfl's round records), the median of rounds 2..T-1 (dpfl evaluates at the
last round, the bare app never). Target: dpfl ≤ 1.2× the bare app per round.

    .venv/bin/python benchmarks/bench_flower_vs_bare.py [--quick] [--rows FILE]
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_deployment import BARE, mnist_arrow  # noqa: E402
from common import Row, arguments, emit, ratios, round_seconds  # noqa: E402

from dpfl.config import format_overrides  # noqa: E402
from dpfl.federation import BIN  # noqa: E402
from dpfl.launch import flwr_run, simulation_env, started_processes, stop  # noqa: E402

NODES, ROUNDS, LIMIT = 10, 8, 1.2
SHARED = {"num-partitions": NODES, "batch-size": 32, "learning-rate": 0.1}
DPFL = {**SHARED, "algorithm": "dpsgd-gc", "dataset": "mnist", "model": "mlp",
        "noise-multiplier": 0.0, "clip": 1e6}


def bare_rounds(folder: Path, data: Path, rounds: int, name: str) -> list[float]:
    """Seconds of each round of the bare app under a local simulation of its own."""
    home, times = folder / f"home-{name}", folder / f"{name}.json"
    env = simulation_env(home)
    overrides = {**SHARED, "num-server-rounds": rounds, "local-steps": 1,
                 "data-path": str(data), "times-file": str(times)}
    try:
        done = subprocess.run([str(BIN / "flwr"), "run", str(BARE), "--stream", "--run-config",
                               format_overrides(overrides), "--federation-config",
                               f"num-supernodes={NODES}"],
                              env=env, cwd=BARE, capture_output=True, text=True, timeout=1800)
        if not times.is_file():
            raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    finally:
        stop(started_processes(home))
        shutil.rmtree(home, ignore_errors=True)
    return json.loads(times.read_text())["seconds_per_round"]


def dpfl_rounds(folder: Path, rounds: int, name: str) -> list[float]:
    """Seconds of each round of dpfl's app under ``dpfl flower``'s local simulation."""
    code = flwr_run({**DPFL, "num-server-rounds": rounds, "eval-every": rounds,
                     "results-dir": str(folder / "results"), "run-name": name}, timeout=1800)
    if code != 0:
        raise SystemExit(f"flwr run of dpfl failed with status {code}")
    return round_seconds(folder / "results" / name)


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    repeats, rounds = (1, 5) if args.quick else (args.repeats or 3, ROUNDS)
    bare, ours = [], []
    with tempfile.TemporaryDirectory(prefix="dpfl-bench-bare-") as tmp:
        folder = Path(tmp)
        data = mnist_arrow(folder)
        for repeat in range(repeats):
            bare.append(statistics.median(bare_rounds(folder, data, rounds, f"b{repeat}")[1:-1]))
            ours.append(statistics.median(dpfl_rounds(folder, rounds, f"d{repeat}")[1:-1]))
    workload = (f"`flwr run` (Ray simulation), MNIST MLP, {NODES} SuperNodes × 1 client, "
                f"1 step of batch 32, {rounds} rounds, no DP")
    emit([Row.of("Flower path", "dpfl ÷ bare Flower FedAvg, s/round", workload, "prisma",
                 ratios(ours, bare), "×", target=f"≤ {LIMIT}×", limit=LIMIT),
          Row.of("Flower path", "bare Flower FedAvg s/round", workload, "", bare, "s"),
          Row.of("Flower path", "dpfl (dpsgd-gc, σ = 0) s/round", workload, "prisma", ours, "s")],
         args.rows)


if __name__ == "__main__":
    main()
