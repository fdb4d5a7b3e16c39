"""`make bench`: run every benchmark and write their rows as one Markdown table.

Each benchmark prints its own table and appends its rows to one file; this script then writes
the whole table, headed by the machine it was measured on, to ``benchmarks/results.md`` (the
README links to it and summarises it). ``--quick`` runs every benchmark in its reduced form
(fewer repeats, smaller sizes), ``--only`` some of them; either leaves the file alone unless
``--write`` (``--only`` with ``--rows-from`` writes it: a re-run into an earlier run's rows).
``--device cuda`` runs the benchmarks whose models can run on a GPU
(:data:`ON_DEVICE`: the hardware limit, per-sample clipping, memory, scale) there and writes
``benchmarks/results-cuda.md`` beside the CPU table (the others time Flower's processes and
CPU-side batching: their figures are the CPU's).
A benchmark that fails stops the whole, with its name; nothing is written then. The rows go to
a temporary file, or to ``--rows-from FILE``, which is kept: a later ``--rows-from FILE --only
NAME`` re-runs one benchmark into that run's table (:func:`replaced`).

    .venv/bin/python benchmarks/run_all.py [--quick] [--write] [--only NAME ...] [--device cuda]
        [--rows-from FILE]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import HEADER, Row, load, save

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.md"
TITLE = "# Benchmarks (`make bench`)"
# in the table's order
BENCHMARKS = ("bench_limit", "bench_engine_vs_flower", "bench_flower_vs_bare", "bench_per_sample",
              "bench_memory", "bench_scale", "bench_flower_scale", "bench_population",
              "bench_many_runs", "bench_engine_modes")
ON_DEVICE = ("bench_limit", "bench_per_sample", "bench_memory", "bench_scale")  # --device


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (Linux), else the architecture: the same
    workload's ratios differ from one CPU model to another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0]}, {platform.machine()}" if names else platform.machine()


def machine() -> str:
    gpu = (f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
           else ", no GPU")
    return (f"{os.cpu_count()} CPU cores ({cpu_model()}){gpu}; torch {torch.__version__}, "
            f"Python {platform.python_version()}; {datetime.date.today().isoformat()}")


def replaced(earlier: list[Row], new: list[Row]) -> list[Row]:
    """``earlier`` rows with those of every benchmark ``new`` has rows of replaced by ``new``,
    where the first of them stood (a benchmark re-run into an earlier run's rows); ``new``
    after ``earlier`` where it shares no benchmark (an interrupted run going on)."""
    benchmarks = {row.benchmark for row in new}
    out: list[Row] = []
    placed = False
    for row in earlier:
        if row.benchmark not in benchmarks:
            out.append(row)
        elif not placed:
            out += new
            placed = True
    return out if placed else out + new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every benchmark's reduced form")
    parser.add_argument("--write", action="store_true",
                        help="with --quick or --only: write results.md all the same")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the models run: cuda runs the benchmarks of ON_DEVICE on "
                        "the GPU and writes results-cuda.md")
    parser.add_argument("--rows-from", type=Path, metavar="FILE",
                        help="keep the rows in FILE (JSON lines), going on from those an "
                        "interrupted run left there (its path is printed when a benchmark "
                        "fails); with --only, re-run those benchmarks into an earlier run's "
                        "rows: theirs replace FILE's rows of the same benchmarks, in place")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and (off := [n for n in args.only or () if n not in ON_DEVICE]):
        parser.exit(2, f"{parser.prog}: --device cuda: {', '.join(off)} runs on the CPU only "
                    f"(allowed: {', '.join(ON_DEVICE)})\n")
    if cuda and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: --device cuda, but torch sees no CUDA device\n")
    results = RESULTS.with_name("results-cuda.md") if cuda else RESULTS
    rows_file = args.rows_from or Path(tempfile.mkstemp(prefix="dpfl-bench-rows-",
                                                        suffix=".jsonl")[1])
    earlier = len(load(rows_file)) if rows_file.exists() else 0
    for name in args.only or (ON_DEVICE if cuda else BENCHMARKS):
        print(f"## {name}\n", flush=True)
        command = [sys.executable, str(HERE / f"{name}.py"), "--rows", str(rows_file),
                   *(["--device", "cuda"] if cuda else [])]
        if subprocess.run(command + (["--quick"] if args.quick else [])).returncode != 0:
            sys.exit(f"make bench: {name} failed; nothing written (the rows so far: "
                     f"{rows_file}, for --rows-from)")
        print(flush=True)
    rows = load(rows_file)
    rows = replaced(rows[:earlier], rows[earlier:])
    if args.rows_from:  # a file the user names is kept, as the table, for a later --rows-from
        save(rows, rows_file)
    else:
        rows_file.unlink()
    intro = (f"Measured on {machine()}{' (quick)' if args.quick else ''}. Median and spread "
             f"(lowest–highest) over the interleaved repeats; ✓/✗: target met or not.")
    table = [HEADER, *(row.markdown() for row in rows)]
    print("\n".join([intro, "", *table]))
    if not args.write and (args.quick or args.only and not args.rows_from):
        return
    title = f"{TITLE} on the GPU (`--device cuda`)" if cuda else TITLE
    results.write_text("\n".join([title, "", intro, "", *table, ""]))
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
