"""``Lab``: runs an experiment's engine configurations and writes its report.

An experiment (``dpfl reproduce <paper> <experiment>``) is a function of a
``Lab``. The lab runs configurations through the engine — in parallel worker
processes, one torch thread each — under ``<results-dir>/reproduce-<paper>-<experiment>/``,
names each run by a hash of its configuration and reuses a run that already
finished there, so an interrupted sweep resumes where it stopped. Tables and
figures go to ``report.md`` next to the runs, with the wall time.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dpfl.config import RunConfig, Value  # noqa: E402
from dpfl.errors import UsageError  # noqa: E402


def run_key(values: dict[str, Value]) -> str:
    """A stable name for a configuration."""
    text = json.dumps(values, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _run_one(values: dict[str, Value]) -> dict[str, Any]:
    import torch

    from dpfl.engine import run

    torch.set_num_threads(1)
    return run(RunConfig(values), echo=False)


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds:.0f} s"


class Lab:
    """Runs and reports one experiment."""

    def __init__(self, folder: Path, *, smoke: bool, workers: int = 1,
                 only: dict[str, list[str]] | None = None) -> None:
        self.folder = folder
        self.smoke = smoke
        self.workers = max(1, workers)
        self.only = dict(only or {})
        self.used: dict[str, float] = {}  # run key -> its wall seconds, every run reported on
        self.sections: list[str] = []
        self.started = time.perf_counter()

    def restrict(self, axis: str, values: Sequence[Any]) -> list[Any]:
        """``values`` of ``axis`` kept by ``--only axis=v1,v2`` (all of them without it);
        numbers match by value (``27`` selects ``27.0``)."""
        wanted = self.only.get(axis)
        if wanted is None:
            return list(values)

        def same(value: Any, text: str) -> bool:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                try:
                    return float(text) == float(value)
                except ValueError:
                    return False
            return str(value) == text

        unknown = [w for w in wanted if not any(same(v, w) for v in values)]
        if unknown:
            allowed = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)
            raise UsageError(f"--only {axis}: unknown value {', '.join(unknown)} "
                             f"(allowed: {allowed})")
        return [v for v in values if any(same(v, w) for w in wanted)]

    def restriction(self) -> str:
        """The ``--only`` options in force, for the report ('' when none)."""
        return "; ".join(f"{k} = {', '.join(v)}" for k, v in self.only.items())

    # ---- runs ----------------------------------------------------------------------------
    def _values(self, values: dict[str, Value]) -> dict[str, Value]:
        RunConfig(values)  # validate before anything runs
        values = dict(values)
        key = run_key(values)
        values.update({"results-dir": str(self.folder / "runs"), "run-name": key})
        return values

    def summary(self, values: dict[str, Value]) -> dict[str, Any] | None:
        path = self.folder / "runs" / run_key(values) / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None

    def run_many(self, configs: Sequence[dict[str, Value]]) -> list[dict[str, Any]]:
        """Run every configuration not already finished; summaries in the given order."""
        todo = [c for c in configs if self.summary(c) is None]
        for c in todo:  # a half-written folder from an interrupted run is started again
            folder = self.folder / "runs" / run_key(c)
            if folder.exists():
                for f in folder.iterdir():
                    f.unlink()
                folder.rmdir()
        prepared = [self._values(c) for c in todo]  # all validated before the first run
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.workers == 1 or len(prepared) <= 1:
            for v in prepared:
                _run_one(v)
        else:
            with ProcessPoolExecutor(max_workers=self.workers) as pool:
                list(pool.map(_run_one, prepared))
        summaries = [self.summary(c) or {} for c in configs]
        for c, summary in zip(configs, summaries, strict=True):
            self.used[run_key(c)] = float(summary.get("wall_seconds") or 0.0)
        return summaries

    def rounds(self, values: dict[str, Value]) -> list[dict[str, Any]]:
        path = self.folder / "runs" / run_key(values) / "rounds.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    # ---- report --------------------------------------------------------------------------
    def text(self, markdown: str) -> None:
        self.sections.append(markdown.strip() + "\n")

    def table(self, title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        lines = [f"### {title}", "", "| " + " | ".join(header) + " |",
                 "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        self.sections.append("\n".join(lines) + "\n")

    def figure(self, name: str, fig: plt.Figure, caption: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(self.folder / f"{name}.png", dpi=110)
        plt.close(fig)
        self.sections.append(f"![{caption}]({name}.png)\n\n*{caption}*\n")

    def write(self, title: str) -> Path:
        wall = time.perf_counter() - self.started
        only = f"; restricted to {self.restriction()} (--only)" if self.only else ""
        header = (f"# {title}\n\nMode: {'smoke (reduced)' if self.smoke else 'full'}{only}; "
                  f"wall time of this invocation {wall:.1f} s on {os.cpu_count()} CPU cores "
                  f"({self.workers} worker processes; runs finished by an earlier invocation "
                  f"are reused, not re-timed). Compute behind this report: "
                  f"{len(self.used)} runs, {_duration(sum(self.used.values()))} of single-"
                  f"thread run time in total.\n")
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "report.md"
        path.write_text("\n".join([header, *self.sections]))
        (self.folder / "report.json").write_text(json.dumps(
            {"title": title, "smoke": self.smoke, "wall_seconds": wall, "runs": len(self.used),
             "run_seconds": sum(self.used.values()), "only": self.only}, indent=2))
        return path
