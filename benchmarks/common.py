"""What every benchmark shares: interleaved timing, and the rows of `make bench`'s one table.

A benchmark measures with :func:`interleaved` (the candidates alternate, so machine noise
affects them alike), turns its measurements into :class:`Row` s, prints them, and, when run with
``--rows FILE`` (as ``run_all.py`` runs it), appends them to FILE as JSON lines; ``run_all.py``
gathers every benchmark's rows into one Markdown table.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch


@dataclass
class Row:
    """One figure of the table: a ``measure`` of a ``workload`` (``family``: the algorithm
    family it covers, or "" for one that is not an algorithm's); ``median`` and ``spread``
    (the lowest and highest of the ``repeats`` interleaved measurements) in ``unit``;
    ``target`` the figure it must reach ("≤ 1.5×"; "" for none), ``met`` whether it does;
    ``benchmark`` the script that measured it (set by :func:`emit`)."""

    section: str
    measure: str
    workload: str
    family: str
    median: float
    low: float
    high: float
    unit: str
    repeats: int
    target: str = ""
    met: bool | None = None
    benchmark: str = ""

    @classmethod
    def of(cls, section: str, measure: str, workload: str, family: str, values: Sequence[float],
           unit: str, *, target: str = "", limit: float | None = None) -> Row:
        """The row of measurements ``values``; ``limit``: the target is median ≤ limit."""
        med = statistics.median(values)
        return cls(section, measure, workload, family, med, min(values), max(values), unit,
                   len(values), target, None if limit is None else med <= limit)

    def markdown(self) -> str:
        spread = f"{_fmt(self.low)}–{_fmt(self.high)}" if self.repeats > 1 else "—"
        target = self.target + {True: " ✓", False: " ✗", None: ""}[self.met]
        return (f"| {self.section} | {self.measure} | {self.workload} | {self.family or '—'} | "
                f"{_fmt(self.median)} {self.unit} | {spread} | {self.repeats} | {target} |")


HEADER = ("| section | measure | workload | family | median | spread (min–max) | runs | target |\n"
          "|---|---|---|---|---:|---:|---:|---|")


def _fmt(value: float) -> str:
    if value == 0 or 0.01 <= abs(value) < 1e5:
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{value:.2e}"


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """The ratio of each interleaved pair (repeat i of one candidate against repeat i of the
    other), so the spread is the spread of the ratio, not of either time."""
    return [n / d for n, d in zip(numerators, denominators, strict=True)]


def interleaved(candidates: dict[str, Callable[[], object]], repeats: int,
                warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each call of each candidate: ``warmup`` untimed rounds, then ``repeats``
    rounds in which every candidate runs once, in turn."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            synchronize()
            times[name].append(time.perf_counter() - start)
    return times


def best_of_three(call: Callable[[], object]) -> float:
    """Seconds of the fastest of three calls of ``call()`` (each waiting for the GPU's kernels,
    where there is one)."""
    times = []
    for _ in range(3):
        synchronize()
        start = time.perf_counter()
        call()
        synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def synchronize() -> None:
    """Wait for the GPU's queued kernels, where a benchmark runs on one (a timer read before
    that would time the launches, not the work)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def flwr_run(env: dict[str, str], app: Path, overrides: dict, timeout: float = 900) -> None:
    """``flwr run APP local-deployment --stream`` with ``overrides`` (raises with the output's
    tail where it fails, or dpfl refused the configuration)."""
    import subprocess

    from dpfl.config import format_overrides
    from dpfl.federation import BIN, CONNECTION

    done = subprocess.run([str(BIN / "flwr"), "run", str(app), CONNECTION, "--stream",
                           "--run-config", format_overrides(overrides)],
                          env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0 or "dpfl: error" in done.stdout:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])


def round_seconds(run_folder: Path) -> list[float]:
    """The seconds of every round of the run whose results folder is ``run_folder`` (its
    ``rounds.jsonl``; the round driver's clock, evaluation included where a round evaluates)."""
    lines = (run_folder / "rounds.jsonl").read_text().splitlines()
    return [json.loads(line)["seconds"] for line in lines]


def scratch(prefix: str) -> Path:
    """A fresh temporary folder for a benchmark's runs, removed when the benchmark exits."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def arguments(description: str, device: bool = False) -> argparse.ArgumentParser:
    """A benchmark's parser: ``--rows FILE`` (append the rows there), ``--quick``, and with
    ``device`` ``--device cpu|cuda`` (where its models run)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rows", type=Path, default=None,
                        help="append this benchmark's table rows to FILE (JSON lines)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller sizes")
    if device:
        parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                            help="where the models run (default cpu)")
    return parser


def parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser``'s arguments; ``--device cuda`` without a CUDA device exits in one line."""
    args = parser.parse_args()
    if getattr(args, "device", "cpu") == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: --device cuda, but torch sees no CUDA device\n")
    return args


def emit(rows: Sequence[Row], path: Path | None) -> None:
    """Print ``rows`` as Markdown, and append them to ``path`` (JSON lines) when given."""
    print(HEADER)
    for row in rows:
        print(row.markdown(), flush=True)
    if path is not None:
        name = Path(sys.argv[0]).stem
        with path.open("a") as out:
            out.write(_lines(replace(row, benchmark=row.benchmark or name) for row in rows))


def save(rows: Sequence[Row], path: Path) -> None:
    """Write ``rows`` to ``path`` (JSON lines), replacing what it held."""
    path.write_text(_lines(rows))


def _lines(rows: Iterable[Row]) -> str:
    return "".join(json.dumps(asdict(row)) + "\n" for row in rows)


def load(path: Path) -> list[Row]:
    return [Row(**json.loads(line)) for line in path.read_text().splitlines() if line]
