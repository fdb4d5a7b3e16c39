"""dp-ftrl: the tree's noise (its prefix sums and correlations against an independent
construction of the dyadic intervals) and the banded factor's (against the matrix square root
and a linear solve), the schedules, the per-draw noise, the ledger against dp-accounting, a
resumed run, and Flower = engine."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math

import dp_accounting
import numpy as np
import pytest
import scipy.linalg
import torch

from dpfl.algorithms import ServerContext
from dpfl.engine import run
from dpfl.errors import ConfigError
from dpfl.privacy import Randomness, banded, blt
from dpfl.privacy.tree import increment, tree_depth
from dpfl.problem import build_problem
from dpfl.runconfig import RunConfig

#: the BLT tests' marks: skipped without dpfl[blt], and run on one worker, so that the strategy
#: they share (12 rounds, a client every 4) is optimised once a session
NEEDS_BLT = [pytest.mark.skipif(importlib.util.find_spec("jax_privacy") is None,
                                reason="noise-correlation='blt' needs dpfl[blt] (jax_privacy)"),
             pytest.mark.xdist_group("blt")]


def needs_blt(test):
    for mark in NEEDS_BLT:
        test = mark(test)
    return test

VALUES = {"algorithm": "dp-ftrl", "dataset": "digits", "model": "logistic",
          "num-partitions": 40, "num-server-rounds": 12, "batch-size": 16, "local-steps": 2,
          "learning-rate": 0.5, "clip": 0.1, "fraction-train": 0.25, "epsilon": 4.0,
          "delta": 1e-4, "seed": 3}


def _config(tmp_path, name="run", **changes):
    values = {**VALUES, "results-dir": str(tmp_path), "run-name": name}
    values.update({k.replace("_", "-"): v for k, v in changes.items()})
    return RunConfig(values)


def _tiling(p: int) -> list[tuple[int, int]]:
    """The dyadic intervals [a, b] that tile [1, p], largest first, found by search (not by
    bits): the largest aligned power-of-two block starting at the next uncovered round."""
    nodes, start = [], 1
    while start <= p:
        size = 1
        while (start - 1) % (2 * size) == 0 and start + 2 * size - 1 <= p:
            size *= 2
        nodes.append((start, start + size - 1))
        start += size
    return nodes


def _run_tree(rounds: int, d: int, draws: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    rows, out = torch.zeros(tree_depth(rounds), d, dtype=torch.float64), []
    for p in range(1, rounds + 1):
        noise, rows = increment(rows, p, draws[p])
        out.append(noise)
    return out


def test_the_increments_sum_to_the_prefix_noise_of_the_dyadic_tiling():
    """Node [a, b] is drawn in round b; the noise released by round p, summed, is the sum of
    the draws of the nodes tiling [1, p], popcount(p) of them, exactly."""
    rounds = 23
    draws = {p: torch.randint(-1000, 1000, (5,)).double() for p in range(1, rounds + 1)}
    increments = _run_tree(rounds, 5, draws)
    for p in range(1, rounds + 1):
        tiling = _tiling(p)
        assert len(tiling) == bin(p).count("1")
        expected = sum(draws[b] for _, b in tiling)
        assert torch.equal(sum(increments[:p]), expected)


@pytest.mark.parametrize("rounds", [1, 2, 3, 4, 5, 7, 8, 100, 1023, 1024])
def test_the_depth_is_the_most_nodes_one_round_enters(rounds):
    """h = ⌈log2(R + 1)⌉ (dp-accounting's) is the largest number of dyadic intervals within
    [1, R] that contain one round, counted."""
    entered = max(sum(1 for a, b in {n for p in range(1, rounds + 1) for n in _tiling(p)}
                      if a <= leaf <= b) for leaf in range(1, rounds + 1))
    assert tree_depth(rounds) == entered


def test_the_increments_are_correlated_as_the_tree_says():
    """Over 200,000 coordinates of N(0, 1) draws, the covariance of the increments e_p, e_q
    equals Σ over nodes of (±1)(±1): e = B ξ with B read off the tilings."""
    rounds, d = 8, 200_000
    generator = torch.Generator().manual_seed(0)
    draws = {p: torch.randn(d, generator=generator, dtype=torch.float64)
             for p in range(1, rounds + 1)}
    e = torch.stack(_run_tree(rounds, d, draws))
    b = torch.zeros(rounds, rounds, dtype=torch.float64)  # prefix noise = Σ ξ_end over tiling
    for p in range(1, rounds + 1):
        for _, end in _tiling(p):
            b[p - 1, end - 1] += 1
    increments = b - torch.cat([torch.zeros(1, rounds, dtype=torch.float64), b[:-1]])
    expected = increments @ increments.T
    assert torch.allclose(e @ e.T / d, expected, atol=0.02)
    prefix = e.cumsum(dim=0)
    variances = prefix.var(dim=1)
    assert torch.allclose(variances, torch.tensor([bin(p).count("1") for p in range(1, 9)],
                                                  dtype=torch.float64), rtol=0.02)


def _banded_factor(coefficients: list[float], rounds: int) -> np.ndarray:
    """C: lower-triangular Toeplitz, its first column the coefficients, then zeros."""
    column = np.zeros(rounds)
    column[:len(coefficients)] = coefficients
    return scipy.linalg.toeplitz(column, np.zeros(rounds))


def test_the_banded_square_root_is_the_workloads_square_root():
    """With as many bands as rounds, C·C is A (the prefix sums' ones), C being the square root
    scipy computes of A; with fewer, C is its band."""
    rounds = 12
    workload = np.tril(np.ones((rounds, rounds)))
    root = scipy.linalg.sqrtm(workload).real
    full = _banded_factor(banded.square_root_coefficients(rounds), rounds)
    assert np.allclose(full, root, atol=1e-10) and np.allclose(full @ full, workload)
    four = _banded_factor(banded.square_root_coefficients(4), rounds)
    assert np.allclose(four, np.tril(np.triu(root, -3)), atol=1e-10)


def test_the_banded_recurrence_is_the_factors_inverse():
    """The streamed increments are C⁻¹Z, solved for by numpy from the matrix."""
    rounds, coefficients = 20, banded.square_root_coefficients(5)
    z = torch.randn(rounds, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    history, streamed = torch.zeros(4, 3, dtype=torch.float64), []
    for t in range(rounds):
        noise, history = banded.increment(history, coefficients, z[t])
        streamed.append(noise)
    expected = np.linalg.solve(_banded_factor(coefficients, rounds), z.numpy())
    assert np.allclose(torch.stack(streamed).numpy(), expected, atol=1e-12)


def test_rounds_bands_apart_move_the_factor_by_root_k_times_the_column_norm():
    """A client every R ≥ b rounds: its columns of C do not overlap, ‖Σ columns‖ = √k·‖c‖ (less
    where the run cuts its last columns); rounds closer than b overlap and move it further."""
    rounds, bands, every = 30, 4, 6
    coefficients = banded.square_root_coefficients(bands)
    factor, norm = _banded_factor(coefficients, rounds), banded.column_norm(coefficients)
    for offset in range(every):
        taken = list(range(offset, rounds, every))
        moved = np.linalg.norm(factor[:, taken].sum(axis=1))
        assert moved <= math.sqrt(len(taken)) * norm + 1e-12
        if taken[-1] <= rounds - bands:
            assert moved == pytest.approx(math.sqrt(len(taken)) * norm)
    close = np.linalg.norm(factor[:, [0, 2]].sum(axis=1))
    assert close > math.sqrt(2) * norm + 0.1


def test_each_client_takes_part_once_an_epoch(tmp_path):
    problem = build_problem(_config(tmp_path, num_partitions=41))
    algorithm, rng = problem.algorithm, Randomness(3)
    assert (algorithm.cohort, algorithm.epoch_rounds, algorithm.correlation.rows) == (10, 4, 3)
    clients = list(range(41))  # one sits out each epoch
    epochs = []
    for epoch in range(3):
        rounds = [algorithm.participants(epoch * 4 + p, clients, rng) for p in range(1, 5)]
        taken = [c for r in rounds for c in r]
        assert all(len(r) == 10 for r in rounds) and len(set(taken)) == 40
        epochs.append(taken)
    assert epochs[0] != epochs[1] != epochs[2]
    assert algorithm.participants(1, clients, Randomness(3)) == \
        algorithm.participants(1, clients, rng)
    with pytest.raises(ConfigError, match="fixed population"):
        algorithm.participants(2, clients[:-1], rng)
    cyclic = build_problem(_config(tmp_path, num_partitions=41, noise_correlation="banded"))
    assert cyclic.algorithm.correlation.rows == 3  # b = min(R, 32) = 4 bands
    blocks = [cyclic.algorithm.participants(r, clients, rng) for r in range(1, 13)]
    assert blocks[:4] == blocks[4:8] == blocks[8:]  # each client exactly R rounds apart
    with pytest.raises(ConfigError, match="bands"):
        build_problem(_config(tmp_path, noise_correlation="banded", bands=5))


def test_secure_noise_keeps_the_public_schedule(tmp_path):
    """Under ``secure-noise`` every draw is fresh, but an epoch's rounds must read one
    permutation (each client once an epoch, as the ledger charges), also in a process that
    starts mid-epoch (a resume): the schedule is drawn from the seed's stream, the seeded
    run's own."""
    clients = list(range(40))
    seeded = build_problem(_config(tmp_path)).algorithm
    expected = [seeded.participants(r, clients, Randomness(3)) for r in range(1, 9)]
    secure = build_problem(_config(tmp_path, secure_noise=True)).algorithm
    rounds = [secure.participants(r, clients, Randomness(3, secure=True)) for r in range(1, 7)]
    resumed = build_problem(_config(tmp_path, secure_noise=True)).algorithm
    rounds += [resumed.participants(r, clients, Randomness(3, secure=True)) for r in (7, 8)]
    assert rounds == expected
    assert all(len({c for r in rounds[e:e + 4] for c in r}) == 40 for e in (0, 4))


def test_noise_multiplier_is_each_nodes_std_over_s(tmp_path):
    """``noise-multiplier`` z: every node is N(0, (z·S)²), the tree's release multiplier is
    z/√h; the first round of a tree releases its first node alone."""
    problem = build_problem(_config(tmp_path, noise_multiplier=3.0, dataset="mnist",
                                    num_server_rounds=1))
    algorithm = problem.algorithm
    (release,) = problem.server_releases()
    assert release.noise_multiplier == pytest.approx(3.0 / math.sqrt(3))
    assert release.std() == pytest.approx(3.0 * 0.1)
    state = algorithm.init_server_state(problem.x0)
    charged = []
    ctx = ServerContext(1, Randomness(0), [], 40, releases={"model": release},
                        charge=charged.append)
    new = algorithm.server_step("train", state, algorithm.zero_sums("train"), ctx)
    noise = (new["x"] - state["x"]) * 10 / 1.0  # x + γ_g·m/s, m the first release
    assert noise.std().item() == pytest.approx(0.3, rel=0.02) and charged == [release]
    ctx = ServerContext(2, Randomness(0), [], 40, releases={"model": release},
                        charge=charged.append)
    algorithm.server_step("train", new, algorithm.zero_sums("train"), ctx)
    assert len(charged) == 1  # a tree is charged once, at its first round


def test_the_ledger_equals_dp_accountings_tree_aggregation_event(tmp_path):
    """Each client takes part once in each of the 3 epochs' trees; its ε is dp-accounting's
    ``SingleEpochTreeAggregationDpEvent`` (zero-out neighbours, sensitivity S per node, at the
    multiplier node std / S) composed over the trees."""
    summary = run(_config(tmp_path), echo=False)
    (release,) = summary["releases"]["server"]
    node_std = release["noise_multiplier"] * release["radius"]  # std of every node
    accountant = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
    accountant.compose(dp_accounting.SingleEpochTreeAggregationDpEvent(
        node_std / 0.1, 4), 3)
    expected = accountant.get_epsilon(1e-4)
    assert set(summary["epsilon"]) == set(range(40))
    assert all(e == pytest.approx(expected, rel=0.02) for e in summary["epsilon"].values())
    assert summary["epsilon_max"] <= 4.0 * (1 + 1e-4)
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text()
              .splitlines()]
    assert [r["participants"] for r in rounds] == [10] * 12
    assert summary["server_epsilon"] == pytest.approx(expected, rel=0.02)


def test_the_banded_ledger_equals_dp_accountings_gaussians(tmp_path):
    """Banded noise: each of a client's 3 participations (every 4 rounds, b = 4) is a Gaussian
    of multiplier z/‖c‖, composed: dp-accounting's RDP of that Gaussian, composed 3 times."""
    summary = run(_config(tmp_path, noise_correlation="banded"), echo=False)
    _assert_charged_gaussians(summary, banded.column_norm(banded.square_root_coefficients(4)))


def _assert_charged_gaussians(summary: dict, norm: float) -> float:
    """Every client's ε is dp-accounting's RDP of 3 Gaussians of multiplier z/``norm`` (the
    release declared with radius S·``norm``), within ε = 4; returns z, each draw's std over S."""
    (release,) = summary["releases"]["server"]
    z = release["noise_multiplier"] * release["radius"] / 0.1
    assert release["radius"] == pytest.approx(0.1 * norm)
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(z / norm), 3)
    expected = accountant.get_epsilon(1e-4)
    assert all(e == pytest.approx(expected, rel=0.02) for e in summary["epsilon"].values())
    assert summary["epsilon_max"] <= 4.0 * (1 + 1e-4)
    return z


