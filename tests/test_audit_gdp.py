"""The audit's Gaussian-DP fit (dpfl/audit/gdp.py): ε of μ-GDP against Google's
``dp-accounting`` PLD of the Gaussian mechanism, and μ recovered from Gaussian scores with a
lower confidence bound that covers it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution

from dpfl.audit.gdp import delta_of_mu, epsilon_of_mu, fit


def pld_epsilon(mu: float, delta: float) -> float:
    """ε at δ of the Gaussian mechanism of sensitivity 1 and std 1/μ (which is μ-GDP), by
    dp-accounting's privacy loss distribution (pessimistic, fine discretisation)."""
    pld = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=1 / mu, sensitivity=1.0, value_discretization_interval=1e-4)
    return pld.get_epsilon_for_delta(delta)


@pytest.mark.parametrize("mu", [0.2, 0.5, 1.0, 2.0, 5.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-3])
def test_epsilon_of_mu_is_the_gaussian_mechanisms_epsilon(mu, delta):
    eps = epsilon_of_mu(mu, delta)
    assert math.isclose(eps, pld_epsilon(mu, delta), rel_tol=2e-3, abs_tol=3e-4)
    assert math.isclose(delta_of_mu(mu, eps), delta, rel_tol=1e-6)


def test_epsilon_of_mu_at_its_ends():
    assert epsilon_of_mu(0.0, 1e-5) == 0.0
    assert epsilon_of_mu(1e-5, 1e-5) == 0.0  # δ(0) = 2Φ(μ/2) − 1 is below δ already
    assert epsilon_of_mu(math.inf, 1e-5) == math.inf
    assert epsilon_of_mu(50.0, 1e-5) > 1000  # e^ε·Φ(·) in log space: no overflow
    with pytest.raises(ValueError, match="delta"):
        epsilon_of_mu(1.0, 0.0)


@pytest.mark.parametrize("mu", [0.5, 1.0, 3.0])
def test_fit_recovers_mu_and_its_lower_bound_covers_it(mu):
    """Scores N(0, s²) and N(μs, s²): μ̂ within 0.1 of μ at 2,000 runs a side; over 300
    repetitions of 500 runs a side the 95% lower bound lies below μ in 95 ± 3% of them."""
    rng = np.random.default_rng(0)
    big = fit(rng.normal(3.0, 2.0, 2000), rng.normal(3.0 + 2.0 * mu, 2.0, 2000), delta=1e-5)
    assert abs(big.mu - mu) < 0.1 and 0.9 < big.std_ratio < 1.1
    assert big.epsilon_lower <= big.epsilon
    assert math.isclose(big.epsilon, epsilon_of_mu(big.mu, 1e-5))
    covered = [fit(rng.normal(0, 1, 500), rng.normal(mu, 1, 500), delta=1e-5).mu_lower < mu
               for _ in range(300)]
    assert 0.92 <= np.mean(covered) <= 0.98


def test_fit_is_symmetric_and_zero_without_a_canary():
    rng = np.random.default_rng(1)
    a, b = rng.normal(0, 1, 1000), rng.normal(1, 1, 1000)
    assert fit(a, b, delta=1e-5).mu == fit(b, a, delta=1e-5).mu
    same = fit(rng.normal(0, 1, 1000), rng.normal(0, 1, 1000), delta=1e-5)
    assert same.mu < 0.15 and same.epsilon_lower == 0.0


def test_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="not all finite"):
        fit(np.array([0.0, np.nan]), np.array([1.0, 2.0]), delta=1e-5)
    with pytest.raises(ValueError, match="two runs"):
        fit(np.array([0.0]), np.array([1.0, 2.0]), delta=1e-5)
    exact = fit(np.zeros(5), np.ones(5), delta=1e-5)  # no noise at all: μ = ∞
    assert exact.mu == math.inf and exact.epsilon == math.inf
