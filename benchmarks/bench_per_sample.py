"""Cost of per-sample clipping relative to a plain training step, on CPU.

ratio = time(one per-sample-clipped step: ``FlatModel.clipped_mean`` + SGD update on the flat
vector) / time(one plain step: mean-loss ``backward()`` on the ``nn.Module`` + ``torch.optim.SGD``
step), batch 64, MNIST-shaped inputs. Both are timed in the same run, interleaved, and the medians
over the repeats (after warm-up) are compared. The ``×10 clients`` rows time one ``clipped_mean``
call over 10 clients × 64 samples (clients at different points) against 10 plain steps.

    .venv/bin/python benchmarks/bench_per_sample.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfl.models import FlatModel, build_model  # noqa: E402

BATCH, CLIENTS, LR, CLIP = 64, 10, 0.1, 1.0


def _steps(name: str, n_clients: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(plain step, clipped step) closures for ``n_clients`` clients of ``BATCH`` samples."""
    gen = torch.Generator().manual_seed(0)
    model = build_model(name, input_shape=(1, 28, 28), num_classes=10, seed=0)
    x = torch.randn(n_clients, BATCH, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (n_clients, BATCH), generator=gen)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def plain() -> None:
        for c in range(n_clients):
            optimizer.zero_grad()
            F.cross_entropy(model(x[c]), y[c]).backward()
            optimizer.step()

    flat_model = FlatModel(model, "cross-entropy")
    flat = flat_model.initial_params()
    if n_clients > 1:  # clients at their own points, as after local steps
        flat = flat.repeat(n_clients, 1)

    def clipped() -> None:
        update, _ = flat_model.clipped_mean(flat, x, y, CLIP)
        flat.add_(update if n_clients > 1 else update[0], alpha=-LR)

    return plain, clipped


def _median_times(
    plain: Callable[[], None], clipped: Callable[[], None], repeats: int, warmup: int
) -> tuple[float, float]:
    for _ in range(warmup):
        plain()
        clipped()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((plain, times[0]), (clipped, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (20, not 100)")
    args = parser.parse_args()
    repeats, warmup = (20, 5) if args.quick else (100, 10)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {BATCH}, "
          f"median of {repeats} interleaved repeats\n")
    print("| model | clients | plain step (ms) | clipped step (ms) | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name in ("mlp", "clip21-cnn"):
        for n_clients in (1, CLIENTS):
            plain, clipped = _steps(name, n_clients)
            t_plain, t_clipped = _median_times(plain, clipped, repeats, warmup)
            print(f"| {name} | {n_clients} | {1e3 * t_plain:.2f} | {1e3 * t_clipped:.2f} | "
                  f"{t_clipped / t_plain:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
