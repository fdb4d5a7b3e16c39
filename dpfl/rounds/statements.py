"""What a run says about itself: its privacy statement, how the accountant's ε compares with
the ε its noise was calibrated for, and why it stopped. Pure functions of the run's settings
and ledger, shared by the round loop and its report."""

from __future__ import annotations

import signal
from collections import Counter
from typing import Any

from dpfl.privacy import CALIBRATIONS, Accounting
from dpfl.privacy.accountants import ACCOUNTANTS
from dpfl.problem import Problem
from dpfl.runconfig import RunConfig

NON_PRIVATE = ("non-private-diagnostics=true: clients send exact, un-noised training statistics "
               "and the server may read their training data; this run has NO privacy guarantee "
               "against the server")

CENTRAL = ("central DP: clients send clipped, un-noised updates and the server adds the noise "
           "(a trusted server); the ε is client-level and holds for what the server releases, "
           "not against the server")

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

#: the statements of runs that protect nothing against the server by their settings alone
UNPROTECTED = (NON_PRIVATE, CENTRAL, NOISE_FREE)


class Stopped(BaseException):
    """Flower was asked to end the ServerApp with signal ``signum`` (its SuperLink or SuperExec
    went away, or the run was stopped). Raised into the round loop in place of Flower's own exit
    (:func:`dpfl.server.app.main`), so that the results folder is closed before that exit starts
    its clock: Flower ends the process 5 s after it, whatever is still being written."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def failure(server_round: int, exc: BaseException) -> str:
    """Why a run stopped on ``exc`` in round ``server_round``, for its summary."""
    if isinstance(exc, Stopped):
        return (f"failed in round {server_round}: Flower ended the ServerApp "
                f"({signal.Signals(exc.signum).name}): the SuperLink was lost or restarted, or "
                f"the run was stopped")
    if isinstance(exc, SystemExit):
        return (f"failed in round {server_round}: Flower ended the ServerApp (exit status "
                f"{exc.code}): the SuperLink was lost or restarted, or the run was stopped")
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted in round {server_round}"
    return f"failed in round {server_round}: {type(exc).__name__}: {exc}"


def noise_sources(problem: Problem, runtime: str, accounting: Accounting,
                  reported: dict[int, str]) -> dict[str, int]:
    """How many clients drew their noise from each source
    (:data:`~dpfl.privacy.randomness.MODES`): as their nodes said (``reported``, Flower;
    ``unknown`` before any has), else as the run config says (the engine)."""
    if runtime == "engine":  # the clients that took part, as under Flower
        return {"secure" if problem.config.privacy.secure_noise else "seeded":
                len(accounting.charged) or problem.num_clients}
    return dict(Counter(reported.values())) or {"unknown": problem.num_clients}


def privacy_statement(problem: Problem, sources: dict[str, int]) -> dict[str, Any]:
    """Whether the run's ε holds against the server, and why not (``sources``: where the
    clients' noise came from, :func:`noise_sources`)."""
    algorithm = problem.algorithm
    if problem.config.evaluation.non_private_diagnostics:
        return {"guarantee_against_server": False, "note": NON_PRIVATE}
    if algorithm.central_releases():
        return {"guarantee_against_server": False, "note": CENTRAL}
    if any(r.noise_multiplier <= 0 for c in range(problem.num_clients)
           for r in problem.releases(c)):
        return {"guarantee_against_server": False, "note": NOISE_FREE}
    if sources.get("seeded"):
        return {"guarantee_against_server": False, "note": SEEDED, "noise": sources}
    if sources.get("unknown"):  # a Flower run before any node has replied
        return {"guarantee_against_server": None, "note": NODES_DECIDE, "noise": sources}
    return {"guarantee_against_server": True, "note": SECRET, "noise": sources}


