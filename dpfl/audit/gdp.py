"""An ε estimate from a Gaussian-DP fit of the audit's two score distributions.

Dong, Roth & Su, "Gaussian Differential Privacy" (arXiv:1905.02383): a mechanism is μ-GDP when
telling its output on D from its output on D' is no easier than telling N(0, 1) from N(μ, 1).
A Gaussian mechanism of sensitivity Δ and std σ is exactly (Δ/σ)-GDP, T of them composed are
(√T·Δ/σ)-GDP (their Corollary 3.3), and μ-GDP is (ε, δ(ε))-DP for every ε ≥ 0 with

    δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2)                      (their Corollary 2.13),

the whole privacy profile, no slack: :func:`epsilon_of_mu` inverts it at the run's δ.

Where the adversary's score is a sum of Gaussian noise and, with the canary, a fixed shift (a
canary whose clipped gradient is the same in every step, in a coordinate nothing else moves),
the scores are N(m_out, s²) and N(m_in, s²) and the run is exactly μ-GDP in what the score
sees with μ = |m_in − m_out|/s: Nasr et al., "Tight Auditing of Differentially Private Machine
Learning" (arXiv:2302.07956, §5) fit μ so and audit DP-SGD within a few percent of its ε from
far fewer runs than a threshold test needs. :func:`fit` estimates μ by the standardised mean
difference of the two samples (pooled std) with a one-sided lower confidence bound from its
normal approximation, standard error √(1/n_out + 1/n_in + μ̂²/(2(n_out + n_in)))
(Hedges & Olkin, "Statistical Methods for Meta-Analysis", 1985, eq. 5.15), and converts both.

This is an estimate, not a bound: it assumes the scores are Gaussian with one variance. It is
exact in law for the Gaussian mechanisms with a Dirac canary, an approximation elsewhere
(clipping that bites differently with and without the canary, state carried across rounds, a
canary that is not clipped the same in every step); ``std_ratio`` (s_in/s_out) says how far
the two spreads are from one. The Clopper-Pearson bound (:mod:`dpfl.audit.bounds`) makes no
such assumption and stays the audit's guarantee.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import log_ndtr, ndtr
from scipy.stats import norm

#: the μ above which ε(μ, δ) is not searched for (it is beyond any DP worth the name)
MU_MAX = 1e3


def delta_of_mu(mu: float, epsilon: float) -> float:
    """δ(ε) of μ-GDP (module docstring), the second term in log space (e^ε·Φ(·) overflows
    for large ε while the product stays small)."""
    if mu <= 0:
        return 0.0
    first = float(ndtr(-epsilon / mu + mu / 2))
    second = math.exp(epsilon + float(log_ndtr(-epsilon / mu - mu / 2)))
    return max(first - second, 0.0)


def epsilon_of_mu(mu: float, delta: float) -> float:
    """The smallest ε with δ(ε) ≤ ``delta`` for μ-GDP (0 where δ(0) ≤ δ already): δ(ε) is
    decreasing in ε, so bisection (to 1e-12 relative)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if not math.isfinite(mu):
        return math.inf
    mu = min(abs(mu), MU_MAX)
    if delta_of_mu(mu, 0.0) <= delta:
        return 0.0
    low, high = 0.0, 1.0
    while delta_of_mu(mu, high) > delta:
        low, high = high, 2 * high
    while high - low > 1e-12 * high:
        mid = (low + high) / 2
        low, high = (mid, high) if delta_of_mu(mu, mid) > delta else (low, mid)
    return high


@dataclass(frozen=True)
class GaussianFit:
    """μ fitted to the scores and the ε it gives at ``delta``: ``epsilon`` from the point
    estimate ``mu``, ``epsilon_lower`` from ``mu_lower``, μ's lower bound at ``confidence``
    (under the Gaussian model)."""

    mu: float
    mu_lower: float
    epsilon: float
    epsilon_lower: float
    confidence: float
    std_ratio: float  # s_in / s_out: 1 where the model's one variance holds

    def summary(self) -> dict[str, float]:
        return {"gdp_mu": self.mu, "gdp_mu_lower": self.mu_lower,
                "gdp_epsilon": self.epsilon, "gdp_epsilon_lower": self.epsilon_lower,
                "gdp_confidence": self.confidence, "gdp_std_ratio": self.std_ratio}


def fit(out: np.ndarray, inn: np.ndarray, *, delta: float,
        confidence: float = 0.95) -> GaussianFit:
    """μ of the runs without (``out``) and with (``inn``) the canary, and its ε (module
    docstring). The direction does not matter: μ is the absolute standardised difference."""
    out, inn = np.asarray(out, dtype=np.float64), np.asarray(inn, dtype=np.float64)
    n_out, n_in = len(out), len(inn)
    if n_out < 2 or n_in < 2:
        raise ValueError("a Gaussian fit needs at least two runs a side")
    if not (np.isfinite(out).all() and np.isfinite(inn).all()):
        raise ValueError("the audit's scores are not all finite: the runs diverged")
    var_out, var_in = out.var(ddof=1), inn.var(ddof=1)
    pooled = math.sqrt(((n_out - 1) * var_out + (n_in - 1) * var_in) / (n_out + n_in - 2))
    gap = abs(float(inn.mean() - out.mean()))
    if pooled == 0:
        mu = math.inf if gap > 0 else 0.0
        ratio = math.nan
    else:
        mu = gap / pooled
        ratio = math.sqrt(var_in / var_out) if var_out > 0 else math.inf
    stderr = math.sqrt(1 / n_out + 1 / n_in + mu ** 2 / (2 * (n_out + n_in)))
    mu_lower = max(0.0, mu - float(norm.ppf(confidence)) * stderr) if math.isfinite(mu) \
        else math.inf
    return GaussianFit(mu=mu, mu_lower=mu_lower, epsilon=epsilon_of_mu(mu, delta),
                       epsilon_lower=epsilon_of_mu(mu_lower, delta), confidence=confidence,
                       std_ratio=ratio)