POISSON = {"noise_correlation": "banded", "client_sampling": "poisson", "fraction_train": 0.1,
           "bands": 4}  # b = 4 groups of 10, each member drawn at p = q·b = 0.4


def test_poisson_banded_sampling_keeps_each_clients_rounds_b_apart(tmp_path):
    """Choquette-Choo et al.'s b-min-separated sampling: the clients dealt to b groups once,
    round t drawing each member of group (t − 1) mod b with probability q·b: a client's rounds
    are all ≡ its group mod b, and a round draws q·n = 4 clients on average."""
    algorithm = build_problem(_config(tmp_path, **POISSON)).algorithm
    assert (algorithm.period, algorithm.sample_rate, algorithm.cohort) == (4, 0.4, 4.0)
    rng, clients = Randomness(3), list(range(40))
    drawn = [algorithm.participants(r, clients, rng) for r in range(1, 401)]
    residues: dict[int, set[int]] = {}
    for t, cohort in enumerate(drawn, start=1):
        for c in cohort:
            residues.setdefault(c, set()).add((t - 1) % 4)
    assert set(residues) == set(clients) and all(len(r) == 1 for r in residues.values())
    assert sorted(sum(1 for r in residues.values() if r == {g}) for g in range(4)) == [10] * 4
    assert np.mean([len(c) for c in drawn]) == pytest.approx(4.0, rel=0.1)
    assert len({len(c) for c in drawn}) > 3  # a random cohort, not a fixed block


