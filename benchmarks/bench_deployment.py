"""A round over real Flower processes: dpfl's ClientApp against a bare Flower PyTorch app.

Flower's SuperNode starts a fresh ClientApp process for every message, so whatever the
ClientApp does at start-up is paid every round. This benchmark starts a ``flower-superlink``
and 3 ``flower-supernode`` processes on loopback (:class:`dpfl.federation.LocalFederation`)
and runs, alternately, ``REPEATS`` times each:

* the bare app (``benchmarks/bare_flower_app``, written as Flower's PyTorch quickstart is: each
  message imports torch, torchvision and flwr-datasets, opens MNIST from its memory-mapped
  Arrow copy, takes its partition with ``IidPartitioner`` and runs plain SGD steps of the MLP);
* dpfl (``dpsgd-gc``: one clipped, noised step a round; the same MLP, data, nodes and batch
  size; its node-local cache starts empty, as a fresh deployment's does).

Seconds per round: the median over rounds 2..T of every run (round 1 is reported on its own:
dpfl builds the node's cache then). Then the start-up of one message, in a fresh interpreter
as the SuperNode's ``flwr-clientapp`` is: importing Flower, importing the app, getting the
node's data, the step; medians of ``PROBES`` probes. Target: dpfl ≤ 1.2× the bare app a round.

Run: ``.venv/bin/python benchmarks/bench_deployment.py`` (about 10 minutes).
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import flwr_run, round_seconds

from dpfl.federation import LocalFederation
from dpfl.problem import data_dir
from dpfl.runconfig import RunConfig

ROOT = Path(__file__).resolve().parents[1]
BARE = ROOT / "benchmarks" / "bare_flower_app"
ROUNDS, NODES, REPEATS, PROBES = 6, 3, 2, 5
SHARED = {"num-server-rounds": ROUNDS, "num-partitions": NODES, "batch-size": 32,
          "learning-rate": 0.1}
BARE_ONLY = {"local-steps": 1}  # DPSGD-GC takes one step a round
DPFL = {**SHARED, "algorithm": "dpsgd-gc", "dataset": "mnist", "model": "mlp",
        "noise-multiplier": 1.0, "eval-every": ROUNDS}


def mnist_arrow(folder: Path) -> Path:
    """MNIST's training images as the Arrow dataset ``datasets`` keeps on disk (PNG images and
    labels, as Flower's quickstart downloads them), from the idx files in ``$DPFL_DATA_DIR``."""
    from datasets import ClassLabel, Dataset, Features, Image

    source = Path(data_dir(RunConfig({}))) / "mnist"
    with gzip.open(source / "train-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(source / "train-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int64)
    features = Features({"image": Image(), "label": ClassLabel(num_classes=10)})
    table = Dataset.from_dict({"image": list(images), "label": labels}, features=features)
    path = folder / "mnist-arrow"
    table.save_to_disk(str(path))
    return path


def bare_rounds(env: dict[str, str], folder: Path, data: Path, name: str) -> list[float]:
    times = folder / f"{name}.json"
    flwr_run(env, BARE, {**SHARED, **BARE_ONLY, "data-path": str(data), "times-file": str(times)})
    return json.loads(times.read_text())["seconds_per_round"]


def dpfl_rounds(env: dict[str, str], folder: Path, name: str) -> list[float]:
    flwr_run(env, ROOT, {**DPFL, "results-dir": str(folder / "results"), "run-name": name})
    return round_seconds(folder / "results" / name)


