"""What secure aggregation costs a round: the same run with and without Flower's SecAgg+.

Over real processes (:class:`dpfl.federation.LocalFederation`: a ``flower-superlink`` and N
``flower-supernode`` processes on loopback, each hosting one client, trusting the server so that
runs repeat), ``dpsgd-gc`` on MNIST's MLP, one step of batch 32 a round, ``ROUNDS`` rounds,
alternately without it and with ``secure-aggregation=true distributed-noise=true``; seconds per
round, the median over rounds 2..T of every run (round 1 builds the nodes' caches). SecAgg+
takes four message round trips an exchange (setup, share keys, collect masked vectors, unmask)
where a plain exchange takes one, and Flower 1.41's SuperNode starts a fresh ClientApp process
for every message. Then, in process, the engine's round with its secure sum (quantise, integer
sum, dequantise) against the float sum, for 10 and 100 clients.

Run: ``.venv/bin/python benchmarks/bench_secagg.py [--nodes 3 10] [--rounds 4]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from common import flwr_run, round_seconds

from dpfl.engine import run
from dpfl.federation import LocalFederation
from dpfl.flower_app import app_folder
from dpfl.runconfig import RunConfig

ROOT = Path(__file__).resolve().parents[1]
SECURE = {"secure-aggregation": True, "distributed-noise": True}


def federation_rounds(nodes: int, rounds: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per round (rounds 2..T of every run) with and without SecAgg+, alternated."""
    config = {"algorithm": "dpsgd-gc", "dataset": "mnist", "num-partitions": nodes,
              "num-server-rounds": rounds, "eval-every": rounds, "batch-size": 32,
              "noise-multiplier": 1.0}
    out: dict[str, list[float]] = {"plain": [], "secagg": []}
    with tempfile.TemporaryDirectory() as tmp, app_folder() as app:
        folder = Path(tmp)
        env = dict(os.environ, DPFL_CACHE_DIR=str(folder / "cache"),
                   DPFL_STATE_DIR=str(folder / "state"))
        with LocalFederation(folder, env) as federation:
            env = federation.start([str(i) for i in range(nodes)], policy="trust-server=true")
            for repeat in range(repeats):
                for arm, extra in (("plain", {}), ("secagg", SECURE)):
                    name = f"{arm}-{repeat}"
                    flwr_run(env, app, {**config, **extra, "run-name": name,
                                        "results-dir": str(folder / "results")}, timeout=3600)
                    out[arm] += round_seconds(folder / "results" / name)[1:]
    return out


def engine_round(clients: int, secure: bool, rounds: int = 6) -> float:
    """Seconds per engine round (MNIST MLP, one step of batch 32), with or without the
    secure sum: the median of rounds 2..T (the first warms the allocator and the data)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = RunConfig({"algorithm": "dpsgd-gc", "dataset": "mnist",
                            "num-partitions": clients, "num-server-rounds": rounds,
                            "eval-every": rounds, "noise-multiplier": 1.0,
                            "results-dir": tmp, "run-name": "run",
                            **(SECURE if secure else {})})
        run(config, echo=False)
        return statistics.median(round_seconds(Path(tmp) / "run")[1:-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="*", default=[3, 10],
                        help="SuperNode counts (none: the engine part only)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if args.nodes:
        print(f"SuperNodes on loopback, one client each, MNIST MLP, dpsgd-gc, one step of batch "
              f"32 a round, {args.rounds} rounds × {args.repeats} run(s) each arm, alternated, "
              f"{os.cpu_count()} cores\n")
        print("| SuperNodes | s/round without | s/round with SecAgg+ | ratio |")
        print("|---:|---:|---:|---:|")
    for nodes in args.nodes:
        times = federation_rounds(nodes, args.rounds, args.repeats)
        plain, secagg = (statistics.median(times[k]) for k in ("plain", "secagg"))
        print(f"| {nodes} | {plain:.2f} | {secagg:.2f} | {secagg / plain:.2f}× |", flush=True)
    print("\nThe engine's round with the secure sum against the float sum (median of rounds "
          "2..5 of 6, interleaved)\n")
    print("| clients | s/round float sum | s/round secure sum | ratio |")
    print("|---:|---:|---:|---:|")
    engine_round(10, False)  # the data loaded and cached once, for both
    for clients in (10, 100):
        plain, secure = (engine_round(clients, s) for s in (False, True))
        print(f"| {clients} | {plain:.3f} | {secure:.3f} | {secure / plain:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
