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
from common import HEADER, Row, load

HERE = Path(__file__).resolve().parent
README = HERE.parent / "README.md"
RESULTS = HERE / "results.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
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
    rows_file.unlink()
    intro = (f"Measured on {machine()}{' (quick)' if args.quick else ''}. Median and spread "
             f"(lowest–highest) over the interleaved repeats; ✓/✗: target met or not.")
    table = [HEADER, *(row.markdown() for row in rows)]
    print("\n".join([intro, "", *table]))
    if (args.quick or args.only) and not (args.write or args.rows_from):
        return
    RESULTS.write_text("\n".join([TITLE, "", intro, "", *table, ""]))
    readme(intro, [line for line, row in zip(table[1:], rows, strict=True) if in_readme(row)])
    print(f"wrote {RESULTS} and README.md's table")


def in_readme(row: Row) -> bool:
    """The README's rows (a front page): every ratio, the scale and Flower-path figures, and the
    memory bounds with their targets; the rest (per-point memory, plain-step times, agreement
    checks, absolute throughputs) stays in ``benchmarks/results.md``."""
    return row.unit == "×" or row.section in ("scale", "Flower path") or (
        row.section == "memory" and row.met is not None)


def readme(intro: str, lines: list[str]) -> None:
    """Put ``lines`` (table rows, under :data:`HEADER`) between the README's marks."""
    text = README.read_text()
    head, _, rest = text.partition(BEGIN)
    if not rest or END not in rest:
        sys.exit(f"make bench: README.md has no {BEGIN} … {END} section; wrote {RESULTS} only")
    tail = rest.partition(END)[2]
    body = "\n".join([intro, "", HEADER, *lines])
    README.write_text(f"{head}{BEGIN}\n<details><summary>The table ({len(lines)} main rows; all "
                      f"of them in <code>benchmarks/results.md</code>)</summary>\n\n{body}\n\n"
                      f"</details>\n{END}{tail}")


if __name__ == "__main__":
    main()
