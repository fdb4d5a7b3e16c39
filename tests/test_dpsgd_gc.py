"""DPSGD-GC (specs/prisma.md §3.1): clip bound, noise scale, update rule, batching."""

from __future__ import annotations

import pytest
import torch

from dpfl.algorithms import StepContext
from dpfl.privacy import Randomness, clip_by_norm
from dpfl.problem import build_problem


def _step(problem, ids, round=1, seed=0):
    cohort = problem.full_cohort().select(ids)
    ctx = StepContext(round=round, rng=Randomness(seed),
                      releases=[problem.releases(c) for c in ids], device=torch.device("cpu"))
    return problem.algorithm.client_step("train", {}, {"x": problem.x0}, cohort, ctx)


def test_noise_free_upload_is_the_mean_of_clipped_per_sample_gradients(small_config):
    problem = build_problem(small_config(noise_multiplier=0.0, clip=0.05))
    uploads, _, _ = _step(problem, [0, 1])
    # recompute by hand from the same batch
    cohort = problem.full_cohort().select([0, 1])
    x, y = cohort.sample(Randomness(0), 1, "batch", 16)
    g = problem.model.per_sample_gradients(problem.x0, x, y)
    expected = clip_by_norm(g, 0.05).mean(dim=1)
    assert torch.allclose(uploads["v"], expected, atol=1e-7)
    assert (torch.linalg.vector_norm(uploads["v"], dim=1) <= 0.05 * (1 + 1e-6)).all()


def test_noise_std_is_noise_multiplier_times_clip_over_batch(small_config):
    """Opacus convention: std = noise-multiplier · C / b on the averaged query."""
    clean = build_problem(small_config(noise_multiplier=0.0, clip=0.5))
    noisy = build_problem(small_config(noise_multiplier=3.0, clip=0.5))
    diff = _step(noisy, [0, 1, 2])[0]["v"] - _step(clean, [0, 1, 2])[0]["v"]
    assert diff.shape[1] > 10_000
    assert torch.allclose(diff.std(dim=1), torch.full((3,), 3.0 * 0.5 / 16), rtol=0.03)


def test_ledger_accounts_half_the_opacus_multiplier_for_replace_one(small_config):
    problem = build_problem(small_config(noise_multiplier=3.0))
    (release,) = problem.releases(0)
    assert release.noise_multiplier == 1.5
    assert release.sample_rate == pytest.approx(16 / len(problem.partitions[0]))


def test_accountant_calibration_reaches_the_target_epsilon(small_config):
    from dpfl.client.runtime import new_ledger

    problem = build_problem(small_config(epsilon=2.0, delta=1e-5, num_server_rounds=50))
    (release,) = problem.releases(0)
    ledger = new_ledger(problem)
    ledger.record(noise_multiplier=release.noise_multiplier, sample_rate=release.sample_rate,
                  steps=50)
    assert 1.989 <= ledger.epsilon(1e-5) <= 2.0


def test_server_step_is_sgd_on_the_mean_upload(small_config):
    problem = build_problem(small_config(learning_rate=0.3))
    v = torch.randn(4, problem.model.d)
    state = problem.algorithm.server_step("train", {"x": problem.x0}, {"v": v}, [0, 1, 2, 3], 1)
    assert torch.allclose(state["x"], problem.x0 - 0.3 * v.mean(dim=0))


def test_a_client_computes_the_same_alone_or_batched(small_config):
    problem = build_problem(small_config(noise_multiplier=1.0))
    together = _step(problem, [0, 1, 2, 3])[0]["v"]
    for i in range(4):
        assert torch.equal(_step(problem, [i])[0]["v"][0], together[i])


def test_paper_calibration_uses_theorem_3_with_the_clients_data_size(small_config):
    from dpfl.privacy import prisma_paper_calibration

    problem = build_problem(small_config(calibration="paper", epsilon=4.0, delta=1e-5,
                                         num_server_rounds=100))
    n = len(problem.partitions[0])
    expected = prisma_paper_calibration(epsilon=4.0, delta=1e-5, batch_size=16, num_samples=n,
                                        rounds=100)
    assert problem.releases(0)[0].noise_multiplier == expected.noise_multiplier