def probe(kind: str, data: str) -> dict[str, float]:
    """One message's start-up in this (fresh) interpreter, by phase."""
    marks = [("start", time.perf_counter())]
    import flwr.app
    import flwr.clientapp  # noqa: F401

    marks.append(("flwr", time.perf_counter()))
    if kind == "bare":
        sys.path.insert(0, str(BARE))
        import bare_app

        marks.append(("imports", time.perf_counter()))
        loader = bare_app.load_data(0, NODES, data, SHARED["batch-size"])
        model = bare_app.net()
        marks.append(("data", time.perf_counter()))
        bare_app.fit(model, loader, BARE_ONLY["local-steps"], SHARED["learning-rate"])
    else:
        import dpfl.client.app  # noqa: F401
        from dpfl.client.cache import node_problem
        from dpfl.client.numpy_client import AlgorithmClient
        from dpfl.runconfig import RunConfig

        marks.append(("imports", time.perf_counter()))
        problem = node_problem(tuple(sorted(RunConfig(DPFL).as_dict().items())), (0,))
        marks.append(("data", time.perf_counter()))
        context = flwr.app.Context(run_id=0, node_id=0,
                                   node_config={"partition-ids": "0", "trust-server": True},
                                   state=flwr.app.RecordDict(), run_config={})
        AlgorithmClient(problem, context, [0]).fit([problem.x0.numpy()],
                                                   {"exchange": "train", "round": 1})
    marks.append(("step", time.perf_counter()))
    heavy = {"opacus", "torchvision", "flwr_datasets"} & set(sys.modules)
    if kind == "dpfl" and heavy:
        raise RuntimeError(f"the node cache missed: the message imported {sorted(heavy)}")
    return {name: b - a for (_, a), (name, b) in zip(marks, marks[1:])}


def probes(kind: str, data: Path, env: dict[str, str]) -> dict[str, float]:
    runs = []
    for _ in range(PROBES):
        out = subprocess.run([sys.executable, __file__, "--probe", kind, str(data)], env=env,
                             capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data = mnist_arrow(folder)
        env = dict(os.environ, DPFL_CACHE_DIR=str(folder / "cache"),
                   DPFL_STATE_DIR=str(folder / "state"))
        rounds: dict[str, list[list[float]]] = {"bare": [], "dpfl": []}
        with LocalFederation(folder, env) as federation:
            # nodes that trust the server (seeded noise, no cap): the runs repeat on them
            env = federation.start([str(i) for i in range(NODES)], policy="trust-server=true")
            for repeat in range(REPEATS):
                rounds["bare"].append(bare_rounds(env, folder, data, f"bare-{repeat}"))
                rounds["dpfl"].append(dpfl_rounds(env, folder, f"dpfl-{repeat}"))
        startup = {kind: probes(kind, data, env) for kind in ("bare", "dpfl")}
        interpreter = statistics.median(
            _seconds([sys.executable, "-c", "pass"]) for _ in range(PROBES))

    per_round = {k: statistics.median(s for run in v for s in run[1:]) for k, v in rounds.items()}
    first = {k: statistics.median(run[0] for run in v) for k, v in rounds.items()}
    print(f"{NODES} SuperNodes on loopback, MNIST MLP, one step of batch "
          f"{SHARED['batch-size']} a round, {ROUNDS} rounds × {REPEATS} runs each, "
          f"{os.cpu_count()} cores\n")
    print("| app | s/round (median, rounds 2..T) | round 1 | ratio to bare |")
    print("|---|---:|---:|---:|")
    for kind, label in (("bare", "bare Flower PyTorch app"), ("dpfl", "dpfl (dpsgd-gc)")):
        print(f"| {label} | {per_round[kind]:.2f} | {first[kind]:.2f} | "
              f"{per_round[kind] / per_round['bare']:.2f}× |")
    print(f"\nStart-up of one message in a fresh interpreter (median of {PROBES}; the "
          f"interpreter itself: {interpreter:.2f} s)\n")
    print("| app | import Flower | import the app | node's data | step | total |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in ("bare", "dpfl"):
        s = startup[kind]
        print(f"| {kind} | {s['flwr']:.2f} | {s['imports']:.2f} | {s['data']:.2f} | "
              f"{s['step']:.2f} | {sum(s.values()):.2f} |")


def _seconds(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - started


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        print(json.dumps(probe(sys.argv[2], sys.argv[3])))
    else:
        main()
