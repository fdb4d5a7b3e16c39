"""Scale with clients: the engine's seconds per round from 1 to 10,000 clients.

Workload: DPSGD-GC (stateless, per-sample clipping, one noisy step per round; noise multiplier
1 set directly, so no calibration is timed), MNIST with the 784-256-10 MLP (d = 203,530),
batch 16, every client in every round, one torch thread. Every client holds 24 records: the
first 24·C records of MNIST's 60,000 training images taken in order and repeated as often as
needed (distinct images up to C = 2,500; at C = 10,000 each image is held 4 times, by 4
different clients), split in contiguous blocks of 24; the rounds timed do not evaluate (1,000
test images evaluate the initial model once). A round is the round loop's whole round on
the engine (from one exchange request of ``RoundLoop.run`` to the next): the participants, the
clients' batched steps and noise in blocks of :data:`dpfl.rounds.transport.BLOCK` clients, the
blocked sum, the server step, every client's ledger and the round's record. The sizes
alternate (:func:`common.interleaved`) after one warm-up round each.

From the medians it fits ``seconds = fixed + C·per-client`` (least squares) and compares the
per-client cost with the arithmetic one client cannot avoid: a plain, non-private forward and
backward pass of the ``nn.Module`` over its 16 samples (mean loss, ``backward()``) and its
203,530 Gaussians, measured batched over one block of clients (16·BLOCK samples in one call,
one ``torch.randn`` of BLOCK·d). The overhead is the difference: per-sample clipping, per-client
keyed streams, copies and the bookkeeping. That arithmetic sums the block's gradients into one,
where a federation's clients each upload their own: a second row times the same passes with
each client's mean-loss gradient its own output (``torch.func.vmap`` of ``grad`` over the
block's clients, one call) plus the same Gaussians, and the overhead above that.

On the CPU by default; ``--device cuda`` runs the engine and the arithmetic on the GPU (the
noise is drawn on the CPU from the keyed streams whatever the device, and copied over: there it
is part of the overhead, while the arithmetic draws its Gaussians on the GPU).

    .venv/bin/python benchmarks/bench_scale.py [--quick] [--rows FILE] [--device cuda]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Row, arguments, best_of_three, emit, interleaved, parse, scratch  # noqa: E402

from dpfl.datasets.base import Dataset  # noqa: E402
from dpfl.engine.runner import EngineTransport  # noqa: E402
from dpfl.problem import Problem, assemble, dataset_of  # noqa: E402
from dpfl.rounds import RoundLoop, transport  # noqa: E402
from dpfl.rounds.driver import advance  # noqa: E402
from dpfl.runconfig import RunConfig  # noqa: E402

SECTION = "scale"
RECORDS, BATCH = 24, 16  # records per client, batch size
SIZES = (1, 10, 100, 1_000, 10_000)
QUICK_SIZES = (1, 10, 100, 1_000)
WORKLOAD = f"dpsgd-gc, MNIST MLP, batch {BATCH}, {RECORDS} records/client, all clients"


def problem_of(clients: int, folder: Path, device: str) -> Problem:
    """The workload's run for ``clients`` clients on ``device`` (see the module docstring)."""
    config = RunConfig({"dataset": "mnist", "model": "mlp", "algorithm": "dpsgd-gc",
                        "batch-size": BATCH, "num-partitions": clients, "clip": 1.0,
                        "noise-multiplier": 1.0, "num-server-rounds": 10_000,
                        "eval-every": 10_000, "results-dir": str(folder),
                        "run-name": f"scale-{clients}", "device": device})
    mnist = dataset_of(config)
    rows = torch.arange(RECORDS * clients) % mnist.num_train
    data = Dataset("mnist", mnist.train_x[rows], mnist.train_y[rows], mnist.test_x[:1000],
                   mnist.test_y[:1000], task="classification", num_classes=10)
    parts = [np.arange(RECORDS * c, RECORDS * (c + 1), dtype=np.int64) for c in range(clients)]
    return assemble(config, data, parts)