@pytest.mark.parametrize("changes,key", [
    ({"client_sampling": "poisson"}, "client-sampling"),  # the tree is not amplified
    ({"client_sampling": "fixed"}, "client-sampling"),
    ({**POISSON, "bands": 11}, "bands"),  # q·b > 1
])
def test_schedules_its_accounting_does_not_cover_are_refused(tmp_path, changes, key):
    with pytest.raises(ConfigError, match=key):
        build_problem(_config(tmp_path, **changes))


def test_epochs_are_dp_ftrls_schedule_alone(tmp_path):
    with pytest.raises(ConfigError, match="client-sampling"):
        _config(tmp_path, algorithm="dp-fedavg-user", client_sampling="epochs")


def test_the_amplified_banded_ledger_equals_dp_accountings_poisson_gaussians(tmp_path):
    """Poisson-banded noise over 12 rounds, b = 4: each client has 3 chances, each a Gaussian
    of multiplier z/‖c‖ Poisson-sampled at p = 0.4 (Choquette-Choo et al. 2023, Theorem 4):
    dp-accounting's RDP of that event (add/remove), composed 3 times."""
    summary = run(_config(tmp_path, **POISSON), echo=False)
    (release,) = summary["releases"]["server"]
    z = release["noise_multiplier"] * release["radius"] / 0.1
    norm = banded.column_norm(banded.square_root_coefficients(4))
    assert release["radius"] == pytest.approx(0.1 * norm) and release["sample_rate"] == 0.4
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        0.4, dp_accounting.GaussianDpEvent(z / norm)), 3)
    expected = accountant.get_epsilon(1e-4)
    assert summary["server_epsilon"] == pytest.approx(expected, rel=0.02)
    # every client is charged its group's 3 chances, drawn or not: one ε for the population
    assert summary["epsilon_population"] == pytest.approx(expected, rel=0.02)
    assert summary["epsilon_max"] == pytest.approx(expected, rel=0.02) and not summary["epsilon"]
    assert summary["epsilon_max"] <= 4.0 * (1 + 1e-4)
    unamplified = run(_config(tmp_path, "cyclic", noise_correlation="banded"), echo=False)
    assert release["noise_multiplier"] < unamplified["releases"]["server"][0]["noise_multiplier"]


