"""Regenerate every committed report from its own archive and compare its tables cell by cell.

    python reports/regenerate.py [NAME ...] [--timeout S] [--reports DIR]

For each folder of ``reports/`` written by ``dpfl reproduce`` (a ``report.json`` beside the
archive ``runs.jsonl.gz``), in a temporary folder:

1. ``dpfl reproduce PAPER EXPERIMENT --only … --reuse reports/NAME/runs.jsonl.gz --plan``, the
   ``--only`` restrictions read from the report's ``report.json`` (what the report was written
   with): a report whose regeneration would run anything (a stage with runs to do) is skipped,
   with the plan's line as the reason;
2. the same without ``--plan``, within ``--timeout`` seconds (a longer one is skipped;
   ``--runs`` regenerates a report whose plan has runs to do too, running them);
3. the regenerated ``report.md`` against the committed one: every committed table compared cell
   by cell (its header and cells) with the regenerated table of its title; a table the committed
   report predates (a section added since) is named, not compared; figures, the header (this
   invocation's wall time) and the prose between tables are not compared (prose that differs is
   counted, as a note).

A folder of two reports of one archive (``report-code.md`` and ``report-plain.md``, each with its
``report-*.json``) is two regenerations. Folders that are not such reports (lab notes, audits,
reports written before archives existed) are listed as skipped with the reason. The exit status
is 1 where any table differs, else 0. ``NAME`` restricts the check to those folders.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPORTS = Path(__file__).resolve().parent
ARCHIVE = "runs.jsonl.gz"
#: the experiment that wrote each report (reports/README.md gives the whole command line)
EXPERIMENTS = {
    "adaptive-interpolation": "adaptive interpolation",
    "adaptive-t1": "adaptive t1",
    "adaptive-t2": "adaptive t2",
    "adaptive-t3": "adaptive t3",
    "adaptive-t4": "adaptive t4",
    "benchmark-clients": "benchmark clients",
    "benchmark-epsilon": "benchmark epsilon",
    "benchmark-epsilon-fashion-mnist": "benchmark epsilon",
    "clip21-logreg": "clip21 logreg",
    "clip21-mnist-dp-epochs": "clip21 mnist-dp-epochs",
    "clip21-mnist-dp-epochs-unit": "clip21 mnist-dp-epochs-unit",
    "clip21-partial-epochs": "clip21 partial-epochs",
    "pcdp-centralized-fmnist": "pcdp centralized-fmnist",
    "pcdp-centralized-mnist": "pcdp centralized-mnist",
    "pcdp-centralized-mnist-seeds": "pcdp centralized-mnist",
    "pcdp-federated-fmnist": "pcdp federated-fmnist",
    "pcdp-federated-fmnist-gamma1": "pcdp federated-fmnist",
    "pcdp-federated-fmnist-tuned": "pcdp federated-fmnist-tuned",
    "pcdp-federated-mnist": "pcdp federated-mnist",
    "pcdp-federated-mnist-gamma1": "pcdp federated-mnist",
    "pcdp-federated-mnist-gamma50": "pcdp federated-mnist",
    "pcdp-federated-mnist-local": "pcdp federated-mnist-local",
    "pcdp-federated-mnist-probe": "pcdp federated-mnist",
    "pcdp-federated-mnist-projected-steps": "pcdp federated-mnist",
    "pcdp-federated-mnist-server-step": "pcdp federated-mnist",
    "pcdp-federated-mnist-tuned": "pcdp federated-mnist-tuned",
    "pcdp-noniid": "pcdp noniid",
    "pcdp-noniid-seeds": "pcdp noniid",
    "prisma-least-squares": "prisma least-squares",
    "prisma-least-squares-verdict": "prisma least-squares-verdict",
    "prisma-least-squares-verdict-accountant": "prisma least-squares-verdict",
    "secagg-gain": "secagg gain",
}


@dataclass(frozen=True)
class Table:
    """One table of a report: its ``### `` title, header and rows of cells."""

    title: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def cells(line: str) -> tuple[str, ...]:
    """The cells of a table line as :meth:`~dpfl_reproductions.lab.Lab.table` writes it."""
    return tuple(c.strip() for c in line.strip()[1:-1].split(" | "))


