"""The round loop: one run's rounds as a generator of requests, for every runtime.

:meth:`RoundLoop.run` yields what it needs from the clients — an :class:`ExchangeRequest` a
round's exchange, :class:`Begin` once, :class:`ClientStates` at a checkpoint — and is sent the
answers (or has the transport's exception thrown in). Whoever holds the generator decides how
requests reach clients: :func:`dpfl.rounds.drive` over one transport (the engine's clients in
this process, or Flower messages), :func:`dpfl.engine.many.run_fold` many runs' requests at
once. Each round it picks the participants, stops before a round that would take a
participant's ε past ``max-epsilon``, runs the algorithm's exchanges, applies ``server_step``
to the participants' sums, charges every participant's ledger, evaluates the global model on
the server's own data (:class:`~dpfl.rounds.evaluation.Evaluator`), checks the run
(:class:`~dpfl.rounds.monitor.RunMonitor`) and writes the results folder
(:class:`~dpfl.rounds.report.ReportWriter`).

With ``checkpoint-every`` it checkpoints the run (:class:`~dpfl.rounds.checkpointer.Checkpointer`),
and with ``resume=true`` it continues one from its checkpoint. A failure inside a round closes
the results folder before it propagates: the rounds completed, their model, and the ledgers with
the aborted exchange charged to everyone it was addressed to. Under Flower the server's ledger
is reconciled with the counts each client's node reports: what a node released beyond it (an
interrupted attempt's rounds, a round answered twice with fresh noise) is charged, and a node's
refusal charges every participant that did not refuse.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Generator, Mapping
from pathlib import Path
from typing import Any

import torch

from dpfl.algorithms import ServerContext, State, distinct_streams
from dpfl.errors import NonFiniteError
from dpfl.privacy import Accounting, Randomness
from dpfl.problem import Problem
from dpfl.rounds.checkpointer import Checkpointer
from dpfl.rounds.client import finite
from dpfl.rounds.evaluation import Evaluator
from dpfl.rounds.monitor import RunMonitor
from dpfl.rounds.report import ReportWriter
from dpfl.rounds.statements import (
    calibration_check,
    calibration_name,
    failure,
    noise_sources,
    privacy_statement,
    secure_aggregation_statement,
)
from dpfl.rounds.transport import (
    Begin,
    ClientRefused,
    ClientsLost,
    ClientStates,
    ExchangeRequest,
    Replies,
    Request,
)
from dpfl.runconfig import check_runtime

log = logging.getLogger("dpfl")

#: the generator :meth:`RoundLoop.run` returns: it yields requests, is sent their answers, and
#: returns the run's summary
Rounds = Generator[Request, Any, dict[str, Any]]


def payload(arrays: dict[str, torch.Tensor]) -> int:
    """Bytes of the arrays of one message (what one client sends or receives; the wire adds
    Flower's framing)."""
    return sum(a.numel() * a.element_size() for a in arrays.values())


def means(diagnostics: dict[int, dict[str, float]]) -> dict[str, float]:
    """Each diagnostic's mean over the clients that reported it (``-`` in names becomes
    ``_``), in client order: the mean is the same whatever order the replies came in."""
    out = {}
    for key in sorted({k for m in diagnostics.values() for k in m}):
        values = [diagnostics[c][key] for c in sorted(diagnostics) if key in diagnostics[c]]
        out[key.replace("-", "_")] = sum(values) / len(values)
    return out


def releases_of(problem: Problem) -> dict[str, Any]:
    """Every client's releases (and the server's), as the results folder and checkpoints keep
    them; for a population's clients, the rule (each calibrates from its own record count when
    it first takes part: listing a million would make each)."""
    out: dict[str, Any]
    if problem.population is not None:
        out = {"clients": POPULATION_RELEASES}
    else:
        out = {str(c): [r.record() for r in problem.releases(c)]
               for c in range(problem.num_clients)}
    if server := problem.server_releases():
        out["server"] = [r.record() for r in server]
    return out


#: what a population's results say of its clients' releases
POPULATION_RELEASES = ("each client's, calibrated from its own record count when it first "
                       "takes part (a population's clients are not listed)")


def population_epsilon(accounting: Accounting) -> dict[str, float]:
    """``epsilon_population``, the ε of every client ``epsilon`` does not list (those that
    released nothing of their own, under a population release), where there are any."""
    value = accounting.population_epsilon()
    return {} if value is None else {"epsilon_population": value}


def round_epsilon(accounting: Accounting) -> dict[str, Any]:
    """A round record's ε: of the clients charged in it (so that a record stays the size of its
    cohort however many clients took part before; summary.json lists them all), the
    population's, and the extremes over every client."""
    epsilon_max, epsilon_min = accounting.extremes()
    return {"epsilon": accounting.report(accounting.take_changed()),
            **population_epsilon(accounting), "epsilon_max": epsilon_max,
            "epsilon_min": epsilon_min}


def client_sizes(problem: Problem) -> list[int] | dict[str, int]:
    """Every client's record count; a population's size and fewest rows instead (its clients
    are made per round)."""
    if problem.population is None:
        return [len(part) for part in problem.partitions]
    return {"population": problem.num_clients, "fewest_rows": problem.population.smallest}


def without(ctx: ServerContext, gone: dict[int, str], where: str, min_clients: int,
            echo: bool) -> ServerContext:
    """``ctx`` for the participants that replied, when ``min_clients`` (0: all) allows going on
    without ``gone`` (client → why it is missing; ``where``: the round and exchange, for the
    messages); raises :class:`ClientsLost` otherwise. The rest of the round runs with the
    remaining participants only."""
    remaining = [c for c in ctx.participants if c not in gone]
    needed = min_clients or len(ctx.participants)
    reasons = "; ".join(f"clients {[c for c in sorted(gone) if gone[c] == why]}: {why}"
                        for why in dict.fromkeys(gone[c] for c in sorted(gone)))
    if len(remaining) < needed:  # needed ≥ 1: a round always has participants
        raise ClientsLost(f"{where}: {len(remaining)} of {len(ctx.participants)} participants "
                          f"replied and min-clients={min_clients} needs {needed} ({reasons})")
    message = (f"{where}: going on with {len(remaining)} of {len(ctx.participants)} "
               f"participants ({reasons})")
    if echo:
        print(f"WARNING: {message}", flush=True)
    log.warning(message)
    return dataclasses.replace(ctx, participants=remaining)


#: a caller's own evaluation of the global model: (round, x) → its metrics, or None
Evaluation = Callable[[int, torch.Tensor], Mapping[str, float] | None]

class RoundLoop:
    """One problem's run to the end (or to ``max-epsilon``), as a generator (:meth:`run`).

    ``runtime`` ('engine' or 'flower') names the results folder and refuses settings the
    runtime cannot honour; ``x0`` is the initial model (the problem's by default); ``echo``
    puts the rounds on the console and ``plot`` draws ``summary.png``. A run with
    ``resume=true`` is checked against its checkpoint here, before anything starts."""

    def __init__(self, problem: Problem, runtime: str, *, echo: bool = True, plot: bool = True,
                 x0: torch.Tensor | None = None, evaluate_fn: Evaluation | None = None) -> None:
        check_runtime(problem.config, runtime)
        self.problem = problem
        self.config = cfg = problem.config
        self.algorithm = problem.algorithm
        self.runtime = runtime
        start = problem.x0 if x0 is None else x0
        self.state = self.algorithm.init_server_state(start.to(problem.device))
        self.rng = Randomness(cfg.run.seed, secure=cfg.privacy.secure_noise)
        self.accounting = problem.accounting(limit=cfg.privacy.max_epsilon,
                                             also=self.algorithm.reported_accountants)
        self.checkpointer = Checkpointer(cfg, runtime)
        self.checkpointer.check_releases(releases_of(problem))
        self.monitor = RunMonitor(problem, echo)
        self.evaluate = Evaluator(problem)
        self.evaluate_fn = evaluate_fn  # the caller's own, on the global model: its record key
        self.report = ReportWriter(problem, runtime, self.checkpointer.path, echo, plot)
        self.echo = echo
        self.stop_reason = ""
        self.rounds_done = 0
        self.checked: set[tuple[str, ...]] = set()  # exchange sets whose streams are checked
        self.traffic: dict[str, int] = {}
        self.lost: dict[int, str] = {}  # this round's missing participants, and why
        self.pending: tuple[str, list[int]] | None = None  # the exchange under way, addressees
        self.noise: dict[int, str] = {}  # where each client's noise came from (Flower)

    @property
    def path(self) -> Path:
        """The run's results folder."""
        return self.checkpointer.path

    @property
    def records(self) -> list[dict[str, Any]]:
        """The rounds' records so far."""
        return self.report.records

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> Rounds:
        """Every round (after the checkpoint's, when resuming), then the summary (also written
        to ``summary.json``)."""
        yield from self.open()
        # the state at the start of round server_round, whatever line an exception (Ctrl-C)
        # interrupts, between rounds included
        server_round, before = self.report.first_round, self.state
        try:
            for server_round in range(self.report.first_round,
                                      self.config.run.num_server_rounds + 1):
                if not (yield from self.play_round(server_round)):
                    break
                before = self.state
        except GeneratorExit:  # abandoned by its holder: nothing to close
            raise
        except BaseException as exc:  # the transport failed, or Flower exits the process:
            # close the results folder with the rounds completed, then go on failing
            if self.rounds_done < server_round:
                self.state = before
            self.stop_reason = failure(server_round, exc)
            self.charge_pending()
            try:
                self.finish()
            except Exception as error:  # the caller must see the failure, not this
                log.error("dpfl: the results folder %s could not be closed: %s",
                          self.path, error)
            raise
        return self.finish()

    def play_round(self, server_round: int) -> Generator[Request, Any, bool]:
        """Round ``server_round`` to its record (and checkpoint); False when the run stops
        before it (``max-epsilon``) or in it (a client refused, too few replies:
        ``min-clients``)."""
        participants = sorted(self.algorithm.participants(
            server_round, list(range(self.problem.num_clients)), self.rng))
        exchanges = [e.name for e in self.algorithm.round_exchanges(server_round)]
        if reason := self.accounting.refusal(
                server_round, participants, exchanges,
                population=self.algorithm.population_round(server_round)):
            self.stop_reason = reason
            return False
        started, before = time.perf_counter(), self.state
        try:
            diagnostics, completed = yield from self.play(server_round, participants)
        except ClientRefused as refused:
            self.stop_reason = (f"clients {refused.clients} refused round {server_round}: "
                                f"{refused.reason}")
            return False
        except ClientsLost as lost:
            self.state, self.stop_reason = before, f"min-clients: {lost}"
            return False
        self.end_round(server_round, completed, diagnostics, started)
        if self.checkpointer.due(server_round):
            yield from self.save_checkpoint(server_round)
        return True

    def charge_pending(self) -> None:
        """Charge everyone an aborted exchange was addressed to: some replied, and any may
        have computed, noised and sent its reply (the ledger never undercounts)."""
        if self.pending is not None:
            exchange, clients = self.pending
            self.pending = None
            self.accounting.charge(clients, exchange)

    def play(self, server_round: int, participants: list[int]
             ) -> Generator[Request, Any, tuple[dict[int, dict[str, float]], list[int]]]:
        """Round ``server_round``'s exchanges; returns the participants' diagnostics and the
        participants that took part to the end (all of them unless replies were lost)."""
        diagnostics: dict[int, dict[str, float]] = {}
        traffic = self.traffic = {"uplink_bytes": 0, "downlink_bytes": 0}
        self.lost = {}
        server_releases = {r.name: r for r in self.problem.server_releases()}
        exchanges = self.algorithm.round_exchanges(server_round)
        self.check_streams(tuple(e.name for e in exchanges), server_round)
        ctx = self.server_context(server_round, participants, server_releases)
        self.state = self.algorithm.begin_round(self.state, ctx)
        for exchange in exchanges:
            broadcast = self.algorithm.broadcast(exchange.name, self.state, server_round)
            if tuple(broadcast) != exchange.broadcast:
                raise TypeError(f"{self.algorithm.name}: exchange {exchange.name!r} broadcast "
                                f"{tuple(broadcast)}, declared {exchange.broadcast}")
            self.pending = (exchange.name, list(ctx.participants))
            if self.algorithm.population_round(server_round):  # released whoever replies
                self.accounting.charge_population(exchange.name)
            try:
                replies: Replies = (
                    (yield ExchangeRequest(exchange.name, server_round, broadcast,
                                           ctx.participants)) if ctx.participants
                    else Replies(sums=self.algorithm.zero_sums(exchange.name)))
            except (ClientRefused, ClientsLost) as stopped:  # the others' noised uploads
                # reached the server (masked, under secure aggregation: charged all the same)
                self.pending = None
                self.accounting.charge(stopped.released, exchange.name)
                raise
            # everyone sent the exchange is charged, replied or not: a lost reply may have been
            # computed, noised and sent
            sent = [c for c in ctx.participants if c not in replies.unreached]
            self.pending = None
            self.accounting.charge(sent, exchange.name)
            self.monitor.check_reports(server_round, replies.reported, self.accounting)
            self.noise.update(replies.noise)
            traffic["downlink_bytes"] += len(sent) * payload(broadcast)
            if gone := {**replies.unreached, **replies.lost}:
                self.lost.update(gone)
                ctx = without(ctx, gone, f"round {server_round}, exchange {exchange.name!r}",
                              self.config.run.min_clients, self.echo)
            assert replies.sums is not None
            traffic["uplink_bytes"] += len(ctx.participants) * payload(replies.sums)
            self.monitor.check_noise(exchange, replies.sums, len(ctx.participants),
                                     self.algorithm.clip_radius(self.state))
            self.state = self.algorithm.server_step(exchange.name, self.state, replies.sums, ctx)
            if not finite(self.algorithm.global_params(self.state)):
                raise NonFiniteError(f"round {server_round}, exchange {exchange.name!r}: the "
                                     f"server's step made the model inf or NaN; lower the "
                                     f"learning rates (the results keep the last finite round)")
            for c, values in replies.diagnostics.items():
                diagnostics.setdefault(c, {}).update(values)
        return diagnostics, list(ctx.participants)

    def server_context(self, server_round: int, participants: list[int],
                       server_releases: dict[str, Any]) -> ServerContext:
        return ServerContext(server_round=server_round, rng=self.rng, participants=participants,
                             num_clients=self.problem.num_clients, releases=server_releases,
                             charge=self.accounting.charge_server,
                             num_rounds=self.config.run.num_server_rounds,
                             client_releases=self.problem.releases)

    def check_streams(self, exchanges: tuple[str, ...], server_round: int) -> None:
        """Refuse a round whose exchanges' releases share a noise stream (checked once per
        distinct set of exchanges, at the first round that runs it)."""
        if exchanges in self.checked:
            return
        if not distinct_streams(self.problem.releases(0), exchanges):
            raise TypeError(f"{self.algorithm.name}: the releases of round {server_round}'s "
                            f"exchanges share a noise stream")
        self.checked.add(exchanges)

    def end_round(self, server_round: int, participants: list[int],
                  diagnostics: dict[int, dict[str, float]], started: float) -> None:
        """Record round ``server_round``: its diagnostics' means, evaluation, ε, and its time
        since ``started`` (evaluation included)."""
        rounds = self.config.run.num_server_rounds
        record: dict[str, Any] = {"round": server_round, **means(diagnostics)}
        if server_round % self.config.evaluation.eval_every == 0 or server_round == rounds:
            x = self.algorithm.global_params(self.state)
            record.update(last_eval := self.evaluate(x))
            self.report.last_eval = last_eval
            if self.evaluate_fn and (own := self.evaluate_fn(server_round, x)):
                record["evaluate_fn"] = {k: float(v) for k, v in own.items()}
        record.update({
            **round_epsilon(self.accounting), "clip": self.algorithm.clip_radius(self.state),
            "participants": len(participants),
            **self.traffic,
        })
        if self.lost:
            record["lost_clients"] = sorted(self.lost)
        if (server := self.accounting.server_epsilon()) is not None:
            record["server_epsilon"] = server
        if len(self.accounting.accountants) > 1 and server_round == rounds:
            # the other accountants' ε (PRV, the refined PLD: up to seconds a history) at the
            # last round; summary.json has them whenever the run ends
            record["epsilon_by_accountant"] = self.accounting.report_by_accountant()
        record["seconds"] = time.perf_counter() - started
        self.rounds_done = server_round
        self.report.add(record)
        if "test_loss" in record:
            self.monitor.check_divergence(server_round, record["test_loss"])

    # ---- start, checkpoints, end -------------------------------------------------------------
    def privacy_statement(self) -> dict[str, Any]:
        """Whether the run's ε holds against the server, and why not."""
        return privacy_statement(self.problem, noise_sources(self.problem, self.runtime,
                                                             self.accounting, self.noise))

    def open(self) -> Generator[Request, Any, None]:
        """Create the results folder (inputs are valid by now) and begin the transport."""
        p = self.problem
        meta = {
            "runtime": self.runtime,
            "algorithm": {"name": p.algorithm.name, "protection": p.algorithm.protection,
                          "relation": p.algorithm.relation},
            "privacy": self.privacy_statement(),
            "num_params": p.model.d,
            "client_sizes": client_sizes(p),
            "releases": releases_of(p),
        }
        resumed = self.checkpointer.resumed
        client_states = None if resumed is None else self.restore(resumed)
        self.report.open(meta)
        if resumed is None:
            self.monitor.first_loss = self.evaluate.test_loss(
                self.algorithm.global_params(self.state))
        reported = yield Begin(self.checkpointer.lineage, client_states)
        self.monitor.check_reports(self.rounds_done, reported, self.accounting)
        self.report.start_clock()

    def save_checkpoint(self, server_round: int) -> Generator[Request, Any, None]:
        """Everything :meth:`restore` needs to go on after ``server_round``."""
        client_states = yield ClientStates()
        self.checkpointer.save(server_round, {
            "runtime": self.runtime, "releases": releases_of(self.problem),
            "server_state": {k: v.detach().cpu() for k, v in self.state.items()},
            "client_states": {k: v.detach().cpu() for k, v in client_states.items()},
            "accounting": self.accounting.state_dict(), "noise": self.noise,
            **self.monitor.state_dict(), **self.report.state_dict()})

    def restore(self, saved: dict[str, Any]) -> State:
        """Take over the run of checkpoint ``saved``; returns the client states it holds for
        the transport."""
        self.state = {k: v.to(self.problem.device) for k, v in saved["server_state"].items()}
        self.accounting.load_state_dict(saved["accounting"])
        self.rounds_done = int(saved["round"])
        self.monitor.load_state_dict(saved)
        self.report.load_state_dict(saved)
        self.noise = {int(c): str(m) for c, m in saved.get("noise", {}).items()}
        if self.config.privacy.secure_noise and self.runtime == "engine":
            self.charge_interrupted()
        return saved["client_states"]

    def charge_interrupted(self) -> None:
        """Charge what an interrupted secure-noise attempt of an engine run released after its
        checkpoint (:meth:`Checkpointer.interrupted`), for every client (who took part is not
        known: its client sampling was secure too). Its noise came from the OS and is not drawn
        again (a seeded run re-releases exactly what it released), so these are releases of
        their own. Under Flower the clients' nodes report them instead
        (:meth:`RunMonitor.check_reports`)."""
        done = self.rounds_done
        last = self.checkpointer.interrupted(done)
        for server_round in range(done + 1, last + 1):
            for exchange in self.algorithm.round_exchanges(server_round):
                self.accounting.charge(range(self.problem.num_clients), exchange.name)
        if last > done:
            rounds = f"round {last}" if last == done + 1 else f"rounds {done + 1}-{last}"
            self.monitor.warn(f"secure-noise: the interrupted attempt may have released "
                              f"{rounds} with noise this resumed run does not draw again: they "
                              f"are charged to every client")

    def finish(self) -> dict[str, Any]:
        """Write summary, model and plots; returns the summary."""
        wall = self.report.wall_seconds()
        if self.rounds_done and not self.report.last_eval:
            self.report.last_eval = self.evaluate(self.algorithm.global_params(self.state))
        summary = {
            "runtime": self.runtime,
            "rounds_completed": self.rounds_done,
            "stopped_early": self.stop_reason or None,
            "initial_test_loss": self.monitor.first_loss,
            **self.report.last_eval,
            "epsilon_max": self.accounting.extremes()[0],
            "epsilon": self.accounting.report(), **population_epsilon(self.accounting),
            "server_epsilon": self.accounting.server_epsilon(),
            "epsilon_by_accountant": self.accounting.report_by_accountant(),
            "delta": self.config.privacy.delta,
            "accountant": self.config.privacy.accountant,
            "calibration": calibration_name(self.problem),
            "protection": self.algorithm.protection,
            "privacy": self.privacy_statement(),
            "releases": releases_of(self.problem),
            "wall_seconds": wall,
            "seconds_per_round": wall / max(self.rounds_done, 1),
            "cpu_seconds": self.report.cpu_seconds(),
            "results": str(self.path),
            "calibration_check": calibration_check(self.problem, self.accounting,
                                                   self.rounds_done, self.stop_reason),
            "warnings": list(self.monitor.warnings),
        }
        if self.config.secure.secure_aggregation:
            summary["secure_aggregation"] = secure_aggregation_statement(
                self.problem, self.accounting, self.runtime)
        self.report.finish(summary, self.algorithm.global_params(self.state).cpu())
        return summary