def secure_aggregation_statement(problem: Problem, accounting: Accounting,
                                 runtime: str) -> dict[str, Any]:
    """How a run with ``secure-aggregation`` summed its uploads (each upload's grid) and, with
    ``distributed-noise``, what it guarantees against which server: the ledger's ε against one
    that sees only the sums, and the ε of one client's share of the noise alone, against one
    that reads that client's upload."""
    from dpfl.rounds.secure_sum import quantisations

    grids = {e.name: {key: {"step": 2.0 ** -g.bits, "range": g.bound * 2.0 ** -g.bits}
                      for key, g in quantisations(problem, e.name).items()}
             for e in problem.algorithm.exchanges}
    out: dict[str, Any] = {
        "sum": ("emulated: the engine quantises every upload and sums the integers, as the "
                "nodes' secure sum would" if runtime == "engine" else
                "Flower's SecAgg+ between the nodes: each node's quantised sum masked, only "
                "the total unmasked"),
        "grids": grids,
    }
    if not problem.config.secure.distributed_noise:
        return out
    unmasked = accounting.report_unmasked()
    survivors = problem.survivors
    out["distributed_noise"] = {
        "min_survivors": survivors,
        "epsilon_if_unmasked": max(unmasked.values()) if unmasked else None,
        "note": (f"each client drew its noise at 1/√{survivors} of each release's std: the "
                 f"ε (epsilon_max) holds against a server that sees only the sum of at least "
                 f"{survivors} clients' uploads; one that reads a client's upload alone (secure "
                 f"aggregation broken, or more clients colluding with it than the protocol "
                 f"tolerates) holds epsilon_if_unmasked against it"),
    }
    return out


def calibration_name(problem: Problem) -> str:
    """How the run's noise was set: ``none`` (no noise), ``manual`` (noise-multiplier given),
    else its calibration."""
    cfg = problem.config
    return ("none" if problem.algorithm.noise_free
            else "manual" if cfg.privacy.noise_multiplier >= 0 else cfg.privacy.calibration)


def calibration_check(problem: Problem, accounting: Accounting, rounds_done: int,
                      stop_reason: str) -> str | None:
    """How the ε the noise was calibrated for compares with the accountant's ε of the noise
    actually used (None when noise-multiplier was given directly, or the algorithm adds no
    noise), which accountant the run's guarantee rests on, and what the ledger's other
    accountants give for the same noise, and why they differ."""
    cfg: RunConfig = problem.config
    spent = accounting.extremes()[0]
    if cfg.privacy.noise_multiplier >= 0 or problem.algorithm.noise_free or not (
            accounting.report() or accounting.population_epsilon() is not None):
        return None
    by_accountant = list(accounting.report_by_accountant().items())
    others = "; ".join(f"{name} {value:.4g} ({ACCOUNTANTS.get(name).about})"
                       for name, value in by_accountant[1:])
    if others:
        others = (f". The same noise by the ledger's other accountants: {others}: other "
                  f"bounds on the same releases, not the run's guarantee")
    rounds = cfg.run.num_server_rounds
    head = (f"the {cfg.privacy.accountant} accountant, which the run's guarantee rests on, gives "
            f"ε={spent:.4g} at δ={cfg.privacy.delta:g} after {rounds_done} rounds")
    if not CALIBRATIONS.get(cfg.privacy.calibration, problem.algorithm.name).targets_epsilon:
        return f"calibration={cfg.privacy.calibration} (noise set directly): {head}{others}"
    target = cfg.privacy.epsilon
    if rounds_done < rounds:
        verdict = (f"the run stopped after {rounds_done} of the {rounds} rounds the noise was "
                   f"calibrated for ({stop_reason or 'stopped'}): ε={spent:.4g} is what it "
                   f"spent")
    elif spent > target * 1.01:
        verdict = ("the mapping is optimistic: the accountant's ε exceeds the target (the run "
                   "is less private than the mapping claims)")
    elif spent < target * 0.99:
        verdict = ("the mapping is conservative: the accountant's ε is below the target (more "
                   "noise than the target needs)")
    else:
        verdict = "the mapping is matched by the accountant"
    return f"calibration={cfg.privacy.calibration} for ε={target:g}: {head}; {verdict}{others}"