@pytest.mark.parametrize("correlation", ["tree", "banded", pytest.param("blt", marks=NEEDS_BLT)])
def test_a_run_resumed_mid_epoch_equals_the_uninterrupted_one(tmp_path, correlation):
    """The live nodes (the last increments, the BLT's buffers) and the momentum are server
    state: a run stopped at round 6 (an epoch and a half) and continued to 12 equals the run
    started with 12 (a BLT optimised for 12 rounds in both: calibration-rounds)."""
    from dpfl.cli import main
    from tests.test_resume import assert_same_run

    values = {**VALUES, "noise-multiplier": 1.0, "checkpoint-every": 1,
              "noise-correlation": correlation, "results-dir": str(tmp_path),
              **({"calibration-rounds": 12} if correlation == "blt" else {})}
    run(RunConfig({**values, "num-server-rounds": 6, "run-name": "short"}), echo=False)
    assert main(["run", "-q", "--resume", str(tmp_path / "short"), "-c",
                 "num-server-rounds=12"]) == 0
    run(RunConfig({**values, "num-server-rounds": 12, "run-name": "long"}), echo=False)
    assert_same_run(tmp_path / "short", tmp_path / "long")


@pytest.mark.parametrize("correlation,sampling", [
    ("tree", "epochs"), ("banded", "epochs"), ("banded", "poisson"),
    pytest.param("blt", "epochs", marks=NEEDS_BLT)])
