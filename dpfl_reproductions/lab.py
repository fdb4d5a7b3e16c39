"""``Lab``: runs an experiment's engine configurations and writes its report.

An experiment (``dpfl reproduce <paper> <experiment>``) is a function of a
``Lab``. The lab runs configurations through the engine — in parallel worker
processes, one torch thread each — under ``<results-dir>/reproduce-<paper>-<experiment>/``,
names each run by a hash of its configuration and reuses a run that already
finished there, so an interrupted sweep resumes where it stopped. Tables and
figures go to ``report.md`` next to the runs, with the wall time.

Every report comes with ``runs.jsonl.gz``, the archive of the runs behind it: one line per
run with its key, its configuration and the summary fields experiments read
(:data:`ARCHIVED`, with the numbers an experiment derives from its rounds).
``dpfl reproduce --reuse ARCHIVE`` counts an archived run as finished, so
a report can be regenerated or extended on another machine, or in a later session, without
running again what is archived (the committed ``reports/`` keep theirs). The archive is
rewritten as each run finishes, so an interrupted sweep leaves one of every run it finished,
and the lab reads its own folder's archive when it starts: a sweep run again resumes.

A planning lab (``plan=True``, ``dpfl reproduce --plan``) runs and writes nothing: the
experiment goes through its stages (each call of :meth:`Lab.run_many` or
:meth:`Lab.run_batched`) on their finished runs, and at the first stage with runs left to do
the lab raises :class:`Pending`, which says how many and what they would cost (by the
experiment's cost model where it gives one, else at the finished runs' pace). Later stages are
not counted: which runs they hold depends on that stage's results.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import io
import json
import math
import multiprocessing
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dpfl.algorithms.tuned import followed_keys  # noqa: E402
from dpfl.config import Value  # noqa: E402
from dpfl.errors import UsageError  # noqa: E402
from dpfl.runconfig import ALGORITHMS, RunConfig  # noqa: E402

ARCHIVE = "runs.jsonl.gz"
# the run-config keys that fix a run's dataset (checked once per distinct value before a sweep)
DATA_KEYS = ("dataset", "dataset-options", "data-dir", "download", "seed")
# The summary fields an archive keeps: what experiments and reports read of a finished run.
ARCHIVED = ("rounds_completed", "stopped_early", "test_loss", "test_accuracy", "validation_loss",
            "validation_accuracy", "epsilon_max", "wall_seconds", "seconds_per_round",
            "cpu_seconds", "calibration_check", "secure_aggregation", "derived")


def _leave_interruptions_to_the_sweep() -> None:
    """A worker leaves interruptions to the sweep's process (:func:`worker_pool`): it ignores
    Ctrl-C, and SIGTERM, which that process sends it, ends it at once (a forked worker would
    otherwise keep that process's own SIGTERM handler: :mod:`dpfl.interrupt`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def worker_pool(count: int) -> Iterator[ProcessPoolExecutor]:
    """``count`` worker processes for runs: forked (quick to start), or spawned where there is
    a CUDA device: once this process has asked the driver anything (``torch.cuda.is_available()``
    does, before any tensor is on the GPU), a forked child can no longer initialise CUDA.

    Interrupted (Ctrl-C, SIGTERM), the sweep stops at once: the runs not started are cancelled
    and the workers ended, their runs under way left without a ``summary.json``, so that the
    next sweep runs them again (:meth:`Lab.run_many`)."""
    method = "spawn" if torch.cuda.is_available() else "fork"
    with ProcessPoolExecutor(max_workers=count, mp_context=multiprocessing.get_context(method),
                             initializer=_leave_interruptions_to_the_sweep) as pool:
        try:
            yield pool
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)
            for worker in multiprocessing.active_children():
                worker.terminate()
            raise