def tables(markdown: str) -> tuple[list[Table], list[str]]:
    """The tables of a report and its prose lines (neither the header paragraph, which states
    the invocation's wall time, nor figures)."""
    found: list[Table] = []
    prose: list[str] = []
    title, block = "", []
    lines = "".join(markdown.split("\n", 3)[3:]).splitlines() + [""]  # after the header
    for line in lines:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            found.append(Table(title, cells(block[0]),
                               tuple(cells(row) for row in block[2:])))
            block = []
        if line.startswith("### "):
            title = line[4:]
        elif line.strip() and not line.startswith("![") and not line.startswith("*"):
            prose.append(line)
    return found, prose


def matched(ours: list[Table], theirs: list[Table]
            ) -> tuple[list[tuple[Table, Table | None]], list[Table]]:
    """Each committed table with the regenerated one of its title, in order (None where there is
    none), and the regenerated tables no committed one matched (a section added since)."""
    pairs: list[tuple[Table, Table | None]] = []
    added: list[Table] = []
    k = 0
    for table in ours:
        j = next((j for j in range(k, len(theirs)) if theirs[j].title == table.title), None)
        if j is None:
            pairs.append((table, None))
            continue
        added += theirs[k:j]
        pairs.append((table, theirs[j]))
        k = j + 1
    return pairs, added + theirs[k:]


def differences(committed: str, regenerated: str, most: int = 10) -> list[str]:
    """Where the committed report's tables differ from the regenerated ones, cell by cell (at
    most ``most`` lines); a table only the regenerated report has is not a difference."""
    out = []
    for a, b in matched(tables(committed)[0], tables(regenerated)[0])[0]:
        if b is None:
            out.append(f"{a.title}: not in the regenerated report")
            continue
        if a.header != b.header:
            out.append(f"{a.title}: header {a.header} became {b.header}")
        if len(a.rows) != len(b.rows):
            out.append(f"{a.title}: {len(a.rows)} rows committed, {len(b.rows)} regenerated")
        for i, (x, y) in enumerate(zip(a.rows, b.rows, strict=False), start=1):
            for j, (u, v) in enumerate(zip(x, y, strict=False)):
                if u != v:
                    column = a.header[j] if j < len(a.header) else str(j)
                    out.append(f"{a.title}: row {i}, {column}: {u!r} became {v!r}")
            if len(x) != len(y):
                out.append(f"{a.title}: row {i} has {len(x)} cells, then {len(y)}")
    return out[:most] + ([f"… and {len(out) - most} more"] if len(out) > most else [])


@dataclass(frozen=True)
class Regeneration:
    name: str  # the folder, with the report's suffix where it holds several
    folder: Path
    report: str  # report.md, or report-<reading>.md
    experiment: str
    only: dict[str, list[str]]

    def command(self, results: Path, *, plan: bool) -> list[str]:
        only = [f"--only={axis}={','.join(values)}" for axis, values in self.only.items()]
        return [sys.executable, "-m", "dpfl", "reproduce", *self.experiment.split(), *only,
                "--reuse", str(self.folder / ARCHIVE), "--results-dir", str(results),
                "--workers", "1", *(["--plan"] if plan else [])]

    def shell(self) -> str:
        only = " ".join(f"--only {a}={','.join(v)}" for a, v in self.only.items())
        return (f"dpfl reproduce {self.experiment} {only} --reuse "
                f"reports/{self.folder.name}/{ARCHIVE}").replace("  ", " ")


