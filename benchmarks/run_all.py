"""`make bench`: run every benchmark and write their rows as one Markdown table.

Each benchmark prints its own table and appends its rows to one file; this script then writes
the whole table, headed by the machine it was measured on, to ``benchmarks/results.md`` (the
README links to it and summarises it). ``--quick`` runs every benchmark in its reduced form
(fewer repeats, smaller sizes), ``--only`` some of them; either leaves the file alone unless
``--write``.
A benchmark that fails stops the whole, with its name; nothing is written then.

    .venv/bin/python benchmarks/run_all.py [--quick] [--write] [--only NAME ...]
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
from common import HEADER, load

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.md"
TITLE = "# Benchmarks (`make bench`)"
# in the table's order
BENCHMARKS = ("bench_limit", "bench_engine_vs_flower", "bench_flower_vs_bare", "bench_per_sample",
              "bench_memory", "bench_scale", "bench_flower_scale", "bench_many_runs",
              "bench_engine_modes")


def machine() -> str:
    gpu = (f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
           else ", no GPU")
    return (f"{os.cpu_count()} CPU cores ({platform.machine()}){gpu}; torch {torch.__version__}, "
            f"Python {platform.python_version()}; {datetime.date.today().isoformat()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every benchmark's reduced form")
    parser.add_argument("--write", action="store_true",
                        help="with --quick or --only: write results.md all the same")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these")
    parser.add_argument("--rows-from", type=Path, metavar="FILE",
                        help="go on from the rows an interrupted run left in FILE (its path "
                        "is printed when a benchmark fails)")
    args = parser.parse_args()
    rows_file = args.rows_from or Path(tempfile.mkstemp(prefix="dpfl-bench-rows-",
                                                        suffix=".jsonl")[1])
    for name in args.only or BENCHMARKS:
        print(f"## {name}\n", flush=True)
        command = [sys.executable, str(HERE / f"{name}.py"), "--rows", str(rows_file)]
        if subprocess.run(command + (["--quick"] if args.quick else [])).returncode != 0:
            sys.exit(f"make bench: {name} failed; nothing written (the rows so far: "
                     f"{rows_file}, for --rows-from)")
        print(flush=True)
    rows = load(rows_file)
    rows_file.unlink()
    intro = (f"Measured on {machine()}{' (quick)' if args.quick else ''}. Median and spread "
             f"(lowest–highest) over the interleaved repeats; ✓/✗: target met or not.")
    table = [HEADER, *(row.markdown() for row in rows)]
    print("\n".join([intro, "", *table]))
    if (args.quick or args.only) and not (args.write or args.rows_from):
        return
    RESULTS.write_text("\n".join([TITLE, "", intro, "", *table, ""]))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
