"""Peak memory of a per-sample clipped step as the batch and the clients per round grow.

One step is one ``FlatModel.clipped_mean`` call over ``C`` clients × ``b`` samples (clients at
their own points), with the default chunking (``chunk_size`` 256 samples) and with a byte
budget (``chunk_bytes``). Every point runs in a fresh Python process (``--point``), which

1. builds the model, the inputs ``x [C, b, ...]`` and the points ``[C, d]``;
2. runs a warm-up step on one client's first sample, so that the libraries' code pages and
   one-off kernel buffers are already resident (they are not the step's memory);
3. resets the kernel's record of its peak resident set to the current one (``5`` written to
   ``/proc/self/clear_refs``), reads the resident set (``VmRSS``: the baseline), runs the step,
   and reads the peak (``VmHWM``): the step's peak is the difference. On CUDA (``--device
   cuda``) there is a second figure: ``torch.cuda.max_memory_allocated`` during the step less
   the memory allocated before it.

(``ru_maxrss`` will not do: a child started by ``fork`` + ``exec`` inherits its parent's peak
at the fork, which hides the step in a big parent such as a test run.) The difference is what
the step added on top of the pages the process held. It can read low when the step reuses heap
pages that the setup freed but kept (small tensors; big ones are mapped and unmapped), so the
setup allocates nothing large that it frees. Linux only (``/proc``). Figures are per
sample (peak ÷ C·b), beside the size of one materialised per-sample gradient (``d`` × 4 B),
which is what a per-sample method that stacks the gradients would hold for every sample.

    .venv/bin/python benchmarks/bench_memory.py [--quick] [--device cuda] [--rows FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Row, arguments, emit, parse  # noqa: E402

from dpfl.models import FlatModel, build_model  # noqa: E402

SECTION = "memory"
MIB = 2**20
BUDGET = 16 * MIB  # the chunk_bytes of the bounded rows
# The budget counts the values dpfl holds per sample; the peak also holds what it does not count
# (backward's temporaries, kernels' workspaces): measured 2-3× the budget for the conv nets.
SLACK = 4
STATUS = Path("/proc/self/status")
SHAPES = {"mlp": (1, 28, 28), "clip21-cnn": (1, 28, 28), "resnet20": (3, 32, 32)}


@dataclass(frozen=True)
class Point:
    model: str
    batch: int
    clients: int
    budget: int | None  # chunk_bytes; None: chunk_size alone

    def workload(self) -> str:
        bound = "chunk_size 256" if self.budget is None else f"chunk_bytes {self.budget // MIB} MiB"
        clients = f"{self.clients} client{'s' if self.clients > 1 else ''}"
        return f"{self.model}, batch {self.batch}, {clients}, {bound}"


def _status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status``, in bytes."""
    match = re.search(rf"^{field}:\s+(\d+) kB$", STATUS.read_text(), re.MULTILINE)
    assert match is not None, field
    return 1024 * int(match.group(1))


def measure(point: Point, device: str) -> dict[str, float]:
    """The step's peak (bytes) and the figures it is compared with, in this process."""
    gen = torch.Generator().manual_seed(0)
    shape = SHAPES[point.model]
    module = build_model(point.model, input_shape=shape, num_classes=10, seed=0)
    flat_model = FlatModel(module, "cross-entropy", chunk_bytes=point.budget)
    x = torch.randn(point.clients, point.batch, *shape, generator=gen).to(device)
    y = torch.randint(0, 10, (point.clients, point.batch), generator=gen).to(device)
    flat = flat_model.initial_params().to(device)
    points = flat + 0.01 * torch.arange(point.clients, device=device).unsqueeze(1)
    flat_model.clipped_mean(flat, x[:1, :1], y[:1, :1], 1.0)  # warm-up: code pages, kernels
    chunk = min(point.batch, flat_model.chunk_length(flat, x, y, rows=False))
    per_sample = flat_model.sample_bytes(flat, x, y, rows=False)
    figures = {"d": float(flat_model.d), "chunk": float(chunk),
               "counted": float(per_sample * chunk),
               "output": float(4 * point.clients * flat_model.d)}
    STATUS.with_name("clear_refs").write_text("5")  # peak resident set := the current one
    before = _status_bytes("VmRSS")
    if device == "cuda":
        torch.cuda.synchronize()
        cuda_before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    flat_model.clipped_mean(points, x, y, 1.0)
    if device == "cuda":
        torch.cuda.synchronize()
        figures["cuda peak"] = float(torch.cuda.max_memory_allocated() - cuda_before)
    figures["peak"] = float(_status_bytes("VmHWM") - before)
    return figures