def plan(root: Path, names: list[str]) -> tuple[list[Regeneration], list[tuple[str, str]]]:
    """The regenerations of the reports under ``root`` (only ``names`` where given) and the
    folders skipped, with why."""
    todo, skipped = [], []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        if names and folder.name not in names:
            continue
        written = sorted(folder.glob("report*.json"))
        if not written:
            skipped.append((folder.name, "not written by dpfl reproduce (no report.json): "
                                         "a lab note, an audit or single runs"))
        elif not (folder / ARCHIVE).exists():
            skipped.append((folder.name, "written before archives existed (no runs.jsonl.gz)"))
        elif folder.name not in EXPERIMENTS:
            skipped.append((folder.name, "not in regenerate.py's EXPERIMENTS"))
        else:
            for path in written:
                suffix = path.stem.removeprefix("report")
                todo.append(Regeneration(folder.name + suffix, folder, f"{path.stem}.md",
                                         EXPERIMENTS[folder.name],
                                         json.loads(path.read_text()).get("only") or {}))
    return todo, skipped


def _finished(command: list[str], timeout: float) -> subprocess.CompletedProcess[str] | None:
    """``command``'s completed process, or None where it ran past ``timeout`` seconds."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def regenerate(job: Regeneration, timeout: float, runs: bool = False, keep: Path | None = None
               ) -> tuple[str, list[str]]:
    """``("equal" | "differs" | "skipped" | "failed", details)`` of one regeneration; ``runs``:
    regenerate a report whose plan has runs to do too (they run, within ``timeout``);
    ``keep``: a folder to copy the regenerated report to (as ``<name>.md``)."""
    with tempfile.TemporaryDirectory(prefix="regenerate-") as tmp:
        results = Path(tmp)
        planned = _finished(job.command(results, plan=True), timeout)
        if planned is None:
            return "skipped", [f"its plan takes more than {timeout:g} s"]
        if planned.returncode != 0:
            return "failed", [f"--plan exited {planned.returncode}: "
                              f"{planned.stderr.strip().splitlines()[-1:]}"]
        pending = "stages is finished" not in planned.stdout
        if pending and not runs:
            todo = [line.strip("- ") for line in planned.stdout.splitlines() if "runs" in line]
            return "skipped", [f"would run again: {'; '.join(todo) or planned.stdout.strip()}"]
        done = _finished(job.command(results, plan=False), timeout)
        if done is None:
            return "skipped", [f"takes more than {timeout:g} s"]
        if done.returncode != 0:
            return "failed", [f"exited {done.returncode}: "
                              f"{done.stderr.strip().splitlines()[-1:]}"]
        written = next(results.glob("reproduce-*/report.md"))
        if (written.parent / "runs").exists() and not pending:
            return "failed", ["ran something its plan did not announce"]
        committed = (job.folder / job.report).read_text()
        regenerated = written.read_text()
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{job.name}.md").write_text(regenerated)
        found = differences(committed, regenerated)
        if found:
            return "differs", found
        (ours, prose), (theirs, again) = tables(committed), tables(regenerated)
        added = matched(ours, theirs)[1]
        changed = sum(a != b for a, b in zip(prose, again, strict=False))
        return "equal", [f"{len(ours)} tables" + "".join(
            f"; a table the committed report predates: {t.title!r}" for t in added)
            + (f"; {changed} prose lines differ" if changed else "")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help="report folders (default: all)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a regeneration may take (default 300)")
    parser.add_argument("--reports", type=Path, default=REPORTS,
                        help="the folder of reports (default: this script's)")
    parser.add_argument("--runs", action="store_true",
                        help="regenerate a report whose plan has runs to do too (they run)")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="copy each regenerated report to DIR/NAME.md")
    args = parser.parse_args(argv)
    todo, skipped = plan(args.reports, args.names)
    outcome = {}
    for job in todo:
        status, details = regenerate(job, args.timeout, args.runs, args.keep)
        outcome[job.name] = status
        print(f"{job.name}: {status} ({job.shell()})", flush=True)
        for line in details:
            print(f"  {line}", flush=True)
    for name, why in skipped:
        print(f"{name}: skipped ({why})", flush=True)
    counts = {s: sum(v == s for v in outcome.values()) for s in sorted(set(outcome.values()))}
    print("summary: " + ", ".join(f"{n} {s}" for s, n in counts.items())
          + f", {len(skipped)} folders not regenerable", flush=True)
    return 1 if any(s in ("differs", "failed") for s in outcome.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
