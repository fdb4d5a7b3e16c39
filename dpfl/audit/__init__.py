"""``dpfl audit``: an empirical lower bound on a run's ε, measured from outside the ledger.

The canary method (Jagielski, Ullman & Oprea, arXiv:2006.07709; Nasr et al.,
arXiv:2101.04535 and arXiv:2302.07956): run the client's mechanism many times on its data D
and on a neighbour D' holding a canary record (:mod:`dpfl.audit.canary`), score each run by
what the threat model lets an adversary observe, and turn the two score distributions into an
ε that the runs refute, with Clopper-Pearson confidence (:mod:`dpfl.audit.bounds`), and, beside
that bound, an ε estimate from a Gaussian-DP fit of the same scores (:mod:`dpfl.audit.gdp`;
Nasr et al., arXiv:2302.07956): far closer to the ledger from the same runs where the scores
are Gaussian, and an estimate, not a bound, where they are not.

Threat model, from what the algorithm declares:

* **record-level local DP** (every algorithm whose clients noise their own uploads): the
  adversary is the server. It sees every upload of the audited client in every round; a run's
  score is the sum, over rounds and uploads, of the upload along the canary's gradient at the
  round's model (for an upload in a broadcast basis, along the gradient's coordinates in it).
* **client-level central DP** (the server adds the noise): the adversary sees the models the
  server releases; the canary is a whole client (one more client holding the canary record),
  and a run's score is the sum over rounds of the model update along the canary's gradient.
  The server draws each round's participants as the algorithm does; where the schedule is
  public (DP-FTRL's epochs) the canary client is zeroed out rather than removed, and where the
  noise is correlated across rounds the score whitens the whole trajectory
  (:class:`TrajectoryScorer`).
* **distributed noise** (``distributed-noise``: each client draws a share of the noise and the
  server should see only the sum): the record-level audit of one client's uploads read alone,
  against the ledger's ε of that client's share (``epsilon_if_unmasked``), the guarantee left
  where secure aggregation is broken.

The runs are batched: record-level trials are clients of one engine federation; client-level
trials are independent small runs. The bound is compared with the ε the ledger reports for
the same releases.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dpfl.algorithms import ServerContext, State
from dpfl.algorithms.subspace import Subspace
from dpfl.audit import gradient_canary
from dpfl.audit.bounds import Bound, epsilon_lower_bound
from dpfl.audit.canary import Canary, client_trials, craft, record_trials
from dpfl.audit.gdp import GaussianFit, fit
from dpfl.privacy import Randomness, Release
from dpfl.problem import Problem, build_problem
from dpfl.rounds.client import ClientRuntime
from dpfl.rounds.transport import sum_rows
from dpfl.runconfig import RunConfig

__all__ = ["AuditResult", "audit", "full_batch"]


@dataclass(frozen=True)
class AuditResult:
    """An audit's outcome: the bound, the ledger's ε for the same releases, the scores."""

    algorithm: str
    threat_model: str
    canary: str
    bound: Bound
    gaussian: GaussianFit
    epsilon_ledger: float
    epsilon_target: float | None
    delta: float
    rounds: int
    seconds: float
    scores_out: np.ndarray
    scores_in: np.ndarray
    scored_uploads: tuple[str, ...]

    @property
    def ratio(self) -> float:
        """ε_lower / ε_ledger: near 1, the ledger is tight; above 1, the ledger is wrong."""
        if self.epsilon_ledger == 0 or not math.isfinite(self.epsilon_ledger):
            return 0.0 if self.bound.epsilon == 0 else math.nan
        return self.bound.epsilon / self.epsilon_ledger

    def summary(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "threat_model": self.threat_model,
                "canary": self.canary,
                "epsilon_lower": self.bound.epsilon, "confidence": self.bound.confidence,
                "epsilon_ledger": self.epsilon_ledger, "epsilon_target": self.epsilon_target,
                "ratio": self.ratio, "delta": self.delta, "rounds": self.rounds,
                "trials_per_side": len(self.scores_out),
                "evaluation_trials_per_side": self.bound.trials,
                "threshold": self.bound.threshold, "sign": self.bound.sign,
                "false_positive_rate": self.bound.fpr, "false_negative_rate": self.bound.fnr,
                "epsilon_empirical": self.bound.empirical,
                "scored_uploads": list(self.scored_uploads), "seconds": self.seconds,
                **self.gaussian.summary()}


def canary_radius(problem: Problem) -> float:
    """The largest clip radius the run uses (the canary's gradient is made far larger)."""
    hp = problem.algorithm.hp
    radii = [float(v) for f in dataclasses.fields(hp) if "clip" in f.name
             for v in [getattr(hp, f.name)] if isinstance(v, int | float) and 0 < v < math.inf]
    radii += [r.radius for r in problem.releases(0) if r.radius and math.isfinite(r.radius)]
    return max([1.0, *radii])


def projections(upload: torch.Tensor, unit: torch.Tensor,
                space: Subspace | None) -> torch.Tensor | None:
    """Each row of ``upload [C, ...]`` along ``unit``: directly for a model-shaped upload, in
    the coordinates of the uploads' subspace (:meth:`Algorithm.upload_space`) for a
    ``k``-entry one; None otherwise."""
    rows = upload.reshape(len(upload), -1).double()
    if rows.shape[1] == unit.numel():
        return rows @ unit.to(rows.device, torch.float64)
    if space is not None:
        coords = space.coords(unit.double()).to(rows.device)
        if coords.numel() == rows.shape[1]:
            return rows @ (coords / torch.linalg.vector_norm(coords).clamp_min(1e-30))
    return None


Direction = Callable[[torch.Tensor], torch.Tensor]  # the round's model [d] to a unit [d]


def input_direction(problem: Problem, canary: Canary) -> Direction:
    """The input canary's unit gradient at the round's model."""
    def direction(params: torch.Tensor) -> torch.Tensor:
        x, y = canary.x, canary.y
        grad = problem.model.per_sample_gradients(
            params.unsqueeze(0), x.reshape(1, 1, *x.shape).to(params),
            y.reshape(1, 1).to(params.device))[0, 0]
        return grad / torch.linalg.vector_norm(grad).clamp_min(1e-30)
    return direction


Released = tuple[Release, float | None, torch.Tensor]  # a server-side release: radius, value


@dataclass
class ObservedContext(ServerContext):
    """The server's context, keeping each value it publishes (the noisy sums of central DP:
    the models and radii the server releases are functions of them)."""

    released: list[Released] = dataclasses.field(default_factory=list)

    def publish(self, name: str, value: torch.Tensor, *, radius: float | None = None,
                charge: bool = True) -> torch.Tensor:
        self.released.append((self.releases[name], radius, value))
        return super().publish(name, value, radius=radius, charge=charge)


class Scorer:
    """Accumulates the score of one or more runs: what the adversary observes along the
    canary's gradient at the round's model (``direction``)."""

    def __init__(self, problem: Problem, direction: Direction, runs: int) -> None:
        self.problem = problem
        self.direction = direction
        self.scores = torch.zeros(runs, dtype=torch.float64)
        self.scored: set[str] = set()

    def observe(self, unit: torch.Tensor, broadcast: State, uploads: State, state: State,
                released: list[Released], participants: list[int]) -> None:
        """One exchange: its broadcast, every client's uploads, the server's state after it,
        the server-side releases it drew and the clients the server summed."""
        raise NotImplementedError

    def result(self) -> torch.Tensor:
        """The scores of the runs observed (after the last exchange)."""
        return self.scores


class UploadScorer(Scorer):
    """Record-level local DP: every client's uploads (one score per client)."""

    def observe(self, unit: torch.Tensor, broadcast: State, uploads: State, state: State,
                released: list[Released], participants: list[int]) -> None:
        space = self.problem.algorithm.upload_space(broadcast, unit.device)
        for name, values in uploads.items():
            if (along := projections(values, unit, space)) is not None:
                self.scores += along.cpu()
                self.scored.add(name)


class ControlVariateScorer(UploadScorer):
    """DP-SCAFFOLD (option II): the server rebuilds each round's noisy steps from the uploads
    and scores those. A client's control variate after round t is the mean of the round's K
    noisy steps, c_i⁺ = c_i − c + (x − y_K)/(Kη) = (1/K)·Σ_k g̃_k, and the server holds it as
    the sum of the client's Δc uploads: each round's canary shift is in it once, with the
    round's noise alone. The plain sum of the uploads telescopes instead (Δc_t = c_{i,t} −
    c_{i,t−1}, and Δy_t carries round t's steps less K·η·c_{i,t−1}, round t−1's), so over the
    rounds only about one round's shift would survive. The gradient canary's direction is the
    same in every round, so the projections add up as the control variates do."""

    def __init__(self, problem: Problem, direction: Direction, runs: int) -> None:
        super().__init__(problem, direction, runs)
        self.control = torch.zeros(runs, dtype=torch.float64)

    def observe(self, unit: torch.Tensor, broadcast: State, uploads: State, state: State,
                released: list[Released], participants: list[int]) -> None:
        self.control += projections(uploads["dc"], unit, None).cpu()
        self.scores += self.control
        self.scored.add("dc")


class SumScorer(UploadScorer):
    """Secure aggregation: the server sees each exchange's sum of the uploads, nothing else
    (one score, of the run)."""

    def observe(self, unit: torch.Tensor, broadcast: State, uploads: State, state: State,
                released: list[Released], participants: list[int]) -> None:
        super().observe(unit, broadcast, {k: v.sum(dim=0, keepdim=True)
                                          for k, v in uploads.items()}, state, released,
                        participants)


#: the record-level adversary's statistic where an algorithm's uploads are not its noisy
#: releases themselves but a post-processing the server can undo (by algorithm name)
RECORD_SCORERS: dict[str, type[UploadScorer]] = {"dp-scaffold": ControlVariateScorer}


class ReleaseScorer(Scorer):
    """Client-level central DP with the counted canary client (:func:`counted_canary`):
    every noisy sum the server releases, each along the canary client's contribution to it and
    weighted by that contribution over the noise variance, Σ s·y/σ²: the likelihood-ratio
    statistic of independent Gaussian releases, whose μ² add. With DP-FedAvg-quantile this
    counts the clipped-count release beside the update's (about a quarter of the budget's RDP
    in a small federation), which the model alone does not show."""

    def observe(self, unit: torch.Tensor, broadcast: State, uploads: State, state: State,
                released: list[Released], participants: list[int]) -> None:
        for release, radius, noisy in released:
            shift = release.sensitivity(radius)
            std = release.noise_multiplier * shift
            value = noisy.double().reshape(-1)
            along = value @ unit.double() if value.numel() == unit.numel() else value.sum()
            self.scores += float(along) * (shift / std ** 2 if std > 0 else 1.0)
            self.scored.add(release.name)


class TrajectoryScorer(Scorer):
    """Client-level central DP whose noise is correlated across rounds (DP-FTRL's tree, banded
    factorizations: :meth:`~dpfl.algorithms.ftrl.DPFTRL.noise_matrix`): every release along
    the canary's direction, a_t, against the canary's shift, m_t = its clip S in the rounds it
    took part in and 0 in the others, scored by the likelihood-ratio statistic of Gaussian
    noise of covariance Σ = σ²MMᵀ across the rounds, mᵀΣ⁻¹a. An adversary who sees the whole
    trajectory can subtract what it knows of a round's noise from the other rounds' releases;
    summing the releases alone would not."""

    def __init__(self, problem: Problem, direction: Direction, runs: int) -> None:
        super().__init__(problem, direction, runs)
        self.along: list[float] = []
        self.shifts: list[float] = []
        self.std = 0.0
        self.canary = problem.num_clients - 1

    def observe(self, unit: torch.Tensor, broadcast: State, uploads: State, state: State,
                released: list[Released], participants: list[int]) -> None:
        for release, _, noisy in released:
            self.along.append(float(noisy.double().reshape(-1) @ unit.double()))
            taking = self.canary in participants
            self.shifts.append(self.problem.algorithm.clip_radius(state) if taking else 0.0)
            self.std = release.std()
            self.scored.add(release.name)

    def result(self) -> torch.Tensor:
        matrix = self.problem.algorithm.noise_matrix(len(self.along))
        covariance = self.std ** 2 * matrix @ matrix.T
        shifts = torch.tensor(self.shifts, dtype=torch.float64)
        along = torch.tensor(self.along, dtype=torch.float64)
        weights = torch.linalg.solve(covariance, shifts)
        return (weights @ along).reshape(1).expand_as(self.scores).clone()


Rewrite = Callable[[State, State], State]  # the round's uploads and server state to uploads


def counted_canary(problem: Problem, client: int) -> Rewrite:
    """Client ``client``'s uploads other than its model-shaped update (a count's bit) set to
    the largest value their release allows, its radius (a bit of 1: "unclipped"). Its update
    stays its own, which the algorithm clips to the round's radius (along e_θ, the gradient
    canary's): a client whose update has exactly that norm sends the same update, left as it is
    by the clip, and is counted as unclipped. So this is a client some data produce
    (client-level DP covers any update), and unlike the canary client as it is (clipped, so
    not counted) it moves every release by its sensitivity; its update still goes through the
    algorithm's clip, which a broken clip would let through whole."""
    algorithm = problem.algorithm
    queries = {q.name: q for q in algorithm.server_queries()}
    released_by = {name: upload.release for exchange in algorithm.exchanges
                   for name, upload in exchange.uploads.items()}

    def rewrite(uploads: State, state: State) -> State:
        crafted = dict(uploads)
        for name, values in uploads.items():
            radius = queries[released_by[name]].radius
            if values[client].numel() != problem.model.d and radius is not None:
                crafted[name] = values.clone()
                crafted[name][client] = radius
        return crafted
    return rewrite


class ModelScorer(Scorer):
    """Client-level central DP: the model the server releases after each exchange (one
    score, of the run)."""

    def __init__(self, problem: Problem, direction: Direction, runs: int) -> None:
        super().__init__(problem, direction, runs)
        self.last = problem.x0.to(problem.device)
        self.scored = {"model"}

    def observe(self, unit: torch.Tensor, broadcast: State, uploads: State, state: State,
                released: list[Released], participants: list[int]) -> None:
        params = self.problem.algorithm.global_params(state)
        self.scores += float((params - self.last).double() @ unit.double())
        self.last = params


def play(problem: Problem, rng: Randomness, rounds: int, server_clients: list[int],
         scorer: Scorer, rewrite: Rewrite | None = None, *,
         sampled: bool = False) -> list[list[int]]:
    """``rounds`` rounds of every client of ``problem`` (each takes part in every exchange);
    the server steps on the sums of ``server_clients`` (the last clients), or with
    ``sampled`` of the clients its algorithm draws each round
    (:meth:`~dpfl.algorithms.Algorithm.participants`: Poisson sampling, DP-FTRL's epochs), and
    ``scorer`` observes every exchange; ``rewrite`` replaces uploads before the server sums
    them. Returns each round's participants."""
    algorithm, device = problem.algorithm, problem.device
    runtime = ClientRuntime(algorithm, problem.releases, rng, device=device)
    cohort = problem.full_cohort()
    states = algorithm.init_client_state(problem.num_clients)
    state = algorithm.init_server_state(problem.x0.to(device))
    server_releases = {r.name: r for r in problem.server_releases()}
    schedule: list[list[int]] = []
    for server_round in range(1, rounds + 1):
        taking = (sorted(algorithm.participants(server_round, list(range(problem.num_clients)),
                                                rng)) if sampled else server_clients)
        rows = (torch.tensor(taking, dtype=torch.long) if sampled
                else slice(server_clients[0], None))
        ctx = ObservedContext(server_round=server_round, rng=rng,
                              participants=taking, num_clients=problem.num_clients,
                              releases=server_releases, num_rounds=rounds,
                              client_releases=problem.releases)
        state = algorithm.begin_round(state, ctx)
        unit = scorer.direction(algorithm.global_params(state).to(device))
        for exchange in algorithm.round_exchanges(server_round):
            broadcast = algorithm.broadcast(exchange.name, state, server_round)
            uploads, states, _ = runtime.step(exchange.name, server_round, broadcast, states,
                                              cohort)
            if rewrite is not None:
                uploads = rewrite(uploads, state)
            sums = (sum_rows({k: v[rows] for k, v in uploads.items()}, device) if taking
                    else algorithm.zero_sums(exchange.name))
            ctx.released.clear()
            state = algorithm.server_step(exchange.name, state, sums, ctx)
            scorer.observe(unit, broadcast, uploads, state, ctx.released, taking)
        schedule.append(taking)
    return schedule


# out and in scores, the federation, the clients whose ledger is compared, the uploads scored,
# and how many times those clients took part (None: in every round)
Measured = tuple[np.ndarray, np.ndarray, Problem, list[int], set[str], int | None]


def record_level(source: Problem, client: int, trials: int, rounds: int,
                 canary: str) -> Measured:
    """Out and in scores of ``trials`` runs each of client ``client``'s mechanism, batched as
    the clients of one federation (:func:`dpfl.audit.canary.record_trials`,
    :func:`dpfl.audit.gradient_canary.record_trials`); the federation, an out and an in trial
    client (whose ledgers are compared), the uploads scored."""
    radius = canary_radius(source)
    if canary == "gradient":
        federation = gradient_canary.record_trials(source, client, trials, radius)
        scorer = RECORD_SCORERS.get(source.algorithm.name, UploadScorer)(
            federation, constant(gradient_canary.direction(federation)), federation.num_clients)
    else:
        federation, record = record_trials(source, client, trials, radius)
        scorer = UploadScorer(federation, input_direction(federation, record),
                              federation.num_clients)
    rng = Randomness(source.config.run.seed, secure=source.config.privacy.secure_noise)
    play(federation, rng, rounds, [federation.num_clients - 1], scorer)
    scores = scorer.scores.numpy()
    return (scores[:trials], scores[trials:2 * trials], federation, [0, trials],
            scorer.scored, None)


def client_level(source: Problem, client: int, trials: int, rounds: int,
                 canary: str) -> Measured:
    """Out and in scores of ``trials`` runs each of the whole federation without and with a
    canary client (:func:`dpfl.audit.canary.client_trials`,
    :func:`dpfl.audit.gradient_canary.client_trials`, the latter counted as unclipped:
    :func:`counted_canary`), each run with its own noise; the federation with the canary
    client, that client (whose ledger is compared), the releases scored, and the most rounds
    the canary client took part in.

    The server draws each round's participants as the algorithm does (Poisson sampling,
    DP-FTRL's epochs). Where the algorithm's schedule is public and fixed
    (:attr:`~dpfl.algorithms.Algorithm.zero_out`), the world without the canary is the world
    with it whose canary client sends zero (zero-out neighbours: the same schedule in both),
    and where its noise is correlated across rounds the runs are scored on their whole
    trajectory (:class:`TrajectoryScorer`)."""
    radius = canary_radius(source)
    rewrites: list[Rewrite | None] = [None, None]
    if canary == "gradient":
        worlds = gradient_canary.client_trials(source, radius)
        last = worlds[1].num_clients - 1
        # the canary client's update descends its gradient: along −e_θ, where its count adds +1
        direction, score = constant(-gradient_canary.direction(worlds[1])), ReleaseScorer
        rewrites[1] = counted_canary(worlds[1], last)
        if worlds[1].algorithm.noise_matrix(1) is not None:
            score = TrajectoryScorer
        if worlds[1].algorithm.zero_out:
            worlds, rewrites[0] = (worlds[1], worlds[1]), zeroed(last)
    else:
        record = craft(source, source.partitions[client], radius)
        worlds = (source, client_trials(source, record))
        direction, score = input_direction(worlds[1], record), ModelScorer
    scores, scored, taken = whole_runs(worlds, score, direction, trials, rounds,
                                       source.config.run.seed,
                                       source.config.privacy.secure_noise,
                                       (rewrites[0], rewrites[1]), sampled=True)
    return scores[0], scores[1], worlds[1], [worlds[1].num_clients - 1], scored, taken


def zeroed(client: int) -> Rewrite:
    """Client ``client``'s uploads set to zero: a client whose data contribute nothing."""
    def rewrite(uploads: State, state: State) -> State:
        crafted = {name: values.clone() for name, values in uploads.items()}
        for values in crafted.values():
            values[client] = 0
        return crafted
    return rewrite


def whole_runs(worlds: tuple[Problem, Problem], score: type[Scorer], direction: Direction,
               trials: int, rounds: int, seed: int, secure: bool,
               rewrites: tuple[Rewrite | None, Rewrite | None] = (None, None), *,
               sampled: bool = False) -> tuple[list[np.ndarray], set[str], int | None]:
    """``trials`` whole runs of each world, each with its own noise, every client in every
    exchange (``sampled``: the participants the algorithm draws): their scores, what was
    scored, and (``sampled``) the most rounds the last client of the world with the canary
    took part in."""
    seeds, scores, scored = Randomness(seed), [], set()
    taken = 0
    for side, problem in enumerate(worlds):
        runs = []
        for run in range(trials):
            scorer = score(problem, direction, 1)
            rng = Randomness(seeds.key(run, 0, f"audit-world-{side}"), secure=secure)
            schedule = play(problem, rng, rounds, list(range(problem.num_clients)), scorer,
                            rewrites[side], sampled=sampled)
            runs.append(float(scorer.result()[0]))
            scored |= scorer.scored
            if side:
                taken = max(taken, sum(problem.num_clients - 1 in p for p in schedule))
        scores.append(np.asarray(runs))
    return scores, scored, taken if sampled else None


def sum_level(source: Problem, client: int, trials: int, rounds: int,
              canary: str) -> Measured:
    """Out and in scores of ``trials`` whole federations each, client ``client``'s data
    without and with the gradient canary (:func:`dpfl.audit.gradient_canary.sum_worlds`), each
    scored on the sums a secure-aggregation server sees (:class:`SumScorer`)."""
    if canary != "gradient":
        raise ValueError("the secure sum's audit takes the gradient canary")
    worlds = gradient_canary.sum_worlds(source, client, canary_radius(source))
    direction = constant(gradient_canary.direction(worlds[1]))
    (out, inn), scored, _ = whole_runs(worlds, SumScorer, direction, trials, rounds,
                                       source.config.run.seed,
                                       source.config.privacy.secure_noise)
    return out, inn, worlds[1], [client], scored, None


def ledger_epsilon(problem: Problem, clients: list[int], rounds: int, *,
                   unmasked: bool = False, taken: int | None = None) -> float:
    """The largest ε the ledger reports for ``clients`` after ``rounds`` rounds of every
    exchange (central releases included; of each client's own share of split noise when
    ``unmasked``), ``clients`` taking part in ``taken`` of them (None: every one)."""
    accounting = problem.accounting()
    for server_round in range(1, rounds + 1):
        for exchange in problem.algorithm.round_exchanges(server_round):
            if problem.algorithm.population_round(server_round):
                accounting.charge_population(exchange.name)
            if taken is None or server_round <= taken:
                accounting.charge(clients, exchange.name)
    if unmasked:
        return max((accounting.report_unmasked() or {}).values())
    return max(accounting.epsilon(c) for c in clients)


def full_batch(values: dict[str, Any]) -> tuple[RunConfig, int]:
    """``values`` with every batch a client's whole data, and the client to audit: the one
    with the fewest records, whose batch that is (no sampling amplification: the canary is in
    every step, the tightest setting for this method)."""
    sizes = list(map(len, build_problem(RunConfig(values)).partitions))
    if "batch-size" in RunConfig(values).reads:
        values = {**values, "batch-size": min(sizes)}
    return RunConfig(values), sizes.index(min(sizes))


THREATS = {
    "record": ("record-level local DP: the server sees every upload of the client",
               record_level),
    "client": ("client-level central DP: the adversary sees every model the server releases",
               client_level),
    "sum": ("record-level, secure aggregation: the server sees only the sum of every "
            "exchange's uploads", sum_level),
    # distributed noise: the server that reads one client's upload alone (secure aggregation
    # broken) against the ledger's guarantee of that client's own share of the noise
    "unmasked": ("record-level, distributed noise unmasked: the server reads every upload of "
                 "the client alone, noised by its own share", record_level),
}


#: the canaries: a crafted input (any model, as a user's data could hold it), or a gradient
#: (a white-box canary: the model gains a coordinate only the canary moves;
#: :mod:`dpfl.audit.gradient_canary`)
CANARIES = ("gradient", "input")


def constant(unit: torch.Tensor) -> Direction:
    """A direction that is ``unit`` at every model."""
    return lambda params: unit


#: what a secure-aggregation server is audited on: the sums it sees (following the protocol),
#: or one client's uploads read alone
VIEWS = ("sum", "upload")


def audit(config: RunConfig, *, trials: int = 1000, confidence: float = 0.95,
          client: int = 0, canary: str = "gradient", view: str | None = None) -> AuditResult:
    """Audit ``config``'s algorithm on client ``client``'s data with ``trials`` runs with and
    ``trials`` runs without the canary (one of :data:`CANARIES`); under secure aggregation,
    ``view`` (:data:`VIEWS`) is the server's: the sums (by default: against the ledger's ε) or
    one client's uploads (against ``epsilon_if_unmasked`` with distributed noise)."""
    if canary not in CANARIES:
        raise ValueError(f"canary must be one of {CANARIES}, got {canary!r}")
    if view not in (None, *VIEWS):
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
    started = time.perf_counter()
    source = build_problem(config)
    secure, split = config.secure.secure_aggregation, config.secure.distributed_noise
    if view == "sum" and not secure:
        raise ValueError("the sum view is a secure-aggregation server's: the run has none")
    if secure:  # the run's calibration and shares, not those of the trials' federations
        pinned = {"min_client_records": config.privacy.min_client_records
                  or source.smallest_client()}
        if split:
            pinned["min_survivors"] = source.survivors
        source = build_problem(config.replace(**pinned))
    key = ("client" if source.algorithm.central_releases() else
           "sum" if secure and view != "upload" else "unmasked" if split else "record")
    threat, measure = THREATS[key]
    split = key == "unmasked"
    rounds = config.run.num_server_rounds
    out, inn, problem, charged, scored, taken = measure(source, client, trials, rounds, canary)
    delta = config.privacy.delta
    bound = epsilon_lower_bound(out, inn, delta=delta, confidence=confidence)
    target = (config.privacy.epsilon if config.privacy.noise_multiplier < 0
              and not source.algorithm.noise_free else None)
    return AuditResult(algorithm=source.algorithm.name, threat_model=threat, canary=canary,
                       bound=bound,
                       gaussian=fit(out, inn, delta=delta, confidence=confidence),
                       epsilon_ledger=ledger_epsilon(problem, charged, rounds,
                                                     unmasked=split, taken=taken),
                       epsilon_target=target, delta=delta, rounds=rounds,
                       seconds=time.perf_counter() - started, scores_out=out, scores_in=inn,
                       scored_uploads=tuple(sorted(scored)))