def test_flower_code_path_equals_engine(tmp_path, correlation, sampling):
    """Two epochs of four rounds (or, Poisson-sampled, two passes over 4 groups): the noise's
    state crosses rounds and an epoch (a BLT optimised for 12 rounds, the other tests')."""
    from tests.inprocess_grid import assert_flower_equals_engine

    assert_flower_equals_engine(tmp_path, {**VALUES, "num-partitions": 8,
                                           "fraction-train": 0.25 if sampling == "epochs"
                                           else 0.125, "num-server-rounds": 8,
                                           "noise-correlation": correlation,
                                           "bands": 4 if correlation == "banded" else 0,
                                           "client-sampling": sampling,
                                           **({"calibration-rounds": 12}
                                              if correlation == "blt" else {})}, 8)


def test_its_noise_cannot_be_split_over_a_secure_sum(tmp_path):
    with pytest.raises(ConfigError, match="secure-aggregation"):
        _config(tmp_path, secure_aggregation=True)


# ---- BLT noise (jax_privacy's strategy, checked here without it) ------------------------------

def _worst_sensitivities(factor: np.ndarray, separation: int, most: int) -> list[float]:
    """Δ_j² for j = 1 … ``most``: the largest ‖Σ of j columns of C‖², over every choice of j
    rounds at least ``separation`` apart, by enumeration."""
    rounds = factor.shape[0]
    return [max(float(np.sum(factor[:, list(taken)].sum(axis=1) ** 2))
                for taken in itertools.combinations(range(rounds), j)
                if all(b - a >= separation for a, b in zip(taken, taken[1:])))
            for j in range(1, most + 1)]


