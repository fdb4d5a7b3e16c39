"""The PCDP-SGD reproduction's workload: seconds per local step of each method of the projection
family on the paper's centralized setting (MNIST, 10,000 private and 100 public images, the
26,010-parameter CNN, Poisson batches of expected size 250, k = 100, RPDP-SGD k' = 800 as the
reproduction runs it, and redrawn every step as a rotation and as Kronecker rows, its default), one
torch thread, and the parts of a PCDP-SGD step (the public tape and its Gram matrix, the
eigendecomposition, the private records' coordinates from their tapes, the lift; beside them
the materialised route they replace), and RPDP-SGD's random subspace drawn each
step by QR, as rows of a structured random rotation, or as rows of a per-layer Kronecker
rotation read from the tapes (``random-basis``); and a round of PCDP-SGD and of RPDP-SGD's two
fast subspaces on the matched-ε benchmark's MNIST MLP federation (``--mlp-rounds``).

    .venv/bin/python benchmarks/bench_projected.py [--rounds 1] [--parts-only]

One round is an epoch (40 local steps); the full run is 80 of them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import scratch  # noqa: E402

from dpfl.algorithms.projected import (  # noqa: E402
    KroneckerRotation,
    RandomBasis,
    RandomRotation,
    top_eigenspace,
)
from dpfl.engine import run  # noqa: E402
from dpfl_reproductions.pcdp import SETTINGS, config_of  # noqa: E402
from dpfl.models.span import GradientSpan  # noqa: E402
from dpfl.privacy import Randomness  # noqa: E402
from dpfl.problem import build_problem  # noqa: E402
from dpfl.runconfig import RunConfig  # noqa: E402

# (row, method, overrides of the reproduction's run): the reproduction's RPDP-SGD redraws a
# QR subspace once an epoch; the algorithm's default redraws Kronecker rows every step
METHODS = (("dp-sgd", "dp-sgd", {}), ("rsdp-sgd", "rsdp-sgd", {}), ("pdp-sgd", "pdp-sgd", {}),
           ("pcdp-sgd", "pcdp-sgd", {}),
           ("rpdp-sgd (QR once an epoch)", "rpdp-sgd", {}),
           ("rpdp-sgd (rotation every step)", "rpdp-sgd",
            {"random-basis": "rotation", "projection-interval": 1}),
           ("rpdp-sgd (Kronecker rows every step: its default)", "rpdp-sgd",
            {"random-basis": "kronecker", "projection-interval": 1}))
# the matched-ε benchmark's round (docs/benchmark.md): the MNIST MLP (d = 203,530), 10 IID
# clients, one local step of about 32 records each
MLP_ROUND = {"dataset": "mnist", "partitioner": "iid", "num-partitions": 10, "epsilon": 2.0,
             "calibration": "accountant", "calibration-rounds": 200,
             "dataset-options": "num_validation=5000", "learning-rate": 1.0, "clip": 0.3}
MLP_METHODS = (("pcdp-sgd", "pcdp-sgd", {"dataset-options": "num_public=100 num_validation=5000"}),
               ("rpdp-sgd (rotation)", "rpdp-sgd", {"random-basis": "rotation"}),
               ("rpdp-sgd (Kronecker rows)", "rpdp-sgd", {"random-basis": "kronecker"}))


def timed(fn, repeat: int = 5) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--parts-only", action="store_true", help="only the parts of a step")
    parser.add_argument("--mlp-rounds", type=int, default=3,
                        help="rounds of each method on the benchmark's MLP federation (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = scratch("dpfl-bench-pcdp-")
    setting = SETTINGS["centralized-mnist"]
    print("| method | s per local step | s per 80-epoch run (extrapolated) |\n|---|---:|---:|")
    rows: list[str] = []
    for row, method, overrides in () if args.parts_only else METHODS:
        rows.append(row)
        values = {**config_of(setting, method, 10, 0, "code", rounds=args.rounds), **overrides,
                  "results-dir": str(tmp), "run-name": f"row{len(rows)}", "eval-every": 1000}
        summary = run(RunConfig(values), echo=False)
        per_step = summary["seconds_per_round"] / 40
        print(f"| {row} | {per_step:.3f} | {per_step * 3200:.0f} |", flush=True)
    if args.mlp_rounds and not args.parts_only:
        print("\n| method, MNIST MLP, 10 clients | s per round |\n|---|---:|")
        for row, method, overrides in MLP_METHODS:
            rows.append(row)
            rounds = args.mlp_rounds
            values = {**MLP_ROUND, "algorithm": method, **overrides, "num-server-rounds": rounds,
                      "eval-every": rounds, "results-dir": str(tmp), "run-name": f"row{len(rows)}"}
            summary = run(RunConfig(values), echo=False)
            print(f"| {row} | {summary['seconds_per_round']:.3f} |", flush=True)
    problem = build_problem(RunConfig(config_of(setting, "pcdp-sgd", 10, 0, "code")))
    model, x = problem.model, problem.x0
    source = problem.algorithm.source
    px, py = problem.algorithm.public
    xb, yb = problem.dataset.train_x[:250], problem.dataset.train_y[:250]
    rows_all = torch.arange(len(py))
    space = source.at(x, rows_all)
    span = space.span
    public = model.per_sample_gradients(x[None], px[None], py[None])[0]
    v = public.double().t() @ space.r  # the materialised V, for the route it replaces
    rows = model.per_sample_gradients(x[None], xb[None], yb[None])[0]
    coords = torch.cat(list(space.sample_coords(model, x, xb, yb)))
    rpdp = build_problem(RunConfig(config_of(setting, "rpdp-sgd", 10, 0, "code"))).algorithm
    qr, rotation, rng = RandomBasis(rpdp), RandomRotation(rpdp), Randomness(0)
    kronecker = KroneckerRotation(rpdp)
    basis = qr.subspace(x, rng, 0, 1, 0)
    parts = {
        "public tape (100 records) and its Gram matrix, float64": lambda: GradientSpan(
            model, x, px, py).gram(),
        "eigendecomposition of the Gram matrix (100 × 100)": lambda: top_eigenspace(
            span.gram(), 100),
        "private coordinates Vᵀg from the tapes (250)": lambda: torch.cat(list(
            space.sample_coords(model, x, xb, yb))),
        "lift V·a (a weighted sum of the public gradients)": lambda: space.lift(coords.sum(0)),
        "the route replaced: public per-sample gradients (100, materialised)": lambda: (
            model.per_sample_gradients(x[None], px[None], py[None])),
        "the route replaced: private per-sample gradients (250, materialised)": lambda: (
            model.per_sample_gradients(x[None], xb[None], yb[None])),
        "the route replaced: Vᵀg (250 × 26,010 × 100) and V·a": lambda: (
            v.float() @ (rows @ v.float()).sum(0)),
        "DP-SGD's clipped mean (250, ghost norms)": lambda: model.clipped_mean(
            x[None], xb[None], yb[None], 0.01),
        "RPDP subspace by QR: draw (26,010 × 800)": lambda: qr.subspace(x, rng, 0, 1, 0),
        "RPDP subspace by QR: Vᵀg (250) and the lift": lambda: basis.lift(
            basis.coords(rows).sum(0)),
        "RPDP subspace by rotation: draw, Vᵀg (250), lift": lambda: (lambda r: r.lift(
            r.coords(rows).sum(0)))(rotation.subspace(x, rng, 0, 1, 0)),
        "RPDP subspace by Kronecker rows: draw, Vᵀg from the tapes (250), lift": lambda: (
            lambda r: r.lift(torch.cat(list(r.sample_coords(model, x, xb, yb))).sum(0)))(
            kronecker.subspace(x, rng, 0, 1, 0)),
    }
    print("\n| part of a step | seconds |\n|---|---:|")
    for name, fn in parts.items():
        print(f"| {name} | {timed(fn):.4f} |", flush=True)


if __name__ == "__main__":
    main()