class Rounds:
    """The rounds of one engine run, one per call."""

    def __init__(self, problem: Problem) -> None:
        self.transport = EngineTransport(problem)
        self.rounds = RoundLoop(problem, "engine", echo=False).run()
        self.request = advance(self.rounds, self.transport)  # round 1's exchange

    def __call__(self) -> None:
        """One round: its exchange, server step and record, up to the next round's exchange."""
        replies = self.request.sent_over(self.transport)
        self.request = advance(self.rounds, self.transport, replies)


def arithmetic(problem: Problem, clients: int, *, own: bool = False) -> float:
    """Seconds of one client's unavoidable arithmetic (see the module docstring), measured
    over ``clients`` clients at once, the best of 3: the passes over all their samples summed
    into one gradient, or with ``own`` each client's mean-loss gradient its own output (one
    vmapped call over the clients); then the clients' Gaussians."""
    module = problem.model.load_into(problem.x0)
    x = problem.dataset.train_x[:BATCH].repeat(clients, 1, 1, 1).to(problem.device)
    y = problem.dataset.train_y[:BATCH].repeat(clients).to(problem.device)
    params = {name: p.detach() for name, p in module.named_parameters()}

    def loss(p: dict, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(module, p, (xs,)), ys)
    gradients = vmap(grad(loss), in_dims=(None, 0, 0))

    def passes() -> None:
        if own:
            gradients(params, x.reshape(clients, BATCH, *x.shape[1:]), y.reshape(clients, BATCH))
        else:
            F.cross_entropy(module(x), y).backward()
        torch.randn(clients, problem.model.d, device=problem.device)
    return best_of_three(passes) / clients


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0], device=True)
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per size")
    args = parse(parser)
    sizes = QUICK_SIZES if args.quick else SIZES
    repeats = args.repeats or (2 if args.quick else 3)
    torch.set_num_threads(1)
    folder = scratch("dpfl-bench-scale-")
    problems = {c: problem_of(c, folder, args.device) for c in sizes}
    times = interleaved({str(c): Rounds(p) for c, p in problems.items()}, repeats)
    medians = np.array([float(np.median(times[str(c)])) for c in sizes])
    per_client, fixed = np.polyfit(np.array(sizes, dtype=float), medians, 1)
    own, outputs = [], []
    for _ in range(repeats):  # alternating, so that the machine's drift falls on both alike
        own.append(arithmetic(problems[max(sizes)], transport.BLOCK))
        outputs.append(arithmetic(problems[max(sizes)], transport.BLOCK, own=True))
    workload = WORKLOAD + (", on the GPU" if args.device == "cuda" else "")
    rows = [Row.of(SECTION, "engine s/round", f"{workload}, C = {c:,}", "prisma",
                   times[str(c)], "s") for c in sizes]
    rows += [
        Row.of(SECTION, "per-client cost (fit)", f"{workload}, C = {sizes[0]}–{sizes[-1]:,}",
               "prisma", [per_client * 1e6], "µs"),
        Row.of(SECTION, "fixed cost per round (fit)",
               f"{workload}, C = {sizes[0]}–{sizes[-1]:,}", "prisma", [fixed], "s"),
        Row.of(SECTION, "per-client arithmetic (plain fwd+bwd of 16 + d Gaussians)",
               f"MNIST MLP, batched over {transport.BLOCK} clients", "", [t * 1e6 for t in own],
               "µs"),
        Row.of(SECTION, "per-client overhead (fit − arithmetic)", workload, "prisma",
               [per_client * 1e6 - t * 1e6 for t in own], "µs"),
        Row.of(SECTION, "per-client arithmetic, each client's own gradient (vmap) + d Gaussians",
               f"MNIST MLP, {transport.BLOCK} clients in one call", "",
               [t * 1e6 for t in outputs], "µs"),
        Row.of(SECTION, "per-client overhead above it (fit − own-gradient arithmetic)", workload,
               "prisma", [per_client * 1e6 - t * 1e6 for t in outputs], "µs"),
    ]
    emit(rows, args.rows)


if __name__ == "__main__":
    main()
