"""The round driver: one loop for every runtime.

Each round it picks the participants, stops before a round that would take a participant's ε
past ``max-epsilon``, runs the algorithm's exchanges over a transport (the engine's clients in
this process, or Flower messages), applies ``server_step`` to the participants' sums, charges
every participant's ledger, evaluates the global model on the server's own data, and writes the
results folder. The Flower strategy and the engine differ only in the transport they hand it.

With ``checkpoint-every`` it checkpoints the run (:mod:`dpfl.checkpoint`), and with
``resume=true`` it continues one from its checkpoint. A failure inside a round closes the
results folder before it propagates: the rounds completed, their model, and the ledgers with
the aborted exchange charged to everyone it was addressed to. Under Flower the server's ledger
is reconciled with the counts each client's node reports (:meth:`RoundDriver.check_reports`):
what a node released beyond it (an interrupted attempt's rounds, a round answered twice with
fresh noise) is charged, and a node's refusal charges every participant that did not refuse.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import signal
import time
from collections import Counter
from typing import Any

import torch

from dpfl import checkpoint
from dpfl.algorithms import Exchange, ServerContext, State, distinct_streams
from dpfl.checkpoint import Lineage
from dpfl.config import format_overrides
from dpfl.errors import ConfigError, NonFiniteError
from dpfl.privacy import CALIBRATIONS, Accounting, Randomness
from dpfl.problem import Problem
from dpfl.results import ResultsWriter, results_path
from dpfl.rounds.client import finite
from dpfl.rounds.transport import ClientRefused, ClientsLost, Transport
from dpfl.runconfig import check_runtime

log = logging.getLogger("dpfl")

NON_PRIVATE = ("non-private-diagnostics=true: clients send exact, un-noised training statistics "
               "and the server may read their training data; this run has NO privacy guarantee "
               "against the server")


CENTRAL = ("central DP: clients send clipped, un-noised updates and the server adds the noise "
           "(a trusted server); the ε is client-level and holds for what the server releases, "
           "not against the server")

QUANTILES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # of τ_q (eval-norm-quantiles)
EVAL_BATCH = 4096  # records per per-sample-gradient pass of an evaluation
NOISE_WARNING = 100.0  # noise norm of the participants' average over the clip, to warn above

NOISE_FREE = ("noise multiplier 0: clients send their messages without noise (ε = ∞); this run "
              "has no privacy guarantee against the server")

SEEDED = ("noise and batches were drawn from the run's seed, which the server knows (a "
          "simulation, or nodes with noise=\"seeded\"): it could regenerate the noise and "
          "remove it, so ε holds against other clients and observers of the model, not against "
          "the server (deployment nodes draw secret noise: docs/privacy.md)")

SECRET = ("replies carry only noised uploads covered by the releases, with noise and batches "
          "from a secret the server does not hold (secure or keyed noise)")

NODES_DECIDE = ("each node's policy decides where its clients' noise comes from: summary.json "
                "says what they used")

#: why the ledger's other accountants give another ε for the same releases
OTHER_ACCOUNTANTS = {
    "rdp-wor": "Wang et al.'s bound for fixed-size sampling without replacement, the "
               "adaptive-clipping paper's: looser than the Poisson analysis",
    "rdp-classical": "the classical RDP conversion the PCDP paper's tables print: looser than "
                     "Opacus' conversion",
    "prv": "Opacus' PRV accountant, numerical",
    "rdp": "Opacus' RDP accountant",
    "dp-accounting-pld": "Google's dp-accounting, privacy loss distributions: an independent "
                         "check, usually tighter",
    "dp-accounting-rdp": "Google's dp-accounting, RDP: an independent check",
    "dp-accounting-rdp-wor": "Google's dp-accounting, RDP of sampling without replacement",
}

#: the statements of runs that protect nothing against the server by their settings alone
UNPROTECTED = (NON_PRIVATE, CENTRAL, NOISE_FREE)


_LOGGED: set[str] = set()  # what runs that do not echo (sweeps, reproductions) logged so far


def log_once(text: str) -> None:
    """Log a run's warning once per process: a sweep's runs share their warnings (their
    summaries keep them, each its own)."""
    if text not in _LOGGED:
        _LOGGED.add(text)
        log.warning(text)


def payload(arrays: dict[str, torch.Tensor]) -> int:
    """Bytes of the arrays of one message (what one client sends or receives; the wire adds
    Flower's framing)."""
    return sum(a.numel() * a.element_size() for a in arrays.values())


class Stopped(BaseException):
    """Flower was asked to end the ServerApp with signal ``signum`` (its SuperLink or SuperExec
    went away, or the run was stopped). Raised into the round loop in place of Flower's own exit
    (:func:`dpfl.server.app.main`), so that the results folder is closed before that exit starts
    its clock: Flower ends the process 5 s after it, whatever is still being written."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def failure(round: int, exc: BaseException) -> str:
    """Why a run stopped on ``exc`` in round ``round``, for its summary."""
    if isinstance(exc, Stopped):
        return (f"failed in round {round}: Flower ended the ServerApp "
                f"({signal.Signals(exc.signum).name}): the SuperLink was lost or restarted, or "
                f"the run was stopped")
    if isinstance(exc, SystemExit):
        return (f"failed in round {round}: Flower ended the ServerApp (exit status {exc.code}): "
                f"the SuperLink was lost or restarted, or the run was stopped")
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted in round {round}"
    return f"failed in round {round}: {type(exc).__name__}: {exc}"


class RoundDriver:
    """Runs one problem over ``transport`` to the end (or to ``max-epsilon``).

    ``runtime`` ('engine' or 'flower') names the results folder and refuses settings the
    runtime cannot honour; ``x0`` is the initial model (the problem's by default). A run with
    ``resume=true`` is checked against its checkpoint here, before anything starts."""

    def __init__(self, problem: Problem, transport: Transport, runtime: str, *,
                 echo: bool = True, x0: torch.Tensor | None = None) -> None:
        check_runtime(problem.config, runtime)
        self.problem = problem
        self.config = cfg = problem.config
        self.algorithm = problem.algorithm
        self.transport = transport
        self.runtime = runtime
        self.echo = echo
        start = problem.x0 if x0 is None else x0
        self.state = self.algorithm.init_server_state(start.to(problem.device))
        self.rng = Randomness(int(cfg["seed"]), secure=bool(cfg["secure-noise"]))
        self.accounting = Accounting(
            num_clients=problem.num_clients, releases=problem.releases,
            accountant=str(cfg["accountant"]), relation=self.algorithm.relation,
            delta=float(cfg["delta"]), limit=float(cfg["max-epsilon"]),
            also=self.algorithm.reported_accountants,
            central=tuple(r for r in problem.server_releases()
                          if r.name in self.algorithm.central_releases()))
        self.every = int(cfg["checkpoint-every"])
        self.resumed = checkpoint.load(cfg, runtime) if cfg["resume"] else None
        self.path = checkpoint.folder_of(cfg) if self.resumed else results_path(cfg, runtime)
        self.lineage = Lineage.fresh()
        if self.resumed is not None:
            self.check_releases(self.resumed)
            self.lineage = Lineage(tuple((str(s), int(r)) for s, r in self.resumed["segments"])
                                   ).resumed(int(self.resumed["round"]))
        self.results: ResultsWriter | None = None
        self.records: list[dict[str, Any]] = []
        self.last_eval: dict[str, Any] = {}
        self.stop_reason = ""
        self.checked: set[tuple[str, ...]] = set()  # exchange sets whose streams are checked
        self.rounds_done = 0
        self.traffic: dict[str, int] = {}
        self.lost: dict[int, str] = {}  # this round's missing participants, and why
        self.warnings: list[str] = []  # said once each, kept in the summary
        self.noise_checked: set[tuple[str, str]] = set()  # (exchange, upload) compared
        self.first_loss: float | None = None
        self.pending: tuple[str, list[int]] | None = None  # the exchange under way, addressees
        self.reported: dict[int, dict[str, int]] = {}  # each client's counts, as its node said
        self.flagged: set[int] = set()  # clients whose node lost its ledger
        self.noise: dict[int, str] = {}  # where each client's noise came from (Flower)
        self.first_round = 1
        self.earlier_seconds = 0.0  # wall time of the rounds a resumed run took over
        self.started = time.perf_counter()

    def check_releases(self, saved: dict[str, Any]) -> None:
        """Refuse to resume checkpoint ``saved`` with other releases than it ran with: a
        changed ``num-server-rounds`` whose calibrated noise depends on it."""
        if saved["releases"] == self.releases():
            return
        rounds = saved["run_config"]["num-server-rounds"]
        if rounds == self.config["num-server-rounds"]:
            raise ConfigError("resume", "the run's calibrated releases differ from the "
                              "checkpointed run's (another version of dpfl?)")
        raise ConfigError("num-server-rounds", f"the run's noise was calibrated for its "
                          f"{rounds} rounds: {checkpoint.EXTEND}",
                          allowed=f"{format_overrides({'num-server-rounds': rounds})} to "
                          f"resume it as it was")

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Every round (after the checkpoint's, when resuming), then the summary (also written
        to ``summary.json``)."""
        self.open()
        for round in range(self.first_round, int(self.config["num-server-rounds"]) + 1):
            before = self.state
            try:
                if not self.play_round(round):
                    break
            except BaseException as exc:  # the transport failed, or Flower exits the process:
                # close the results folder with the rounds completed, then go on failing
                if self.rounds_done < round:
                    self.state = before
                self.stop_reason = failure(round, exc)
                self.charge_pending()
                try:
                    self.finish()
                except Exception as error:  # the caller must see the failure, not this
                    log.error("dpfl: the results folder %s could not be closed: %s",
                              self.path, error)
                raise
        return self.finish()

    def play_round(self, round: int) -> bool:
        """Round ``round`` to its record (and checkpoint); False when the run stops before it
        (``max-epsilon``) or in it (a client refused, too few replies: ``min-clients``)."""
        participants = sorted(self.algorithm.participants(
            round, list(range(self.problem.num_clients)), self.rng))
        exchanges = [e.name for e in self.algorithm.round_exchanges(round)]
        if reason := self.accounting.refusal(round, participants, exchanges):
            self.stop_reason = reason
            return False
        started, before = time.perf_counter(), self.state
        try:
            diagnostics, completed = self.play(round, participants)
        except ClientRefused as refused:
            self.stop_reason = f"clients {refused.clients} refused round {round}: " \
                               f"{refused.reason}"
            return False
        except ClientsLost as lost:
            self.state, self.stop_reason = before, f"min-clients: {lost}"
            return False
        self.end_round(round, completed, diagnostics, started)
        if self.every and (round % self.every == 0
                           or round == int(self.config["num-server-rounds"])):
            self.save_checkpoint(round)
        return True

    def charge_pending(self) -> None:
        """Charge everyone an aborted exchange was addressed to: some replied, and any may
        have computed, noised and sent its reply (the ledger never undercounts)."""
        if self.pending is not None:
            exchange, clients = self.pending
            self.pending = None
            self.accounting.charge(clients, exchange)

    def play(self, round: int, participants: list[int]
             ) -> tuple[dict[int, dict[str, float]], list[int]]:
        """Round ``round``'s exchanges; returns the participants' diagnostics and the
        participants that took part to the end (all of them unless replies were lost)."""
        diagnostics: dict[int, dict[str, float]] = {}
        traffic = self.traffic = {"uplink_bytes": 0, "downlink_bytes": 0}
        self.lost = {}
        server_releases = {r.name: r for r in self.problem.server_releases()}
        exchanges = self.algorithm.round_exchanges(round)
        self.check_streams(tuple(e.name for e in exchanges), round)
        ctx = self.server_context(round, participants, server_releases)
        self.state = self.algorithm.begin_round(self.state, ctx)
        for exchange in exchanges:
            broadcast = self.algorithm.broadcast(exchange.name, self.state, round)
            if tuple(broadcast) != exchange.broadcast:
                raise TypeError(f"{self.algorithm.name}: exchange {exchange.name!r} broadcast "
                                f"{tuple(broadcast)}, declared {exchange.broadcast}")
            self.pending = (exchange.name, list(ctx.participants))
            try:
                replies = self.transport.exchange(exchange.name, round, broadcast,
                                                  ctx.participants)
            except ClientRefused as refused:  # the others' noised uploads reached the server
                self.pending = None
                self.accounting.charge(refused.released, exchange.name)
                raise
            # everyone sent the exchange is charged, replied or not: a lost reply may have been
            # computed, noised and sent
            sent = [c for c in ctx.participants if c not in replies.unreached]
            self.pending = None
            self.accounting.charge(sent, exchange.name)
            self.check_reports(round, replies.reported)
            self.noise.update(replies.noise)
            traffic["downlink_bytes"] += len(sent) * payload(broadcast)
            if gone := {**replies.unreached, **replies.lost}:
                ctx = self.without(ctx, gone, round, exchange.name)
            assert replies.sums is not None
            traffic["uplink_bytes"] += len(ctx.participants) * payload(replies.sums)
            self.check_noise(exchange, replies.sums, len(ctx.participants))
            self.state = self.algorithm.server_step(exchange.name, self.state, replies.sums, ctx)
            if not finite(self.algorithm.global_params(self.state)):
                raise NonFiniteError(f"round {round}, exchange {exchange.name!r}: the server's "
                                     f"step made the model inf or NaN; lower the learning "
                                     f"rates (the results keep the last finite round)")
            for c, values in replies.diagnostics.items():
                diagnostics.setdefault(c, {}).update(values)
        return diagnostics, list(ctx.participants)

    def without(self, ctx: ServerContext, gone: dict[int, str], round: int,
                exchange: str) -> ServerContext:
        """``ctx`` for the participants that replied, when ``min-clients`` allows going on
        without ``gone`` (client → why it is missing); raises :class:`ClientsLost` otherwise.
        The rest of the round runs with the remaining participants only."""
        remaining = [c for c in ctx.participants if c not in gone]
        needed = int(self.config["min-clients"]) or len(ctx.participants)
        reasons = "; ".join(f"clients {[c for c in sorted(gone) if gone[c] == why]}: {why}"
                            for why in dict.fromkeys(gone[c] for c in sorted(gone)))
        if len(remaining) < needed:  # needed ≥ 1: a round always has participants
            raise ClientsLost(
                f"round {round}, exchange {exchange!r}: {len(remaining)} of "
                f"{len(ctx.participants)} participants replied and min-clients="
                f"{self.config['min-clients']} needs {needed} ({reasons})")
        self.lost.update(gone)
        message = (f"round {round}, exchange {exchange!r}: going on with {len(remaining)} of "
                   f"{len(ctx.participants)} participants ({reasons})")
        if self.echo:
            print(f"WARNING: {message}", flush=True)
        log.warning(message)
        return dataclasses.replace(ctx, participants=remaining)

    def check_reports(self, round: int, reported: dict[int, dict[str, int]]) -> None:
        """Reconcile the server's ledger, the authority, with each client's counts of the run's
        releases as its node reports them (``reported``: client → release name → count). What a
        node counts beyond the server's ledger was released (an interrupted attempt's rounds
        after its checkpoint, a round answered again with fresh noise): charge it, and say so.
        A node that counts fewer than the server, or than it reported before, lost its ledger (a
        wiped state folder): say so, once per client; the ε reported stays the server's."""
        for c, counts in sorted(reported.items()):
            behind, extra = self.accounting.reconcile(c, counts)
            before = self.reported.get(c, {})
            self.reported[c] = dict(counts)
            if extra:
                what = ", ".join(f"{n} × {name!r}" for name, n in sorted(extra.items()))
                self.warn(f"client {c}'s node reports releases the server's ledger did not "
                          f"hold ({what}, by round {round}): an interrupted attempt's after its "
                          f"checkpoint, or a round answered again with fresh noise; they are "
                          f"charged")
            fell = any(counts.get(name, 0) < n for name, n in before.items())
            if c in self.flagged or not (behind or fell):
                continue
            self.flagged.add(c)
            self.warn(f"client {c}'s node reports fewer releases at round {round} than the "
                      f"server's ledger holds: it lost its ledger (its state folder wiped) and "
                      f"its own budget guard restarted with it; the ε reported here is the "
                      f"server's ledger, which keeps every round")

    def server_context(self, round: int, participants: list[int],
                       server_releases: dict[str, Any]) -> ServerContext:
        return ServerContext(round=round, rng=self.rng, participants=participants,
                             num_clients=self.problem.num_clients, releases=server_releases,
                             charge=self.accounting.charge_server,
                             num_rounds=int(self.config["num-server-rounds"]),
                             client_releases=self.problem.releases)

    def check_streams(self, exchanges: tuple[str, ...], round: int) -> None:
        """Refuse a round whose exchanges' releases share a noise stream (checked once per
        distinct set of exchanges, at the first round that runs it)."""
        if exchanges in self.checked:
            return
        if not distinct_streams(self.problem.releases(0), exchanges):
            raise TypeError(f"{self.algorithm.name}: the releases of round {round}'s exchanges "
                            f"share a noise stream")
        self.checked.add(exchanges)

    # ---- results ------------------------------------------------------------------------
    def open(self) -> None:
        """Create the results folder (inputs are valid by now)."""
        p = self.problem
        meta = {
            "runtime": self.runtime,
            "algorithm": {"name": p.algorithm.name, "protection": p.algorithm.protection,
                          "relation": p.algorithm.relation},
            "privacy": self.privacy_statement(),
            "num_params": p.model.d,
            "client_sizes": [len(part) for part in p.partitions],
            "releases": self.releases(),
        }
        client_states = None if self.resumed is None else self.restore(self.resumed)
        self.results = ResultsWriter(self.path, self.config, meta,
                                     None if self.resumed is None else self.records)
        chosen = {k: self.config[k] for k in self.config.automatic
                  if k in self.config.reads and self.config[k] != ""}
        if self.echo and chosen:
            print(f"{p.algorithm.name}'s defaults: {format_overrides(chosen)}", flush=True)
        if self.echo and self.resumed is not None:
            print(f"resuming {self.path} after round {self.rounds_done}", flush=True)
        if meta["privacy"]["note"] in UNPROTECTED:
            if self.echo:
                print(f"WARNING: {meta['privacy']['note']}", flush=True)
            else:
                log_once(meta["privacy"]["note"])
        if self.resumed is None:
            with torch.no_grad():  # the start of the divergence check
                self.first_loss = float(self.problem.model.evaluate(
                    self.algorithm.global_params(self.state), *self._test_set)["loss"])
        self.check_reports(self.rounds_done, self.transport.begin(self.lineage, client_states))
        self.started = time.perf_counter()

    def save_checkpoint(self, round: int) -> None:
        """Everything :meth:`restore` needs to go on after ``round`` (:mod:`dpfl.checkpoint`)."""
        cpu = {k: v.detach().cpu() for k, v in self.state.items()}
        checkpoint.save(self.path, {
            "round": round, "runtime": self.runtime, "run_config": self.config.as_dict(),
            "releases": self.releases(), "segments": [list(s) for s in self.lineage.segments],
            "server_state": cpu,
            "client_states": {k: v.detach().cpu()
                              for k, v in self.transport.client_states().items()},
            "accounting": self.accounting.state_dict(), "records": self.records,
            "warnings": self.warnings, "first_loss": self.first_loss,
            "last_eval": self.last_eval,
            "noise_checked": [list(k) for k in sorted(self.noise_checked)],
            "reported": self.reported, "flagged": sorted(self.flagged), "noise": self.noise,
            "wall_seconds": self.wall_seconds()})

    def restore(self, saved: dict[str, Any]) -> State:
        """Take over the run of checkpoint ``saved``; returns the client states it holds for
        the transport."""
        device = self.problem.device
        self.state = {k: v.to(device) for k, v in saved["server_state"].items()}
        self.accounting.load_state_dict(saved["accounting"])
        self.rounds_done = int(saved["round"])
        self.first_round = self.rounds_done + 1
        self.records = list(saved["records"])
        self.warnings = list(saved["warnings"])
        self.first_loss = saved["first_loss"]
        self.last_eval = dict(saved["last_eval"])
        self.noise_checked = {(e, u) for e, u in saved["noise_checked"]}
        self.reported = {int(c): dict(counts) for c, counts in saved["reported"].items()
                         if isinstance(counts, dict)}
        self.flagged = set(saved["flagged"])
        self.noise = {int(c): str(m) for c, m in saved.get("noise", {}).items()}
        self.earlier_seconds = float(saved["wall_seconds"])
        if self.config["secure-noise"] and self.runtime == "engine":
            self.charge_interrupted()
        return saved["client_states"]

    def charge_interrupted(self) -> None:
        """Charge what an interrupted secure-noise attempt of an engine run released after its
        checkpoint: the rounds it recorded and the one it was in, for every client (who took
        part is not known: its client sampling was secure too). Its noise came from the OS and
        is not drawn again (a seeded run re-releases exactly what it released), so these are
        releases of their own. Under Flower the clients' nodes report them instead
        (:meth:`check_reports`)."""
        done = self.rounds_done
        try:
            lines = (self.path / "rounds.jsonl").read_text().splitlines()
            last = max([done, *(int(json.loads(line)["round"]) for line in lines)])
        except (OSError, ValueError, KeyError):
            last = done
        last = min(last + 1, int(self.config["num-server-rounds"]))
        for round in range(done + 1, last + 1):
            for exchange in self.algorithm.round_exchanges(round):
                self.accounting.charge(range(self.problem.num_clients), exchange.name)
        if last > done:
            rounds = f"round {last}" if last == done + 1 else f"rounds {done + 1}-{last}"
            self.warn(f"secure-noise: the interrupted attempt may have released {rounds} with "
                      f"noise this resumed run does not draw again: they are charged to every "
                      f"client")

    def wall_seconds(self) -> float:
        """The run's wall time so far, a resumed run's earlier attempts up to their
        checkpoint included."""
        return self.earlier_seconds + time.perf_counter() - self.started

    def noise_sources(self) -> dict[str, int]:
        """How many clients drew their noise from each source
        (:data:`~dpfl.privacy.randomness.MODES`): as their nodes said (Flower; ``unknown``
        before any has), else as the run config says (the engine)."""
        if self.runtime == "engine":  # the clients that took part, as under Flower
            return {"secure" if self.config["secure-noise"] else "seeded":
                    len(self.accounting.charged) or self.problem.num_clients}
        return dict(Counter(self.noise.values())) or {"unknown": self.problem.num_clients}

    def privacy_statement(self) -> dict[str, Any]:
        """Whether the run's ε holds against the server, and why not."""
        if self.config["non-private-diagnostics"]:
            return {"guarantee_against_server": False, "note": NON_PRIVATE}
        if self.algorithm.central_releases():
            return {"guarantee_against_server": False, "note": CENTRAL}
        if any(r.noise_multiplier <= 0 for c in range(self.problem.num_clients)
               for r in self.problem.releases(c)):
            return {"guarantee_against_server": False, "note": NOISE_FREE}
        sources = self.noise_sources()
        if sources.get("seeded"):
            return {"guarantee_against_server": False, "note": SEEDED, "noise": sources}
        if sources.get("unknown"):  # a Flower run before any node has replied
            return {"guarantee_against_server": None, "note": NODES_DECIDE, "noise": sources}
        return {"guarantee_against_server": True, "note": SECRET, "noise": sources}

    def releases(self) -> dict[str, Any]:
        out: dict[str, Any] = {str(c): [dataclasses.asdict(r) for r in self.problem.releases(c)]
                               for c in range(self.problem.num_clients)}
        if server := self.problem.server_releases():
            out["server"] = [dataclasses.asdict(r) for r in server]
        return out

    @functools.cached_property
    def _test_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        ds, device = self.problem.dataset, self.problem.device
        return ds.test_x.to(device), ds.test_y.to(device)

    @functools.cached_property
    def _train_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        ds, device = self.problem.dataset, self.problem.device
        return ds.train_x.to(device), ds.train_y.to(device)

    def evaluate(self) -> dict[str, Any]:
        """Test loss/accuracy of the global model on the server's test set (and, with
        eval-train, which needs the non-private mode, the full training objective and ‖∇F‖)."""
        params = self.algorithm.global_params(self.state)
        with torch.no_grad():
            res = self.problem.model.evaluate(params, *self._test_set)
        out = {"test_loss": float(res["loss"]),
               "test_accuracy": None if res.get("accuracy") is None else float(res["accuracy"])}
        if self.config["eval-train"]:
            x, y = self._train_set
            with torch.no_grad():
                out["train_loss_full"] = float(self.problem.model.evaluate(params, x, y)["loss"])
            grad = self.problem.model.full_gradient(params, x, y)
            out["grad_norm"] = float(torch.linalg.vector_norm(grad.double()))
        if self.config["eval-norm-quantiles"]:
            out["tau_q_nonprivate"] = self.norm_quantile_ratios(params)
        return out

    def norm_quantile_ratios(self, params: torch.Tensor) -> dict[str, float]:
        """τ_q(x) = Q_q({‖∇ℓ_z(x)‖²}_z)/mean_z ‖∇ℓ_z(x)‖² over the whole training set, for
        q ∈ QUANTILES (a non-private diagnostic: the server reads the training data)."""
        x, y = self._train_set
        squares = torch.cat([
            torch.linalg.vector_norm(rows.double(), dim=1).square()
            for start in range(0, len(x), EVAL_BATCH)
            for _, _, rows in self.problem.model.per_sample_gradient_chunks(
                params, x[start:start + EVAL_BATCH].unsqueeze(0),
                y[start:start + EVAL_BATCH].unsqueeze(0))])
        mean = squares.mean()
        levels = torch.tensor(QUANTILES, dtype=squares.dtype, device=squares.device)
        return {f"{q:g}": float(v / mean) if mean > 0 else math.nan
                for q, v in zip(QUANTILES, torch.quantile(squares, levels).tolist())}

    def end_round(self, round: int, participants: list[int],
                  diagnostics: dict[int, dict[str, float]], started: float) -> dict[str, Any]:
        """Record round ``round``: its diagnostics' means, evaluation, ε, and its time since
        ``started`` (evaluation included)."""
        rounds = int(self.config["num-server-rounds"])
        record: dict[str, Any] = {"round": round}
        for key in sorted({k for m in diagnostics.values() for k in m}):
            # in client order: the mean is the same whatever order the replies came in
            values = [diagnostics[c][key] for c in sorted(diagnostics) if key in diagnostics[c]]
            record[key.replace("-", "_")] = sum(values) / len(values)
        if round % int(self.config["eval-every"]) == 0 or round == rounds:
            self.last_eval = self.evaluate()
            record.update(self.last_eval)
        epsilon = self.accounting.report()
        record.update({
            "epsilon": epsilon,
            "epsilon_max": max(epsilon.values()), "epsilon_min": min(epsilon.values()),
            "clip": self.algorithm.clip_radius(self.state),
            "participants": len(participants),
            **self.traffic,
        })
        if self.lost:
            record["lost_clients"] = sorted(self.lost)
        if (server := self.accounting.server_epsilon()) is not None:
            record["server_epsilon"] = server
        if len(self.accounting.accountants) > 1 and "test_loss" in record:
            record["epsilon_by_accountant"] = self.accounting.report_by_accountant()
        record["seconds"] = time.perf_counter() - started
        self.rounds_done = round
        self.records.append(record)
        assert self.results is not None
        self.results.add_round(record)
        if self.echo:
            print(self.describe(record, rounds), flush=True)
        if "test_loss" in record:
            self.check_divergence(round, record["test_loss"])
        return record

    def warn(self, text: str) -> None:
        """Say ``text`` once (console, or the log when not echoing) and keep it for the
        summary."""
        if text in self.warnings:
            return
        self.warnings.append(text)
        if self.echo:
            print(f"WARNING: {text}", flush=True)
        else:
            log_once(text)

    def check_divergence(self, round: int, loss: float) -> None:
        """Warn, once, when the test loss is not finite or has grown past 10× that of the
        initial model: the step size (or the noise) is too large for the model to learn."""
        first = self.first_loss
        if not math.isfinite(loss) or (first is not None and first > 0 and loss > 10 * first):
            if any(w.startswith("the test loss diverged") for w in self.warnings):
                return
            start = ("" if first is None or not math.isfinite(loss)
                     else f", {loss / first:.3g}× the initial model's {first:.4g}")
            steps = [f"{key} (now {self.config[key]:g})"
                     for key in ("learning-rate", "server-learning-rate")
                     if key == "learning-rate" or self.config[key] != 1]
            self.warn(f"the test loss diverged: {loss:.4g} at round {round}{start}; lower "
                      f"{' or '.join(steps)}, or the noise")

    def check_noise(self, exchange: Exchange, sums: dict[str, torch.Tensor],
                    participants: int) -> None:
        """Warn, once per upload, when the noise a client adds to it dwarfs what its clip
        lets through: the noise's norm, std·√(entries), over the clip radius that bounds the
        upload's signal, is above :data:`NOISE_WARNING` even after averaging over the
        participants (a ratio that public quantities give: no reply is read)."""
        pending = {n: u for n, u in exchange.uploads.items()
                   if (exchange.name, n) not in self.noise_checked}
        clip = self.algorithm.clip_radius(self.state)
        if not pending or not clip or not math.isfinite(clip):
            return
        releases = {r.name: r for r in self.problem.releases(0)}
        for name, upload in pending.items():
            self.noise_checked.add((exchange.name, name))
            release = releases.get(upload.release)
            if (upload.sent_as_returned or release is None or not release.noise_multiplier
                    or name not in sums):
                continue
            radius = release.radius if release.radius is not None else clip
            std = release.noise_multiplier * release.sensitivity(radius)
            norm = std * math.sqrt(sums[name].numel())
            # K noisy steps add K clipped signals but only √K noises
            ratio = norm / clip / math.sqrt(release.steps * participants)
            if ratio > NOISE_WARNING:
                # without sampling amplification (every record behind every release), a
                # larger batch does not lower the noise
                levers = ("epsilon, batch-size or the clients per round"
                          if release.sample_rate < 1 else "epsilon or the clients per round")
                self.warn(f"the noise dwarfs the signal: each client's upload {name!r} gets "
                          f"noise of norm {norm:.3g} a step (std {std:.3g} on each of "
                          f"{sums[name].numel()} entries), {norm / clip:.3g}× the clip "
                          f"{clip:.3g} that bounds a step's signal; over {release.steps} "
                          f"step(s) and {participants} participants still {ratio:.3g}×: "
                          f"expect little learning (raise {levers})")

    def describe(self, r: dict[str, Any], rounds: int) -> str:
        parts = [f"round {r['round']:>{len(str(rounds))}}/{rounds}"]
        if r.get("train_loss") is not None:
            parts.append(f"train loss {r['train_loss']:.4f}")
        if "test_loss" in r:
            acc = r.get("test_accuracy")
            parts.append(f"test loss {r['test_loss']:.4f}"
                         + (f" acc {100 * acc:5.2f}%" if acc is not None else ""))
        parts.append(f"ε max {r['epsilon_max']:.4g} (δ={self.config['delta']:g})")
        elapsed = time.perf_counter() - self.started
        left = elapsed / (r["round"] - self.first_round + 1) * (rounds - r["round"])
        parts.append(f"{r['seconds']:.2f} s" + (f", ETA {left:.0f} s" if left else ""))
        return " | ".join(parts)

    def calibration_check(self) -> str | None:
        """How the ε the noise was calibrated for compares with the accountant's ε of the
        noise actually used (None when noise-multiplier was given directly, or the algorithm
        adds no noise), which accountant the run's guarantee rests on, and what the ledger's
        other accountants give for the same noise, and why they differ."""
        cfg = self.config
        epsilon = self.accounting.report()
        if float(cfg["noise-multiplier"]) >= 0 or self.algorithm.noise_free or not epsilon:
            return None
        by_accountant = list(self.accounting.report_by_accountant().items())
        others = "; ".join(f"{name} {value:.4g} ({OTHER_ACCOUNTANTS.get(name, 'another bound')})"
                           for name, value in by_accountant[1:])
        if others:
            others = (f". The same noise by the ledger's other accountants: {others}: other "
                      f"bounds on the same releases, not the run's guarantee")
        spent = max(epsilon.values())
        rounds = int(cfg["num-server-rounds"])
        head = (f"the {cfg['accountant']} accountant, which the run's guarantee rests on, gives "
                f"ε={spent:.4g} at δ={cfg['delta']:g} after {self.rounds_done} rounds")
        if not CALIBRATIONS.get(str(cfg["calibration"]), self.algorithm.name).targets_epsilon:
            return f"calibration={cfg['calibration']} (noise set directly): {head}{others}"
        target = float(cfg["epsilon"])
        if self.rounds_done < rounds:
            verdict = (f"the run stopped after {self.rounds_done} of the {rounds} rounds the "
                       f"noise was calibrated for ({self.stop_reason or 'stopped'}): ε={spent:.4g} "
                       f"is what it spent")
        elif spent > target * 1.01:
            verdict = ("the mapping is optimistic: the accountant's ε exceeds the target (the "
                       "run is less private than the mapping claims)")
        elif spent < target * 0.99:
            verdict = ("the mapping is conservative: the accountant's ε is below the target "
                       "(more noise than the target needs)")
        else:
            verdict = "the mapping is matched by the accountant"
        return f"calibration={cfg['calibration']} for ε={target:g}: {head}; {verdict}{others}"

    def finish(self) -> dict[str, Any]:
        """Write summary, model and plots; returns the summary."""
        p = self.problem
        wall = self.wall_seconds()
        if self.rounds_done and not self.last_eval:
            self.last_eval = self.evaluate()
        epsilon = self.accounting.report()
        summary = {
            "runtime": self.runtime,
            "rounds_completed": self.rounds_done,
            "stopped_early": self.stop_reason or None,
            "initial_test_loss": self.first_loss,
            **self.last_eval,
            "epsilon_max": max(epsilon.values()) if epsilon else 0.0,
            "epsilon": epsilon,
            "server_epsilon": self.accounting.server_epsilon(),
            "epsilon_by_accountant": self.accounting.report_by_accountant(),
            "delta": float(self.config["delta"]),
            "accountant": self.config["accountant"],
            "calibration": ("none" if p.algorithm.noise_free
                            else "manual" if float(self.config["noise-multiplier"]) >= 0
                            else self.config["calibration"]),
            "protection": p.algorithm.protection,
            "privacy": self.privacy_statement(),
            "releases": self.releases(),
            "wall_seconds": wall,
            "seconds_per_round": wall / max(self.rounds_done, 1),
            "results": str(self.path),
        }
        summary["calibration_check"] = self.calibration_check()
        summary["warnings"] = list(self.warnings)
        params = self.algorithm.global_params(self.state).cpu()
        assert self.results is not None
        cfg, data = self.config, p.dataset
        title = (f"{p.algorithm.name} on {cfg['dataset']}, {p.num_clients} clients · "
                 f"ε = {summary['epsilon_max']:.4g} (δ = {cfg['delta']:g}, {cfg['accountant']})"
                 f" · seed {cfg['seed']} · {self.runtime}")
        chance = 1 / data.num_classes if data.task == "classification" else (
            0.5 if data.task == "binary" else None)
        self.results.finish(summary, p.model.load_into(params).state_dict(), title=title,
                            chance=chance)
        if self.echo:
            stop = f" (stopped: {self.stop_reason})" if self.stop_reason else ""
            print(f"done: {self.rounds_done} rounds in {wall:.1f} s{stop}; results in {self.path}",
                  flush=True)
            privacy = summary["privacy"]
            for line in (summary["calibration_check"],
                         f"WARNING: {privacy['note']}" if privacy["note"] in UNPROTECTED else
                         f"note: {privacy['note']}" if privacy["note"] == SEEDED else None):
                if line:
                    print(line, flush=True)
        log.info("results written to %s", self.path)
        return summary