@needs_blt
def test_blt_noise_streams_its_factors_inverse_and_its_sensitivity_is_the_worst_pattern(
        tmp_path):
    """12 rounds, a client every R = 4 (k = 3): the streamed noise is C⁻¹ (numpy's inverse of
    the Toeplitz matrix of the BLT's coefficients), C's coefficients are positive and
    non-increasing (what the min-separation bound needs), and ν² is the largest Δ_j²/j over
    every pattern of rounds 4 apart, enumerated."""
    algorithm = build_problem(_config(tmp_path, noise_correlation="blt")).algorithm
    strategy = algorithm.correlation.strategy
    assert (strategy.horizon, strategy.separation, strategy.participations) == (12, 4, 3)
    coefficients = strategy.coefficients(12)
    assert all(a >= b > 0 for a, b in zip(coefficients, coefficients[1:]))
    factor = _banded_factor(coefficients, 12)
    assert np.allclose(algorithm.noise_matrix(12).numpy(), np.linalg.inv(factor), atol=1e-12)
    worst = _worst_sensitivities(factor, 4, 3)
    assert strategy.norm ** 2 == pytest.approx(max(d / j for j, d in enumerate(worst, 1)),
                                               rel=1e-9)
    assert 3 * strategy.norm ** 2 >= worst[-1] * (1 - 1e-12)
    assert worst[-1] > 3 * float(np.sum(factor[:, 0] ** 2))  # the columns overlap
    assert algorithm.correlation.rows == len(strategy.decay) <= 10  # buffers, not rounds


@needs_blt
def test_the_blt_ledger_equals_dp_accountings_gaussian_at_the_worst_sensitivity(tmp_path):
    """Each of a client's 3 participations is charged a Gaussian of multiplier z/ν: composed,
    a Gaussian of multiplier z/(ν√3), at least the worst pattern's z/Δ_3 (dp-accounting's RDP,
    ν from the enumeration above)."""
    summary = run(_config(tmp_path, noise_correlation="blt"), echo=False)
    factor = _banded_factor(blt.optimised(12, 4).coefficients(12), 12)
    worst = _worst_sensitivities(factor, 4, 3)
    z = _assert_charged_gaussians(summary, math.sqrt(max(d / j for j, d in enumerate(worst, 1))))
    exact = dp_accounting.rdp.RdpAccountant()
    exact.compose(dp_accounting.GaussianDpEvent(z / math.sqrt(worst[-1])))
    assert exact.get_epsilon(1e-4) <= summary["epsilon_max"] * (1 + 1e-9)


@needs_blt
def test_blt_runs_it_cannot_serve_are_refused(tmp_path):
    """Bands (banded noise's) and Poisson sampling (amplification is accounted for banded noise
    only)."""
    for changes, key in (({"bands": 2}, "bands"), ({"client_sampling": "poisson",
                                                    "fraction_train": 0.1}, "client-sampling")):
        with pytest.raises(ConfigError, match=key):
            build_problem(_config(tmp_path, noise_correlation="blt", **changes))