def measure_in_child(point: Point, device: str) -> dict[str, float]:
    """:func:`measure` in a fresh interpreter (peak resident sets never go down)."""
    spec = json.dumps([point.model, point.batch, point.clients, point.budget, device])
    done = subprocess.run([sys.executable, __file__, "--point", spec], check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])


# model -> (batches at one client, clients at the batch ``at``, at), full run; --quick takes the
# first and last batch and the first two client counts
SWEEPS = {"mlp": ((16, 64, 256, 1024), (1, 10, 100), 64),
          "clip21-cnn": ((16, 64, 256, 1024), (1, 10, 100), 16),
          "resnet20": ((16, 128), (1, 4), 16)}


def points(quick: bool) -> list[Point]:
    """Batch sweeps at one client and client sweeps, each with and without the byte budget."""
    out: list[Point] = []
    for model, (batches, clients, at) in SWEEPS.items():
        if quick:
            batches, clients = (batches[0], batches[-1]), clients[:2]
        sweep = [(b, 1) for b in batches] + [(at, c) for c in clients if c > 1]
        out += [Point(model, b, c, budget) for b, c in sweep for budget in (None, BUDGET)]
    return out


def rows_of(point: Point, figures: dict[str, float]) -> list[Row]:
    """The step's peak (resident set; CUDA memory too on CUDA) per sample; with a budget, also
    the peak itself against ``SLACK`` × budget + the ``[C, d]`` result."""
    workload = f"{point.workload()}: {int(figures['chunk'])}-sample chunks"
    out: list[Row] = []
    for key, memory in (("peak", "resident set"), ("cuda peak", "CUDA memory")):
        if key not in figures:
            continue
        per_sample = figures[key] / (point.batch * point.clients) / 1024
        out.append(Row.of(SECTION, f"clipped step's peak {memory} per sample", workload, "",
                          [per_sample], "KiB"))
        if point.budget is not None:
            limit = (SLACK * point.budget + figures["output"]) / MIB
            out.append(Row.of(SECTION, f"clipped step's peak {memory}", workload, "",
                              [figures[key] / MIB], "MiB",
                              target=f"≤ {limit:.0f} MiB ({SLACK}× budget + result)",
                              limit=limit))
    return out


def main() -> None:
    parser = arguments(__doc__.splitlines()[0], device=True)  # cuda: max_memory_allocated
    parser.add_argument("--point", default=None, help=argparse.SUPPRESS)  # one point, in a child
    args = parse(parser)
    if args.point is not None:
        model, batch, clients, budget, device = json.loads(args.point)
        print(json.dumps(measure(Point(model, batch, clients, budget), device)))
        return
    rows: list[Row] = []
    seen: set[str] = set()
    for point in points(args.quick):
        figures = measure_in_child(point, args.device)
        if point.model not in seen:
            seen.add(point.model)
            rows.append(Row.of(SECTION, "one materialised per-sample gradient (d × 4 B)",
                               f"{point.model}, d = {int(figures['d']):,}", "",
                               [4 * figures["d"] / 1024], "KiB"))
        print(f"{point.workload()}: peak {figures['peak'] / MIB:.1f} MiB, chunk "
              f"{int(figures['chunk'])}, counted {figures['counted'] / MIB:.1f} MiB, result "
              f"{figures['output'] / MIB:.1f} MiB", file=sys.stderr, flush=True)
        rows += rows_of(point, figures)
    emit(rows, args.rows)


if __name__ == "__main__":
    main()
