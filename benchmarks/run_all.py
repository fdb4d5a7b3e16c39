"""`make bench`: run every benchmark and write their rows as one Markdown table.

Each benchmark prints its own table and appends its rows to one file; this script then writes
the whole table, headed by the machine it was measured on, to ``benchmarks/results.md`` and
into the README between its ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` marks (the
README's Performance section shows the latest ``make bench``). ``--quick`` runs every benchmark
in its reduced form (fewer repeats, smaller sizes), ``--only`` some of them; either touches
neither file unless ``--write``.
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
README = HERE.parent / "README.md"
RESULTS = HERE / "results.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
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
                        help="with --quick or --only: write results.md and the README all "
                        "the same")
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
    table = "\n".join([HEADER, *(row.markdown() for row in rows)])
    rows_file.unlink()
    text = (f"Measured on {machine()}{' (quick)' if args.quick else ''}. Median and spread "
            f"(lowest–highest) over the interleaved repeats; ✓/✗: target met or not.\n\n{table}\n")
    print(text)
    if (args.quick or args.only) and not (args.write or args.rows_from):
        return
    RESULTS.write_text(f"# Benchmarks (`make bench`)\n\n{text}")
    readme = README.read_text()
    head, _, rest = readme.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not rest or END not in rest:
        sys.exit(f"make bench: README.md has no {BEGIN} … {END} section; wrote {RESULTS} only")
    README.write_text(f"{head}{BEGIN}\n<details><summary>The whole table ({len(rows)} rows; also "
                      f"in <code>benchmarks/results.md</code>)</summary>\n\n{text}\n</details>\n"
                      f"{END}{tail}")
    print(f"wrote {RESULTS} and README.md's table")


if __name__ == "__main__":
    main()
