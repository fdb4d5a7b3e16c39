"""PriSMA's family (Huang, Zhang, Ling, AISTATS 2025): its baseline DPSGD-GC — clip bound,
noise scale, update rule, batching, a preset of per-sample Clip-SGD — and the calibration of
Theorem 3 with Corollary 1 against the paper-derived test vectors."""

from __future__ import annotations

import pytest
import torch

from dpfl.algorithms import ServerContext
from dpfl.algorithms.clip21 import ClipSGD
from dpfl.algorithms.prisma import prisma_paper_calibration
from dpfl.privacy import PrivacyLedger, Randomness, Release, clip_by_norm
from dpfl.problem import build_problem
from dpfl.rounds import ClientRuntime


def _step(problem, ids, round=1, seed=0):
    """One exchange of ``ids`` through the client runtime: the noised uploads."""
    cohort = problem.full_cohort().select(ids)
    runtime = ClientRuntime(problem.algorithm, problem.releases, Randomness(seed))
    return runtime.step("train", round, {"x": problem.x0}, {}, cohort)


def test_dpsgd_gc_is_a_preset_of_per_sample_clip_sgd(small_config):
    problem = build_problem(small_config())
    assert type(problem.algorithm).__mro__[1] is ClipSGD
    assert problem.algorithm.per_sample() and problem.algorithm.hp.gradient_noise == 0.0


def test_noise_free_upload_is_the_mean_of_clipped_per_sample_gradients(small_config):
    problem = build_problem(small_config(noise_multiplier=0.0, clip=0.05))
    uploads, _, _ = _step(problem, [0, 1])
    # recompute by hand from the same batch
    cohort = problem.full_cohort().select([0, 1])
    x, y = cohort.sample(Randomness(0), 1, "batch", 16)
    g = problem.model.per_sample_gradients(problem.x0, x, y)
    expected = clip_by_norm(g, 0.05).mean(dim=1)
    assert torch.allclose(uploads["c"], expected, atol=1e-7)
    assert (torch.linalg.vector_norm(uploads["c"], dim=1) <= 0.05 * (1 + 1e-6)).all()


def test_noise_std_is_noise_multiplier_times_clip_over_batch(small_config):
    """Opacus convention: std = noise-multiplier · C / b on the averaged query."""
    clean = build_problem(small_config(noise_multiplier=0.0, clip=0.5))
    noisy = build_problem(small_config(noise_multiplier=3.0, clip=0.5))
    diff = _step(noisy, [0, 1, 2])[0]["c"] - _step(clean, [0, 1, 2])[0]["c"]
    assert diff.shape[1] > 10_000
    assert torch.allclose(diff.std(dim=1), torch.full((3,), 3.0 * 0.5 / 16), rtol=0.03)


def test_ledger_accounts_half_the_opacus_multiplier_for_replace_one(small_config):
    problem = build_problem(small_config(noise_multiplier=3.0))
    (release,) = problem.releases(0)
    assert release.noise_multiplier == 1.5
    assert release.sample_rate == pytest.approx(16 / len(problem.partitions[0]))


def test_accountant_calibration_reaches_the_target_epsilon(small_config):
    problem = build_problem(small_config(epsilon=2.0, delta=1e-5, num_server_rounds=50))
    (release,) = problem.releases(0)
    ledger = PrivacyLedger(accountant="rdp", relation=problem.algorithm.relation)
    for _ in range(50):
        ledger.record(release)
    assert 1.989 <= ledger.epsilon(1e-5) <= 2.0


def test_server_step_is_sgd_on_the_mean_upload(small_config):
    problem = build_problem(small_config(learning_rate=0.3))
    v = torch.randn(4, problem.model.d)
    ctx = ServerContext(1, Randomness(0), [0, 1, 2, 3], 4)
    state = problem.algorithm.server_step("train", {"x": problem.x0}, {"c": v.sum(dim=0)}, ctx)
    assert torch.allclose(state["x"], problem.x0 - 0.3 * v.mean(dim=0))


def test_a_client_computes_the_same_alone_or_batched(small_config):
    problem = build_problem(small_config(noise_multiplier=1.0))
    together = _step(problem, [0, 1, 2, 3])[0]["c"]
    for i in range(4):
        assert torch.equal(_step(problem, [i])[0]["c"][0], together[i])


def test_paper_calibration_uses_theorem_3_with_the_clients_data_size(small_config):
    problem = build_problem(small_config(calibration="paper", epsilon=4.0, delta=1e-5,
                                         num_server_rounds=100))
    n = len(problem.partitions[0])
    expected = prisma_paper_calibration(epsilon=4.0, delta=1e-5, batch_size=16, num_samples=n,
                                        rounds=100)
    assert problem.releases(0)[0].noise_multiplier == expected.noise_multiplier


@pytest.mark.parametrize("eps,z,sigma0_over_c", [(4, 11.1347, 0.043495), (8, 5.9651, 0.023301),
                                                 (16, 3.3451, 0.013067), (32, 1.9860, 0.007758)])
def test_prisma_paper_calibration_matches_the_spec_cifar_vectors(eps, z, sigma0_over_c):
    cal = prisma_paper_calibration(epsilon=eps, delta=1e-5, batch_size=512, num_samples=5000,
                                   rounds=1000)
    assert cal.noise_multiplier == pytest.approx(z, rel=1e-4)
    assert cal.noise_multiplier * 2 / 512 == pytest.approx(sigma0_over_c, rel=1e-4)
    assert not cal.valid  # condition (18) fails in every experiment of the paper


@pytest.mark.parametrize("rounds,z", [(2000, 52.143), (4000, 73.741), (32000, 208.572)])
def test_prisma_paper_calibration_matches_the_least_squares_vectors(rounds, z):
    cal = prisma_paper_calibration(epsilon=1.0, delta=1e-4, batch_size=200, num_samples=2000,
                                   rounds=rounds)
    assert cal.noise_multiplier == pytest.approx(z, rel=1e-4)


def test_paper_noise_is_far_more_private_than_its_target_per_opacus():
    """§4 of the paper against an accountant: its CIFAR noise at target ε=4 gives ε≈1.203
    (Opacus RDP with z = σ̂, the replace-one proxy)."""
    cal = prisma_paper_calibration(epsilon=4, delta=1e-5, batch_size=512, num_samples=5000,
                                   rounds=1000)
    ledger = PrivacyLedger(accountant="rdp", relation="replace-one")
    release = Release(name="gradient", exchange="train", radius=1.0, relation="replace-one",
                      sample_rate=512 / 5000, steps=1000, noise_multiplier=cal.noise_multiplier)
    ledger.record(release)
    assert ledger.epsilon(1e-5) == pytest.approx(1.203, rel=0.05)
