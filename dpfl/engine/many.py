"""Many runs of one algorithm as one batched computation: :func:`run_many`.

A sweep runs the same federation again and again with another seed, or another server step
size. :func:`run_many` runs such runs together: each keeps its own round loop (its problem,
ledger, evaluation and results folder, exactly as ``dpfl run`` writes them), and their client
steps are folded into one ``client_step`` call whose client axis holds every run's
participants, R·M *virtual clients*. Virtual client ``v`` is client ``c`` of run ``r``: it
draws from run ``r``'s keyed streams as client ``c`` (:class:`FoldRandomness`), reads run
``r``'s rows of the training data, holds run ``r``'s state of client ``c``, and receives run
``r``'s broadcast (the broadcast arrays get a leading client axis when the runs' models differ,
which the algorithm declares it accepts: ``Algorithm.per_client_broadcast``). The server steps,
d-sized, stay each run's own.

Equality. The engine computes every client's arithmetic on its own, in fixed chunks, so a
client's result does not depend on the others in its call; a folded run is therefore equal to
the same run done alone **bit for bit** (model, ledger ε, every round record but its
``seconds``; tests/test_many_runs.py). With ``engine-mode="fast"`` each run's pooled noise is
drawn for its own participants, from its own stream, as alone.

How the loops meet. Each run's round loop is a generator of requests
(:class:`~dpfl.rounds.RoundLoop`); :func:`run_fold` advances every live run to its next
exchange request (answering its other requests from its own clients, :class:`FoldedRun`), runs
the requests of one exchange as one folded step, sends every run its replies, and again, until
every run has ended. No threads: one core, as one run uses. An exchange whose folded step fails
(a client's upload is inf or NaN, say) is done again run by run, so that the failure reaches
only the run it belongs to, with the message it would have alone.

What may differ between the runs of one batch: :data:`FREE_KEYS` and the algorithm's
``server_keys`` (keys only its server step reads, e.g. the Clip21 family's ``learning-rate``).
Anything else is refused in one line naming the key (:class:`~dpfl.errors.ConfigError`).

Where it pays: the arithmetic is the same, so a batch saves only the per-call overhead of the
client step (its Python, its small tensor operations), which dominates tiny models (the
logistic regression of Clip21's E1) and vanishes on the MNIST MLP (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dpfl.algorithms import Cohort, State
from dpfl.config import Value
from dpfl.engine.runner import EngineTransport
from dpfl.errors import ConfigError
from dpfl.privacy import Randomness, Release, add_noise, stds
from dpfl.problem import Problem, build_problem
from dpfl.rounds import (
    ClientRuntime,
    Replies,
    RoundLoop,
    Rounds,
    per_client,
    sum_rows,
)
from dpfl.rounds.driver import Finished, advance
from dpfl.rounds.secure_sum import reduction
from dpfl.runconfig import ALGORITHMS, RunConfig

#: run-config keys the runs of one batch may differ in, whatever the algorithm: the seed, where
#: the results go, and what only the round loop or the calibration reads (each run keeps its own
#: releases; their sensitivities must agree, which is checked)
FREE_KEYS = ("seed", "run-name", "results-dir", "num-server-rounds", "eval-every", "epsilon",
             "delta", "noise-multiplier", "max-epsilon", "checkpoint-every")


def free_keys(algorithm: str) -> tuple[str, ...]:
    """The keys runs of ``algorithm`` may differ in and still share a batch."""
    return FREE_KEYS + tuple(ALGORITHMS.get(algorithm).server_keys)


def batch_key(values: dict[str, Value]) -> tuple[tuple[str, str], ...]:
    """What runs must share to run in one batch: every key of the validated ``values`` but the
    free ones (runs with equal keys can go to one :func:`run_many`)."""
    config = RunConfig(values)
    free = free_keys(config.run.algorithm)
    return tuple(sorted((k, repr(v)) for k, v in config.items() if k not in free))


def batchable(algorithm: str) -> bool:
    """Whether runs of ``algorithm`` can be batched (its client step takes one broadcast per
    client)."""
    return ALGORITHMS.get(algorithm).per_client_broadcast


class FoldRandomness(Randomness):
    """The keyed streams of a folded call: virtual client ``v`` draws from ``streams[v] =
    (its run's randomness, its client id)``, so it draws what that client of that run draws
    alone."""

    def __init__(self, streams: Sequence[tuple[Randomness, int]]) -> None:
        super().__init__(streams[0][0].seed, secure=streams[0][0].secure)
        self.streams = list(streams)

    def digest(self, client: int, server_round: int, purpose: str) -> bytes:
        rng, own = self.streams[client]
        return rng.digest(own, server_round, purpose)


@dataclass
class Request:
    """One run's exchange, waiting at the fold."""

    run: FoldedRun
    exchange: str
    server_round: int
    broadcast: State
    participants: list[int]

    def alone(self) -> Replies:
        """The exchange as ``dpfl run`` does it."""
        return self.run.send_and_receive(self.exchange, self.server_round, self.broadcast,
                                         self.participants)


class FoldedRun(EngineTransport):
    """One run's transport: its clients' states, as the engine keeps them (its exchanges are
    done in the fold's batched call, or alone: :meth:`Request.alone`)."""

    def __init__(self, problem: Problem, index: int) -> None:
        super().__init__(problem, pooled_noise=problem.config.run.engine_mode == "fast")
        self.index = index

    def keep(self, participants: list[int], rows: State) -> None:
        """Store the participants' new states ``rows`` (idle clients keep theirs)."""
        if len(participants) == self.problem.num_clients:
            self.states = {k: v.clone() for k, v in rows.items()}
            return
        positions = torch.tensor(participants, dtype=torch.long)
        for k, v in rows.items():
            self.states[k][positions] = v


class Fold:
    """The meeting point of the runs' round loops and their batched client steps."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = list(problems)
        self.runs = [FoldedRun(p, i) for i, p in enumerate(problems)]
        self.folded_calls = 0  # client_step calls made for several runs at once
        self.alone_calls = 0  # exchanges done again run by run (a folded step failed)
        self.x, self.y, self.indices = self._data()
        self._cohorts: dict[tuple[tuple[int, int], ...], Cohort] = {}
        self._quiet: dict[int, list[Release]] = {}

    def _data(self) -> tuple[torch.Tensor, torch.Tensor, list[list[torch.Tensor]]]:
        """The runs' training sets, each distinct one once, and every run's client rows in
        them."""
        sets: list[tuple[torch.Tensor, torch.Tensor]] = []
        offsets: list[int] = []
        indices = []
        for p in self.problems:
            x, y = p.dataset.train_x, p.dataset.train_y
            same = next((i for i, (sx, sy) in enumerate(sets)
                         if sx is x or (torch.equal(sx, x) and torch.equal(sy, y))), None)
            if same is None:
                same = len(sets)
                offsets.append(sum(len(sx) for sx, _ in sets))
                sets.append((x, y))
            indices.append([torch.from_numpy(part + offsets[same]) for part in p.partitions])
        if len(sets) == 1:
            return sets[0][0], sets[0][1], indices
        return (torch.cat([x for x, _ in sets]), torch.cat([y for _, y in sets]), indices)

    # ---- the meeting ---------------------------------------------------------------------
    def serve(self, pending: list[Request]) -> dict[int, Replies | Exception]:
        """Answer every pending request: one folded step per exchange (runs alone where it
        fails); each run's replies, or the exception its exchange raised."""
        groups: dict[tuple[str, int], list[Request]] = {}
        for request in pending:
            groups.setdefault((request.exchange, request.server_round), []).append(request)
        answers: dict[int, Replies | Exception] = {}
        for group in groups.values():
            try:
                answers.update(self.folded(group))
            except Exception:  # noqa: BLE001 - each run meets its own failure, alone
                for request in group:
                    self.alone_calls += 1
                    try:
                        answers[request.run.index] = request.alone()
                    except Exception as exc:  # noqa: BLE001
                        answers[request.run.index] = exc
        return answers

    # ---- the folded step -----------------------------------------------------------------
    def folded(self, group: list[Request]) -> dict[int, Replies]:
        """One ``client_step`` for the participants of every run in ``group``."""
        if len(group) == 1:
            return {group[0].run.index: group[0].alone()}
        self.folded_calls += 1
        table = [(request.run.index, c) for request in group for c in request.participants]
        first = group[0]
        pooled = first.run.clients.pooled_noise
        runtime = ClientRuntime(
            first.run.problem.algorithm,
            lambda v: self.releases(*table[v], quiet=pooled),
            FoldRandomness([(self.runs[r].clients.rng, c) for r, c in table]),
            device=first.run.problem.device, diagnostics=first.run.clients.diagnostics)
        states = {k: torch.cat([request.run.states[k][request.participants]
                                for request in group]) for k in first.run.states}
        uploads, rows, diagnostics = runtime.step(first.exchange, first.server_round,
                                                  self.broadcast(group, table), states,
                                                  self.cohort(table))
        spec = first.run.problem.algorithm.exchange(first.exchange)
        answers, start = {}, 0
        for request in group:
            run, ids = request.run, request.participants
            part = slice(start, start + len(ids))
            start += len(ids)
            own = {k: v[part].clone() for k, v in uploads.items()}
            if pooled:
                for key, upload in spec.uploads.items():
                    if not upload.sent_as_returned:
                        releases = [{r.name: r for r in run.problem.releases(c)}[upload.release]
                                    for c in ids]
                        own[key] = add_noise(own[key], ids, stds(releases), rng=run.clients.rng,
                                             server_round=request.server_round,
                                             stream=releases[0].stream, pooled=True)
            run.keep(ids, {k: v[part] for k, v in rows.items()})
            answers[run.index] = Replies(sum_rows(own, run.problem.device,
                                                  reduction(run.problem, first.exchange)),
                                         per_client(ids, {k: v[part]
                                                          for k, v in diagnostics.items()}))
        return answers

    def releases(self, run: int, client: int, *, quiet: bool) -> list[Release]:
        """Client ``client`` of run ``run``'s releases; ``quiet``: those the runtime noises
        carry no noise (fast mode: each run adds its pooled draw after the fold)."""
        releases = self.problems[run].releases(client)
        if not quiet:
            return releases
        key = id(releases)
        if key not in self._quiet:
            algorithm = self.problems[run].algorithm
            noised = {u.release for e in algorithm.exchanges for u in e.uploads.values()
                      if not u.sent_as_returned}
            self._quiet[key] = [dataclasses.replace(r, noise_multiplier=0.0)
                                if r.name in noised else r for r in releases]
        return self._quiet[key]

    def broadcast(self, group: list[Request], table: list[tuple[int, int]]) -> State:
        """Each broadcast array, once when every run sends the same, else one per virtual
        client ``[V, ...]``."""
        out = {}
        for key, value in group[0].broadcast.items():
            values = {request.run.index: request.broadcast[key] for request in group}
            if all(torch.equal(v, value) for v in values.values()):
                out[key] = value
            else:
                out[key] = torch.stack([values[r] for r, _ in table])
        return out

    def cohort(self, table: list[tuple[int, int]]) -> Cohort:
        """The virtual clients' data (cached per participant table)."""
        key = tuple(table)
        if key not in self._cohorts:
            self._cohorts[key] = Cohort(list(range(len(table))), self.x, self.y,
                                        [self.indices[r][c] for r, c in table])
        return self._cohorts[key]


# ---- checks -----------------------------------------------------------------------------------
def check_batch(configs: Sequence[RunConfig]) -> None:
    """Refuse, naming the key, runs that cannot share a batch (before anything is built)."""
    first = configs[0]
    name = first.run.algorithm
    if any(c.run.algorithm != name for c in configs):
        raise ConfigError("algorithm", "the runs of one batch run one algorithm",
                          allowed=name)
    if not batchable(name):
        allowed = sorted(n for n in ALGORITHMS.names() if batchable(n))
        raise ConfigError("algorithm", f"{name}'s client step takes one broadcast model, so "
                          f"its runs cannot be batched", allowed=allowed)
    free = free_keys(name)
    for config in configs[1:]:
        for key in first:
            if key not in free and config[key] != first[key]:
                raise ConfigError(key, f"differs between runs of one batch ({first[key]!r}, "
                                  f"{config[key]!r}); they may differ only in",
                                  allowed=", ".join(free))
    named = [(c.run.results_dir, c.run.run_name) for c in configs if c.run.run_name]
    if len(set(named)) < len(named):
        raise ConfigError("run-name", "two runs of one batch would write one results folder",
                          allowed="distinct names, or empty for automatic ones")


def check_problems(problems: Sequence[Problem]) -> None:
    """Refuse runs whose built problems cannot share client steps: seed-dependent frozen model
    layers or public records, a batch that is some clients' whole data and not others', or
    releases of different sensitivity."""
    first = problems[0]
    frozen = frozen_state(first)
    b = first.config.hyperparameters.batch_size
    sizes = [len(part) for p in problems for part in p.partitions]
    if len({size == b for size in sizes}) > 1:
        raise ConfigError("batch-size", f"{b} is the whole data of some clients of the batch "
                          f"and not of others (their sizes differ with the seed)",
                          allowed="runs whose clients all hold batch-size records, or none")
    for p in problems[1:]:
        theirs = frozen_state(p)
        if frozen.keys() != theirs.keys() or any(not torch.equal(v, theirs[k])
                                                 for k, v in frozen.items()):
            raise ConfigError("seed", "changes the model's frozen layers, which the runs' "
                              "client steps share", allowed="one seed for this model")
        if not same_public(first, p):
            raise ConfigError("seed", "changes the public records, which the runs' client "
                              "steps share", allowed="one seed for this dataset")
        for mine, theirs_ in zip(first.releases(0), p.releases(0), strict=True):
            if mine.sensitivity() != theirs_.sensitivity():
                raise ConfigError("learning-rate", f"changes the sensitivity of release "
                                  f"{mine.name!r}, which one batched step needs equal",
                                  allowed="runs of equal release radii")


def frozen_state(problem: Problem) -> dict[str, torch.Tensor]:
    """The model's non-trainable parameters and buffers."""
    module = problem.model.load_into(problem.x0)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    return {k: v for k, v in module.state_dict().items() if k not in trainable}


def same_public(a: Problem, b: Problem) -> bool:
    pa, pb = a.algorithm.public, b.algorithm.public
    if pa is None or pb is None:
        return pa is pb
    return all(torch.equal(u, v) for u, v in zip(pa, pb, strict=True))


# ---- the entry point --------------------------------------------------------------------------
def fold(configs: Sequence[RunConfig]) -> Fold:
    """The batch of ``configs``, checked and built (nothing run yet)."""
    check_batch(configs)
    problems = [build_problem(c) for c in configs]
    check_problems(problems)
    return Fold(problems)


def run_fold(batch: Fold, *, echo: bool = False) -> list[dict[str, Any]]:
    """Run every run of ``batch`` to its end; their summaries in order. A run's
    ``wall_seconds``, ``seconds_per_round`` and ``cpu_seconds`` are its share of the batch's
    (the runs advance together, so each one's own clocks run for the whole batch), in its
    summary and its ``summary.json``; its rounds' ``seconds`` are the batch's. Raises the
    first run's failure, in order, after every run has ended."""
    out: list[Any] = [None] * len(batch.runs)
    loops: dict[int, Rounds] = {}
    waiting: dict[int, Request] = {}

    def step(index: int, answer: Any = None, error: BaseException | None = None) -> None:
        """Take run ``index`` to its next exchange (waiting) or its end (``out``)."""
        run = batch.runs[index]
        try:
            if index not in loops:  # built in turn: automatic results folders get distinct names
                loops[index] = RoundLoop(run.problem, "engine", echo=echo).run()
            done = advance(loops[index], run, answer, error)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of run_many
            out[index] = exc
            return
        if isinstance(done, Finished):
            out[index] = done.summary
        else:
            waiting[index] = Request(run, done.exchange, done.server_round, done.broadcast,
                                     done.participants)

    started, cpu_started = time.perf_counter(), time.process_time()
    for index in range(len(batch.runs)):
        step(index)
    while waiting:
        pending = list(waiting.values())
        waiting.clear()
        for index, answer in sorted(batch.serve(pending).items()):
            if isinstance(answer, BaseException):
                step(index, error=answer)
            else:
                step(index, answer)
    for result in out:
        if isinstance(result, BaseException):
            raise result
    share = (time.perf_counter() - started) / len(out)
    cpu = (time.process_time() - cpu_started) / len(out)
    for summary in out:
        shares = {"wall_seconds": share, "cpu_seconds": cpu,
                  "seconds_per_round": share / max(summary["rounds_completed"], 1)}
        summary.update(shares)
        path = Path(summary["results"]) / "summary.json"
        written = json.loads(path.read_text())
        written.update(shares)
        path.write_text(json.dumps(written, indent=2))
    return out


def run_many(configs: Sequence[RunConfig], *, echo: bool = False) -> list[dict[str, Any]]:
    """Run ``configs`` (one algorithm; they may differ in :data:`FREE_KEYS` and the
    algorithm's ``server_keys``) as one batch: each run's summary, in order, equal to what
    :func:`dpfl.engine.run` returns for it but for its time (:func:`run_fold`), and its results
    folder as that writes it."""
    return run_fold(fold(configs), echo=echo) if configs else []


__all__ = ["FREE_KEYS", "Fold", "FoldRandomness", "batch_key", "batchable", "fold", "run_fold",
           "run_many"]
