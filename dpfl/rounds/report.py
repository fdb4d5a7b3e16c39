"""The report writer: a run's results folder as the rounds go (its records, one console line
a round, the summary, model and plots at the end) and its clock."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from dpfl.config import format_overrides
from dpfl.problem import Problem
from dpfl.results import ResultsWriter
from dpfl.rounds.evaluation import SERVER_SETS
from dpfl.rounds.monitor import say
from dpfl.rounds.statements import SEEDED, UNPROTECTED

log = logging.getLogger("dpfl")


class ReportWriter:
    """Writes one run's results folder ``path`` (:class:`~dpfl.results.ResultsWriter`; its
    ``summary.png`` only where ``plot``) and, when ``echo``, says what it writes on the
    console."""

    def __init__(self, problem: Problem, runtime: str, path: Path, echo: bool,
                 plot: bool = True) -> None:
        self.problem = problem
        self.runtime = runtime
        self.path = path
        self.echo = echo
        self.plot = plot
        self.records: list[dict[str, Any]] = []
        self.last_eval: dict[str, Any] = {}  # the latest evaluation's values
        self.results: ResultsWriter | None = None
        self.first_round = 1
        self.earlier_seconds = 0.0  # wall time of the rounds a resumed run took over
        self.earlier_cpu: float | None = 0.0  # their CPU time (None: a checkpoint without it)
        self.started = time.perf_counter()
        self.cpu_started = time.process_time()

    def open(self, meta: dict[str, Any]) -> None:
        """Create the results folder with ``meta`` (a resumed run's: reopen it with its
        records) and say which defaults the run chose, and what it does not protect."""
        resumed = self.first_round > 1
        self.results = ResultsWriter(self.path, self.problem.config, meta,
                                     self.records if resumed else None)
        config, name = self.problem.config, self.problem.algorithm.name
        chosen = {k: config[k] for k in config.automatic if k in config.reads and config[k] != ""}
        if self.echo and chosen:
            print(f"{name}'s defaults: {format_overrides(chosen)}", flush=True)
        if self.echo and resumed:
            print(f"resuming {self.path} after round {self.first_round - 1}", flush=True)
        if meta["privacy"]["note"] in UNPROTECTED:
            say(meta["privacy"]["note"], self.echo)

    def start_clock(self) -> None:
        """The rounds start now (their ETA, and the run's wall and CPU time, count from
        here)."""
        self.started = time.perf_counter()
        self.cpu_started = time.process_time()

    def wall_seconds(self) -> float:
        """The run's wall time so far, a resumed run's earlier attempts up to their
        checkpoint included."""
        return self.earlier_seconds + time.perf_counter() - self.started

    def cpu_seconds(self) -> float | None:
        """The CPU time this process (every thread of it) spent on the run so far, a resumed
        run's earlier attempts included; None where their checkpoint predates this count.
        Unlike the wall time, a run paused or suspended does not add to it; under Flower it is
        the ServerApp's alone (the clients compute in other processes)."""
        if self.earlier_cpu is None:
            return None
        return self.earlier_cpu + time.process_time() - self.cpu_started

    def add(self, record: dict[str, Any]) -> None:
        """Append round ``record`` (to ``rounds.jsonl``, and the console)."""
        self.records.append(record)
        assert self.results is not None, "open() first"
        self.results.add_round(record)
        if self.echo:
            print(self.describe(record), flush=True)

    def describe(self, r: dict[str, Any]) -> str:
        """The console line of round record ``r``."""
        rounds = self.problem.config.run.num_server_rounds
        parts = [f"round {r['round']:>{len(str(rounds))}}/{rounds}"]
        if r.get("train_loss") is not None:
            parts.append(f"train loss {r['train_loss']:.4f}")
        for name in SERVER_SETS:
            if f"{name}_loss" in r:
                acc = r.get(f"{name}_accuracy")
                parts.append(f"{name} loss {r[f'{name}_loss']:.4f}"
                             + (f" acc {100 * acc:5.2f}%" if acc is not None else ""))
        parts.append(f"ε max {r['epsilon_max']:.4g} (δ={self.problem.config.privacy.delta:g})")
        elapsed = time.perf_counter() - self.started
        left = elapsed / (r["round"] - self.first_round + 1) * (rounds - r["round"])
        parts.append(f"{r['seconds']:.2f} s" + (f", ETA {left:.0f} s" if left else ""))
        return " | ".join(parts)

    def finish(self, summary: dict[str, Any], params: torch.Tensor) -> None:
        """Write ``summary``, the model ``params`` and the plots, and close the folder."""
        p, cfg = self.problem, self.problem.config
        data = p.dataset
        privacy = cfg.privacy
        title = (f"{p.algorithm.name} on {cfg.data.dataset}, {p.num_clients} clients · "
                 f"ε = {summary['epsilon_max']:.4g} (δ = {privacy.delta:g}, "
                 f"{privacy.accountant}) · seed {cfg.run.seed} · {self.runtime}")
        chance = 1 / data.num_classes if data.task == "classification" else (
            0.5 if data.task == "binary" else None)
        assert self.results is not None, "open() first"
        model = p.model.load_into(params)
        # frozen parameters (a pretrained encoder under adapters) are the model callable's own,
        # the same in every run: model.pt keeps what the run trained, and the buffers
        frozen = {name for name, q in model.named_parameters() if not q.requires_grad}
        self.results.finish(summary, {k: v for k, v in model.state_dict().items()
                                      if k not in frozen}, title=title, chance=chance,
                            plot=self.plot)
        if self.echo:
            stop = summary["stopped_early"]
            print(f"done: {summary['rounds_completed']} rounds in {summary['wall_seconds']:.1f} "
                  f"s{f' (stopped: {stop})' if stop else ''}; results in {self.path}", flush=True)
            note = summary["privacy"]["note"]
            split = summary.get("secure_aggregation", {}).get("distributed_noise")
            if split:
                print(f"distributed noise: ε={summary['epsilon_max']:.4g} against a server that "
                      f"sees only sums of at least {split['min_survivors']} clients' uploads, "
                      f"ε={split['epsilon_if_unmasked']:.4g} against one that reads a client's "
                      f"upload alone", flush=True)
            for line in (summary["calibration_check"],
                         f"WARNING: {note}" if note in UNPROTECTED else
                         f"note: {note}" if note == SEEDED else None):
                if line:
                    print(line, flush=True)
        log.info("results written to %s", self.path)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the report."""
        return {"records": self.records, "last_eval": self.last_eval,
                "wall_seconds": self.wall_seconds(), "cpu_seconds": self.cpu_seconds()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.records = list(saved["records"])
        self.last_eval = dict(saved["last_eval"])
        self.earlier_seconds = float(saved["wall_seconds"])
        cpu = saved.get("cpu_seconds")  # absent from checkpoints written before it was kept
        self.earlier_cpu = None if cpu is None else float(cpu)
        self.first_round = int(saved["round"]) + 1
