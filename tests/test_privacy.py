"""Privacy core: clip bounds, noise scale, keyed streams, calibration, ledger."""

from __future__ import annotations

import math

import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant

from dpfl.privacy import (
    PrivacyLedger,
    Randomness,
    accountant_noise_multiplier,
    clip_by_norm,
    prisma_paper_calibration,
)


def test_clipped_norms_never_exceed_the_threshold():
    g = torch.randn(500, 300) * torch.logspace(-3, 3, 500).unsqueeze(1)
    for clip in (1e-3, 0.5, 10.0):
        norms = torch.linalg.vector_norm(clip_by_norm(g, clip), dim=1)
        assert (norms <= clip * (1 + 1e-6)).all()


def test_vectors_inside_the_ball_are_unchanged_and_outside_are_rescaled():
    g = torch.tensor([[0.3, 0.4], [3.0, 4.0], [0.0, 0.0]])
    out = clip_by_norm(g, 1.0)
    assert torch.equal(out[0], g[0]) and torch.equal(out[2], g[2])
    assert torch.allclose(out[1], torch.tensor([0.6, 0.8]))


def test_per_client_clip_thresholds_broadcast():
    g = torch.full((2, 4), 10.0)
    norms = torch.linalg.vector_norm(clip_by_norm(g, torch.tensor([1.0, 2.0])), dim=1)
    assert torch.allclose(norms, torch.tensor([1.0, 2.0]))


def test_noise_has_the_requested_standard_deviation_per_client():
    rng = Randomness(7)
    noise = rng.normal([0, 1, 2], 5, "noise", (200_000,), torch.tensor([0.1, 1.0, 3.0]))
    assert noise.shape == (3, 200_000)
    assert torch.allclose(noise.std(dim=1), torch.tensor([0.1, 1.0, 3.0]), rtol=0.01)
    assert noise.mean(dim=1).abs().max() < 0.02


def test_streams_are_keyed_by_seed_client_round_and_purpose():
    a = Randomness(1)
    draw = lambda r, c=0, t=1, p="noise": r.normal([c], t, p, (64,), torch.ones(1))  # noqa: E731
    assert torch.equal(draw(a), draw(Randomness(1)))
    for other in (draw(Randomness(2)), draw(a, c=1), draw(a, t=2), draw(a, p="batch")):
        assert not torch.equal(draw(a), other)


def test_a_client_draws_the_same_noise_alone_or_in_a_cohort():
    rng = Randomness(3)
    cohort = rng.normal([4, 9, 2], 1, "noise", (100,), torch.ones(3))
    alone = rng.normal([9], 1, "noise", (100,), torch.ones(1))
    assert torch.equal(cohort[1], alone[0])


def test_secure_noise_is_not_determined_by_the_seed():
    rng = Randomness(0, secure=True)
    a = rng.normal([0], 1, "noise", (32,), torch.ones(1))
    b = rng.normal([0], 1, "noise", (32,), torch.ones(1))
    assert not torch.equal(a, b)


def test_batches_are_sampled_without_replacement():
    picks = Randomness(0).sample_without_replacement([0, 1], [50, 10], 1, "batch", 10)
    assert len(set(picks[0].tolist())) == 10 and max(picks[0]) < 50
    assert sorted(picks[1].tolist()) == list(range(10))


@pytest.mark.parametrize("accountant,cls", [("rdp", RDPAccountant), ("prv", PRVAccountant)])
def test_accountant_calibration_meets_the_target_epsilon(accountant, cls):
    z = accountant_noise_multiplier(epsilon=2.0, delta=1e-5, sample_rate=0.02, steps=500,
                                    accountant=accountant)
    acc = cls()
    acc.history = [(z, 0.02, 500)]
    assert 2.0 - 0.011 <= acc.get_epsilon(delta=1e-5) <= 2.0
    acc.history = [(0.97 * z, 0.02, 500)]
    assert acc.get_epsilon(delta=1e-5) > 2.0  # smallest such multiplier, not any


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
    """specs/prisma.md §4.5: the paper's CIFAR noise at target ε=4 gives ε≈1.203 (z=σ̂)."""
    cal = prisma_paper_calibration(epsilon=4, delta=1e-5, batch_size=512, num_samples=5000,
                                   rounds=1000)
    ledger = PrivacyLedger(accountant="rdp", relation="replace-one")
    ledger.record(noise_multiplier=cal.noise_multiplier, sample_rate=512 / 5000, steps=1000)
    assert ledger.epsilon(1e-5) == pytest.approx(1.203, rel=0.05)


def test_ledger_epsilon_is_opacus_epsilon_of_the_recorded_history():
    ledger = PrivacyLedger(accountant="rdp", relation="replace-one")
    for _ in range(40):
        ledger.record(noise_multiplier=1.3, sample_rate=0.05)
    ledger.record(noise_multiplier=2.0, sample_rate=0.1, steps=5)
    assert ledger.history == [(1.3, 0.05, 40), (2.0, 0.1, 5)]
    acc = RDPAccountant()
    for _ in range(40):
        acc.step(noise_multiplier=1.3, sample_rate=0.05)
    for _ in range(5):
        acc.step(noise_multiplier=2.0, sample_rate=0.1)
    assert ledger.epsilon(1e-5) == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-12)
    assert ledger.steps == 45


def test_ledger_projection_records_nothing():
    ledger = PrivacyLedger(accountant="rdp", relation="replace-one")
    ledger.record(noise_multiplier=1.0, sample_rate=0.1, steps=10)
    after = ledger.epsilon_after([(1.0, 0.1, 1)], 1e-5)
    assert after > ledger.epsilon(1e-5) and ledger.steps == 10


def test_no_noise_means_infinite_epsilon():
    ledger = PrivacyLedger(accountant="rdp", relation="replace-one")
    ledger.record(noise_multiplier=0.0, sample_rate=0.1)
    assert math.isinf(ledger.epsilon(1e-5))


def test_ledger_survives_json():
    ledger = PrivacyLedger(accountant="prv", relation="replace-one")
    ledger.record(noise_multiplier=1.1, sample_rate=0.2, steps=3)
    back = PrivacyLedger.from_json(ledger.to_json())
    assert back == ledger


def test_prv_ledger_matches_opacus_prv_accountant():
    ledger = PrivacyLedger(accountant="prv", relation="replace-one")
    ledger.record(noise_multiplier=1.2, sample_rate=0.05, steps=200)
    acc = PRVAccountant()
    acc.history = [(1.2, 0.05, 200)]
    assert ledger.epsilon(1e-5) == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-9)