@needs_blt
@pytest.mark.slow
def test_blt_noise_past_its_horizon_is_refused(tmp_path):
    """A round past the horizon, buffers of another horizon's BLT (the server state keeps its
    horizon), and a resume to more rounds than the BLT was optimised for (its releases
    differ)."""
    from dpfl.cli import main

    problem = build_problem(_config(tmp_path, noise_correlation="blt", noise_multiplier=1.0))
    algorithm, (release,) = problem.algorithm, problem.server_releases()
    state = algorithm.init_server_state(problem.x0)

    def step(server_round: int) -> None:
        ctx = ServerContext(server_round, Randomness(0), [], 40, releases={"model": release},
                            charge=lambda _: None)
        algorithm.server_step("train", state, algorithm.zero_sums("train"), ctx)

    step(12)
    with pytest.raises(ConfigError, match="num-server-rounds"):
        step(13)
    state["horizon"] = torch.tensor(6.0, dtype=torch.float64)  # buffers of a 6-round BLT
    with pytest.raises(ConfigError, match="calibration-rounds"):
        step(1)
    run(_config(tmp_path, "short", noise_correlation="blt", noise_multiplier=1.0,
                num_server_rounds=6, checkpoint_every=1), echo=False)
    assert main(["run", "-q", "--resume", str(tmp_path / "short"), "-c",
                 "num-server-rounds=12"]) == 2


@needs_blt
@pytest.mark.slow
def test_the_running_sums_noise_at_equal_epsilon_is_what_docs_privacy_says(tmp_path):
    """docs/privacy.md's "Which noise" rows for T = 60, R = 20: z calibrated for ε = 2 over 3
    participations, and the largest and RMS std of the running sums' noise, z·S·‖(A C⁻¹)_t‖."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "privacy.md").read_text()
    rows = re.findall(r"^  \| 60, 20 \| (.+?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", page,
                      re.M)
    assert len(rows) == 4
    keys = {"independent (`banded`, `bands=1`)": {"noise_correlation": "banded", "bands": 1},
            "`tree`": {}, "`banded` (b = 20)": {"noise_correlation": "banded"},
            "`blt`": {"noise_correlation": "blt"}}
    for name, *numbers in rows:
        problem = build_problem(_config(tmp_path, num_partitions=60, fraction_train=0.05,
                                        num_server_rounds=60, epsilon=2.0, delta=1e-5,
                                        clip=1.0, batch_size=4, **keys[name]))
        (release,) = problem.server_releases()
        z = release.noise_multiplier * release.radius
        error = torch.cumsum(problem.algorithm.noise_matrix(60), 0).pow(2).sum(1).sqrt() * z
        measured = (z, error.max().item(), error.pow(2).mean().sqrt().item())
        assert [f"{v:.2f}" for v in measured] == numbers, name


@needs_blt
def test_an_optimised_blt_is_kept_in_the_user_cache_and_read_back_exactly(tmp_path,
                                                                          monkeypatch):
    """The optimisation runs once per (horizon, separation): a second process reads the same
    floats from the cache file; a damaged file, or one whose coefficients are not positive and
    non-increasing, is optimised again and rewritten. (The optimiser is counted, and stood in
    for by the strategy it gave once, so the test pays for one optimisation at most.)"""
    from dpfl.privacy import blt as module
    from dpfl.privacy.blt import _kept, cache_file

    first = blt.optimised(12, 4)  # the other tests' strategy: optimised once in this process
    calls = []
    monkeypatch.setattr(module, "_optimised", lambda *key: calls.append(key) or first)
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path))
    _kept.cache_clear()
    assert blt.optimised(12, 4) == first and calls == [(12, 4)]
    assert cache_file(12, 4).parent == tmp_path / "blt" and cache_file(12, 4).is_file()
    _kept.cache_clear()
    assert blt.optimised(12, 4) == first and len(calls) == 1  # read back: the same floats
    cache_file(12, 4).write_text("{not json")
    _kept.cache_clear()
    assert blt.optimised(12, 4) == first and len(calls) == 2
    kept = json.loads(cache_file(12, 4).read_text())
    assert "norm" not in kept  # ν is dpfl's own, from θ and ω: a file cannot bring its own
    cache_file(12, 4).write_text(json.dumps({**kept, "scale": [-s for s in kept["scale"]]}))
    _kept.cache_clear()
    assert blt.optimised(12, 4) == first and len(calls) == 3  # coefficients the bound does
    _kept.cache_clear()  # not cover: optimised again