def run_key(values: dict[str, Value]) -> str:
    """A stable name for a configuration."""
    text = json.dumps(values, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def read_archive(path: Path) -> dict[str, dict[str, Any]]:
    """The runs of an archive written by :meth:`Lab.write`: key -> ``{"config", "summary"}``.
    A file that is not one, or a record whose key is not its configuration's, is refused
    (:class:`UsageError`, naming ``--reuse``)."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        runs = {r["key"]: {"config": r["config"], "summary": r["summary"]} for r in records}
    except (OSError, EOFError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--reuse {path}: not a run archive written by dpfl reproduce "
                         f"({type(exc).__name__}: {exc})") from None
    for key, run in runs.items():
        if run_key(run["config"]) != key:
            raise UsageError(f"--reuse {path}: run {key} does not match its configuration "
                             f"(edited or corrupted archive)")
    return runs


def write_archive(path: Path, runs: dict[str, tuple[dict[str, Value], dict[str, Any]]]) -> Path:
    """Write ``runs`` (key -> (configuration, summary)) to the archive ``path``: one line per
    run, by key, with its configuration and its :data:`ARCHIVED` summary fields; byte-stable
    (sorted, no time stamp in the header) and replaced whole (never half-written)."""
    lines = [json.dumps({"key": key, "config": config,
                         "summary": {k: summary[k] for k in ARCHIVED if k in summary}},
                        sort_keys=True)
             for key, (config, summary) in sorted(runs.items())]
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as f:
        f.write("".join(line + "\n" for line in lines).encode())
    partial = path.with_name(path.name + ".part")
    partial.write_bytes(buffer.getvalue())
    os.replace(partial, path)
    return path


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One torch thread inside (a worker's share of the cores); the caller's count after, so
    that runs made in the calling process later keep theirs (a thread count can change a
    result's last bits)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_one(values: dict[str, Value]) -> dict[str, Any]:
    from dpfl.engine import run

    try:
        with one_thread():
            return run(RunConfig(values), echo=False, plot=False)
    except KeyboardInterrupt:  # the run closed its folder, stopped early: not a finished run,
        # which the next sweep runs again
        (Path(str(values["results-dir"])) / str(values["run-name"]) / "summary.json").unlink(
            missing_ok=True)
        raise


def _simulate(simulate: Callable[[list[dict[str, Value]]], list[dict[str, Any]]],
              group: list[dict[str, Value]]) -> list[dict[str, Any]]:
    with one_thread():
        return simulate(group)


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds:.0f} s"


def clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


class Progress:
    """One line per finished run of a sweep: how many are done, the elapsed time, the time
    left at the pace so far, the run's final test accuracy and the best so far."""

    def __init__(self, total: int) -> None:
        self.total, self.count, self.best = total, 0, None
        self.started = time.monotonic()

    def done(self, summary: dict[str, Any]) -> None:
        self.count += 1
        elapsed = time.monotonic() - self.started
        left = elapsed / self.count * (self.total - self.count)
        accuracy = summary.get("test_accuracy")
        line = f"[{self.count}/{self.total}] elapsed {clock(elapsed)}, ETA {clock(left)}"
        if accuracy is not None and math.isfinite(accuracy):
            self.best = max(self.best or accuracy, accuracy)
            line += f" | this run {100 * accuracy:.2f}%, best so far {100 * self.best:.2f}%"
        print(line, flush=True)


class Pending(Exception):
    """A planning lab's stop (:class:`Lab`, ``plan=True``): stage ``stage`` (counted from 1) has
    ``todo`` of its ``total`` configurations left to run, every run of the stages before it is
    finished. ``estimate``: single-thread seconds of ``todo`` by ``source`` (the experiment's
    cost model, or the finished runs' pace: :func:`seconds_at_pace`), None where neither
    gives one."""

    def __init__(self, stage: int, total: int, todo: Sequence[dict[str, Value]],
                 estimate: float | None, source: str, workers: int) -> None:
        super().__init__(f"stage {stage}: {len(todo)} of {total} runs to do")
        self.stage, self.total, self.todo = stage, total, list(todo)
        self.estimate, self.source, self.workers = estimate, source, workers

    def describe(self) -> str:
        lines = [f"- stages with every run finished: {self.stage - 1}",
                 (f"- stage {self.stage}, the first with runs to do: {len(self.todo)} of its "
                  f"{self.total} runs")]
        if self.estimate is None:
            lines.append(f"  no estimate: {self.source}")
        else:
            lines.append(f"  ≈ {_duration(self.estimate)} of single-thread run time "
                         f"({self.source}), ≈ {_duration(self.estimate / self.workers)} on "
                         f"{self.workers} worker{'s' if self.workers > 1 else ''}")
        lines.append("- the stages after it depend on its results: not counted")
        return "\n".join(lines)


#: what a run's pace depends on most (:func:`seconds_at_pace`), finest first
PACE_KEYS = (("algorithm", "dataset", "model", "dataset-options", "batch-size", "local-steps",
              "num-partitions"), ("algorithm", "dataset", "model"))


def seconds_at_pace(todo: Sequence[dict[str, Value]],
                    finished: Sequence[tuple[dict[str, Value], dict[str, Any]]]) -> float | None:
    """Single-thread seconds of the runs ``todo``: each run's rounds (``num-server-rounds``)
    times the median seconds per round (wall seconds over rounds completed) of the
    ``finished`` runs (configuration, summary) that share its values of the first of
    :data:`PACE_KEYS` any finished run shares; None where a run shares none."""
    paces: list[dict[tuple[str, ...], list[float]]] = [{} for _ in PACE_KEYS]
    for config, summary in finished:
        wall, rounds = summary.get("wall_seconds"), summary.get("rounds_completed")
        if wall and rounds:
            for keys, by_kind in zip(PACE_KEYS, paces, strict=True):
                kind = tuple(str(config.get(k)) for k in keys)
                by_kind.setdefault(kind, []).append(float(wall) / float(rounds))
    total = 0.0
    for config in todo:
        pace = next((statistics.median(by_kind[kind]) for keys, by_kind in zip(
            PACE_KEYS, paces, strict=True)
            if (kind := tuple(str(config.get(k)) for k in keys)) in by_kind), None)
        if pace is None:
            return None
        total += pace * float(RunConfig(config)["num-server-rounds"])
    return total


class Lab:
    """Runs and reports one experiment."""

    def __init__(self, folder: Path, *, smoke: bool, workers: int = 1,
                 only: dict[str, list[str]] | None = None,
                 reuse: Sequence[Path] = (), plan: bool = False) -> None:
        """``reuse``: archives (``runs.jsonl.gz``) whose runs count as finished. ``plan``: run
        and write nothing, raise :class:`Pending` at the first stage with runs to do."""
        self.folder = folder
        self.plan = plan
        self.stages = 0  # calls of run_many / run_batched so far
        self.smoke = smoke
        self.workers = max(1, workers)
        self.only = dict(only or {})
        self.archived: dict[str, dict[str, Any]] = {}
        for path in reuse:
            self.archived.update(read_archive(Path(path)))
        own = read_archive(folder / ARCHIVE) if (folder / ARCHIVE).exists() else {}
        self.archived.update(own)
        # the folder's own archive, kept whole by every rewrite until the report is written:
        # a sweep stopped early must not lose the runs of a stage it has not reached again
        self.kept = {k: (r["config"], r["summary"]) for k, r in own.items()}
        # every run reported on: key -> (its configuration, its summary)
        self.used: dict[str, tuple[dict[str, Value], dict[str, Any]]] = {}
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
    def _stage(self, configs: Sequence[dict[str, Value]], todo: Sequence[dict[str, Value]],
               cost: Callable[[list[dict[str, Value]]], float] | None = None,
               batched: bool = False) -> None:
        """Count a stage; a planning lab stops at the first with runs to do (:class:`Pending`),
        its estimate by ``cost`` (the experiment's cost model: single-thread seconds of a list
        of configurations) where given, else, for runs that are not batched, at the finished
        runs' pace."""
        self.stages += 1
        if not (self.plan and todo):
            return
        for c in todo:
            RunConfig(c)  # a plan validates what it would run
        if cost is not None:
            estimate, source = cost(list(todo)), "by the experiment's cost model"
        elif batched:
            estimate, source = None, ("batched runs share their work, so a finished run's "
                                      "time is no pace for another, and this experiment gives "
                                      "no cost model")
        else:
            known = {k: (r["config"], r["summary"]) for k, r in self.archived.items()}
            known.update(self.used)
            estimate = seconds_at_pace(todo, list(known.values()))
            source = ("at the finished runs' seconds per round" if estimate is not None else
                      "a run to do has no finished run of its algorithm, dataset and model "
                      "to go by")
        raise Pending(self.stages, len(configs), todo, estimate, source, self.workers)

    def _check(self, configs: Sequence[dict[str, Value]]) -> None:
        """Validate ``configs`` and load each distinct dataset once, before anything is run or
        written: bad input, or data that is not there, stops the experiment with its one line
        (:class:`~dpfl.errors.ConfigError`)."""
        from dpfl.problem import dataset_of

        seen = set()
        for values in configs:
            config = RunConfig(values)
            name = str(config["algorithm"])
            follows = followed_keys(name) if float(config["noise-multiplier"]) < 0 else set()
            tuned = set(config.automatic) & (set(ALGORITHMS.get(name).defaults) | follows)
            if tuned:  # an archived run must not change meaning when the defaults are retuned
                raise ValueError(f"an experiment leaves {', '.join(sorted(tuned))} to "
                                 f"{config['algorithm']}'s defaults: give them")
            key = tuple(str(config[k]) for k in DATA_KEYS)
            if key not in seen:
                seen.add(key)
                dataset_of(config)

    def _values(self, values: dict[str, Value]) -> dict[str, Value]:
        RunConfig(values)  # validate before anything runs
        values = dict(values)
        key = run_key(values)
        values.update({"results-dir": str(self.folder / "runs"), "run-name": key})
        return values

    def summary(self, values: dict[str, Value]) -> dict[str, Any] | None:
        """The run's summary: its folder's, else its archived fields (:data:`ARCHIVED`), else
        None (not finished)."""
        key = run_key(values)
        path = self.folder / "runs" / key / "summary.json"
        if path.exists():
            return json.loads(path.read_text())
        archived = self.archived.get(key)
        return dict(archived["summary"]) if archived is not None else None

    def run_many(self, configs: Sequence[dict[str, Value]], *, rounds: bool = False,
                 derive: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
                 ) -> list[dict[str, Any]]:
        """Run every configuration not already finished; summaries in the given order.

        ``rounds``: the caller reads the runs' ``rounds.jsonl`` (:meth:`rounds`), which an
        archive does not keep, so archived runs without a folder here run again.
        ``derive``: numbers the caller computes from a run's rounds (e.g. E1's gradient norm
        over the last iterations), put in its summary under ``"derived"`` and archived with
        it, so that an archived run serves without its rounds."""
        def finished(c: dict[str, Value]) -> bool:
            if (self.folder / "runs" / run_key(c) / "summary.json").exists():
                return True
            archived = self.archived.get(run_key(c))
            return archived is not None and not rounds and (
                derive is None or "derived" in archived["summary"])

        todo = [c for c in configs if not finished(c)]
        self._stage(configs, todo)
        self._check(todo)
        for c in todo:  # a half-written folder from an interrupted run is started again
            folder = self.folder / "runs" / run_key(c)
            if folder.exists():
                for f in folder.iterdir():
                    f.unlink()
                folder.rmdir()
        prepared = [self._values(c) for c in todo]  # all validated before the first run
        if todo:
            self.folder.mkdir(parents=True, exist_ok=True)

        recorded: dict[str, dict[str, Any]] = {}

        def record(c: dict[str, Value]) -> dict[str, Any]:
            key = run_key(c)
            if key not in recorded:
                summary = self.summary(c) or {}
                if derive is not None and "derived" not in summary:
                    summary["derived"] = derive(self.rounds(c))
                recorded[key] = summary
                self.used[key] = (dict(c), summary)
            return recorded[key]

        # Each run is archived as it finishes, so an interrupted sweep leaves an archive of
        # what it finished (``--reuse`` resumes from it on another machine); the runs finished
        # before are recorded first, so that every rewrite keeps them.
        for c in configs:
            if finished(c):
                record(c)
        progress = Progress(len(todo))
        if self.workers == 1 or len(prepared) <= 1:
            for c, v in zip(todo, prepared, strict=True):
                _run_one(v)
                progress.done(record(c))
                self.write_archive()
        else:
            with worker_pool(self.workers) as pool:
                futures = {pool.submit(_run_one, v): c for c, v in zip(todo, prepared,
                                                                       strict=True)}
                for future in as_completed(futures):
                    future.result()
                    progress.done(record(futures[future]))
                    self.write_archive()
        return [record(c) for c in configs]

    def run_batched(self, configs: Sequence[dict[str, Value]], *,
                    federation: Callable[[dict[str, Value]], Any],
                    simulate: Callable[[list[dict[str, Value]]], list[dict[str, Any]]],
                    cost: Callable[[list[dict[str, Value]]], float] | None = None,
                    ) -> list[dict[str, Any]]:
        """Like :meth:`run_many`, for configurations a batched simulator runs together (e.g.
        :func:`~dpfl_reproductions.least_squares.simulate`): the unfinished ones are grouped by
        ``federation(config)`` (what a group shares), each group is one job of the worker pool,
        and each configuration's summary is archived as its group finishes (no run folders).
        ``cost``: the simulator's cost model (single-thread seconds of a list of
        configurations), for a planning lab's estimate."""
        todo: dict[Any, list[dict[str, Value]]] = {}
        for c in configs:
            key = run_key(c)
            if key in self.archived and key not in self.used:  # kept by every rewrite below
                self.used[key] = (dict(c), dict(self.archived[key]["summary"]))
            elif key not in self.used:
                todo.setdefault(federation(c), []).append(dict(c))
        self._stage(configs, [c for group in todo.values() for c in group], cost, batched=True)
        self._check([c for group in todo.values() for c in group])
        if todo:
            self.folder.mkdir(parents=True, exist_ok=True)

        def record(group: list[dict[str, Value]], summaries: list[dict[str, Any]]) -> None:
            for c, summary in zip(group, summaries, strict=True):
                self.used[run_key(c)] = (c, summary)
            self.write_archive()

        groups = list(todo.values())
        if self.workers == 1 or len(groups) <= 1:
            for group in groups:
                record(group, _simulate(simulate, group))
        else:
            with worker_pool(self.workers) as pool:
                futures = {pool.submit(_simulate, simulate, g): i for i, g in enumerate(groups)}
                for future in as_completed(futures):
                    record(groups[futures[future]], future.result())
        return [self.used[run_key(c)][1] for c in configs]

    def run_seconds(self) -> float:
        """Single-thread run time behind the report: the runs' own wall times."""
        return sum(float(s.get("wall_seconds") or 0.0) for _, s in self.used.values())

    def cpu_seconds(self) -> float | None:
        """The runs' own CPU time (which a paused or suspended sweep does not inflate, as it
        does their wall time), where every run behind the report has it, else None (runs
        archived before runs counted it, batched simulators)."""
        cpu = [s.get("cpu_seconds") for _, s in self.used.values()]
        return None if None in cpu or not cpu else sum(float(c) for c in cpu)

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
        if self.plan:  # a planning lab writes nothing
            plt.close(fig)
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        if fig.get_layout_engine() is None:  # a figure laid out by its maker keeps its layout
            fig.tight_layout()
        fig.savefig(self.folder / f"{name}.png", dpi=110)
        plt.close(fig)
        self.sections.append(f"![{caption}]({name}.png)\n\n*{caption}*\n")

    def attach(self, name: str, text: str) -> None:
        """A file of the report beside ``report.md`` (e.g. a table as CSV or JSON); nothing
        in a planning lab."""
        if self.plan:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / name).write_text(text)

    def write(self, title: str) -> Path:
        """Write ``report.md``, ``report.json`` and the archive; returns the report's path
        (a planning lab writes nothing: an experiment that writes its report as each part
        finishes runs on)."""
        if self.plan:
            return self.folder / "report.md"
        wall = time.perf_counter() - self.started
        cpu = self.cpu_seconds()
        cpu_text = "" if cpu is None else f" ({_duration(cpu)} of CPU)"
        only = f"; restricted to {self.restriction()} (--only)" if self.only else ""
        header = (f"# {title}\n\nMode: {'smoke (reduced)' if self.smoke else 'full'}{only}; "
                  f"wall time of this invocation {wall:.1f} s on {os.cpu_count()} CPU cores "
                  f"({self.workers} worker processes; runs finished by an earlier invocation "
                  f"are reused, not re-timed). Compute behind this report: "
                  f"{len(self.used)} runs, {_duration(self.run_seconds())} of single-"
                  f"thread run time in total{cpu_text}; every run's configuration and result "
                  f"are in `{ARCHIVE}`.\n")
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "report.md"
        path.write_text("\n".join([header, *self.sections]))
        (self.folder / "report.json").write_text(json.dumps(
            {"title": title, "smoke": self.smoke, "wall_seconds": wall, "runs": len(self.used),
             "run_seconds": self.run_seconds(), "only": self.only,
             **({} if cpu is None else {"cpu_seconds": cpu})}, indent=2))
        self.write_archive(final=True)
        return path

    def write_archive(self, *, final: bool = False) -> Path:
        """``runs.jsonl.gz`` (:func:`write_archive`): every run reported on; until the report is
        written (not ``final``), also every run the folder's archive held before."""
        return write_archive(self.folder / ARCHIVE,
                             self.used if final else {**self.kept, **self.used})


def sweep_main(sweep: Callable[[Lab], Path], argv: list[str] | None, *, description: str,
               results: Path, smoke: str) -> int:
    """The command line of a sweep script of its own (an example's ``sweep.py``, outside ``dpfl
    reproduce``): ``--results-dir`` (default ``results``), ``--reuse ARCHIVE`` (repeatable:
    runs that count as finished), ``--workers``, and ``--smoke`` (``smoke`` says what it
    reduces; its lab writes to a ``smoke`` subfolder); runs ``sweep`` on that lab and prints
    the report's path."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--results-dir", type=Path, default=results)
    parser.add_argument("--reuse", type=Path, action="append", default=[],
                        help="an archive (runs.jsonl.gz) whose runs count as finished")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help=smoke)
    args = parser.parse_args(argv)
    folder = args.results_dir / ("smoke" if args.smoke else "")
    lab = Lab(folder, smoke=args.smoke, workers=args.workers, reuse=args.reuse)
    print(f"report: {sweep(lab)}")
    return 0
