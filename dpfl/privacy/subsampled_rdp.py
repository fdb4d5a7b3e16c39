"""The RDP accountant of the adaptive-clipping paper: the Gaussian mechanism under fixed-size
sampling without replacement, composed at one order and converted with Mironov's bound.

Fukami, Murata, Yamamoto, Suzuki, "Differentially private federated learning with adaptive
clipping" (AdaptDP-FedAvg), §4 and App. A–D; its subsampling operator is Wang, Balle,
Kasiviswanathan, "Subsampled Rényi differential privacy and analytical moments accountant"
(AISTATS 2019), Theorem 9. No library implements that general bound (Opacus accounts Poisson
sampling under add/remove; Google's ``dp_accounting`` the tighter Gaussian-specific Theorem 27),
so the paper's calibration is written here, in log space.

Conventions (the paper's). A mean of b per-sample terms clipped at C carries noise of std σ·C:
σ is a *relative noise size on the mean*, not a noise multiplier. Replace-one neighbours change
the mean by at most 2C/b, so one step is (α, κα)-RDP with κ = (2/b)²/(2σ²) = 2/(b²σ²)
(Lemma 4); in Opacus' terms the replace-one multiplier is z = σb/2 and κ = 1/(2z²).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from dpfl.privacy.accountants import ACCOUNTANTS, Accountant

#: bisection range of the noise size (log space)
SIGMA_RANGE = (1e-8, 1e8)
#: the largest order evaluated (a sum of α terms): an ε whose α* exceeds it (ε below
#: 2 log(1/δ)/10⁵, e.g. 1.8e-4 at δ = 1e-4) is not certified
MAX_ORDER = 100_000
#: the integer orders the ledger's accountant minimises over (every order from 2 to 64, then
#: a geometric grid to 4096)
LEDGER_ORDERS = tuple(range(2, 65)) + (80, 96, 128, 160, 192, 256, 384, 512, 768, 1024, 1536,
                                       2048, 3072, 4096)


def gaussian_kappa(sigma: float, batch_size: int) -> float:
    """κ of one step whose mean of ``batch_size`` clipped terms carries noise of relative size
    ``sigma``: ε(α) = κ·α with κ = 2/(b²σ²) (Lemma 4, replace-one)."""
    return 2.0 / (batch_size * batch_size * sigma * sigma)


def subsampled_rdp(kappa: float, sample_rate: float, alpha: int) -> float:
    """𝒮(ε(·), γ)(α) of Wang et al.'s Theorem 9 (the paper's Lemma 5) for a Gaussian mechanism
    with ε(α) = κα (so ε(∞) = ∞ and every min{2, ·} is 2), sampling b of n without
    replacement at γ = b/n, integer α ≥ 2::

        (1/(α−1)) log(1 + γ²C(α,2)·min{4(e^{2κ} − 1), 2e^{2κ}}
                      + 2 Σ_{j=3..α} γ^j C(α,j) e^{(j−1)jκ})
    """
    from scipy.special import gammaln, logsumexp  # imported on use, as Opacus is

    if alpha < 2 or int(alpha) != alpha:
        raise ValueError(f"the order must be an integer >= 2, got {alpha}")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"the sample rate must be in (0, 1], got {sample_rate}")
    alpha = int(alpha)
    log_gamma = math.log(sample_rate)
    # log min{4(e^{2κ} − 1), 2e^{2κ}}: the first is the smaller while e^{2κ} < 2
    second = (math.log(4.0) + 2 * kappa + math.log(-math.expm1(-2 * kappa))
              if 2 * kappa < math.log(2.0) else math.log(2.0) + 2 * kappa)
    j = np.arange(3, alpha + 1, dtype=np.float64)
    log_binom = gammaln(alpha + 1) - gammaln(j + 1) - gammaln(alpha - j + 1)
    terms = np.concatenate([
        [0.0, 2 * log_gamma + math.log(alpha * (alpha - 1) / 2) + second],
        math.log(2.0) + j * log_gamma + log_binom + (j - 1) * j * kappa,
    ])
    return float(logsumexp(terms)) / (alpha - 1)


def order(epsilon: float, delta: float) -> int:
    """α* = 1 + ⌈2 log(1/δ)/ε⌉ (Theorem 1): Lemma 3's log(1/δ)/(α* − 1) is then at most ε/2."""
    return 1 + math.ceil(2 * math.log(1 / delta) / epsilon)


def epsilon_from_rdp(rdp: Any, alpha: Any, delta: float) -> Any:
    """Lemma 3 (Mironov, Prop. 3): (α, ρ)-RDP is (ρ + log(1/δ)/(α − 1), δ)-DP (numbers, or
    arrays of orders and their RDP)."""
    return rdp + math.log(1 / delta) / (alpha - 1)


def _bisect(ok, low: float, high: float) -> float:
    """The smallest value of [low, high] where the predicate ``ok``, false below a boundary and
    true above it, holds: bisection in log space, to a relative 1e-12."""
    lo, hi = math.log(low), math.log(high)
    if ok(math.exp(lo)):
        return math.exp(lo)
    if not ok(math.exp(hi)):
        raise ValueError("no value in range satisfies the privacy condition")
    while hi - lo > 1e-12:
        mid = (lo + hi) / 2
        if ok(math.exp(mid)):
            hi = mid
        else:
            lo = mid
    return math.exp(hi)


def noise_size(*, epsilon: float, delta: float, batch_size: int, num_samples: int, steps: int,
               share: float) -> float:
    """The smallest relative noise size σ with steps·𝒮(κ(σ), b/n)(α*) ≤ share·ε: eq. (1)
    (share 1/4 for each of AdaptDP-FedAvg's two releases: steps R for the statistic, R·K for
    training) and eq. (3) (DP-FedAvg: share 1/2, steps R·K)."""
    alpha = order(epsilon, delta)
    if alpha > MAX_ORDER:
        raise ValueError(f"ε = {epsilon:g} needs the order {alpha} > {MAX_ORDER}")
    rate = batch_size / num_samples

    def ok(sigma: float) -> bool:
        return steps * subsampled_rdp(gaussian_kappa(sigma, batch_size), rate, alpha) \
            <= share * epsilon

    return _bisect(ok, *SIGMA_RANGE)


def rdp_of_event(noise_multiplier: float, sample_rate: float, alpha: int) -> float:
    """RDP at order ``alpha`` of one step of a Gaussian mechanism whose noise std is
    ``noise_multiplier`` times its replace-one sensitivity, on a fixed-size batch at
    ``sample_rate``: 𝒮 with κ = 1/(2z²); at rate 1 (no sampling) the Gaussian's own κα
    (Lemma 4; Remark 3's full-batch statistic), which Wang et al.'s bound only approaches."""
    kappa = 1.0 / (2.0 * noise_multiplier * noise_multiplier)
    if sample_rate >= 1:
        return kappa * alpha
    return subsampled_rdp(kappa, sample_rate, alpha)


@functools.lru_cache(maxsize=4096)
def _rdp_curve(noise_multiplier: float, sample_rate: float,
               orders: tuple[int, ...]) -> np.ndarray:
    """One step's RDP at each of ``orders`` (computed once per (z, q))."""
    return np.array([rdp_of_event(noise_multiplier, sample_rate, a) for a in orders])


def epsilon_of_history(history: tuple[tuple[float, float, int], ...], delta: float,
                       orders: tuple[int, ...] = LEDGER_ORDERS) -> float:
    """ε of a composition of ``(noise multiplier, sample rate, steps)`` events (replace-one
    multipliers, fixed-size sampling without replacement): the RDP of every event summed at
    each order, converted with Lemma 3 and minimised over ``orders`` (the paper fixes one order
    α* for calibration; any order is a valid certificate for the same composition)."""
    if not history:
        return 0.0
    if any(z <= 0 for z, _, _ in history):
        return math.inf
    rdp = sum(steps * _rdp_curve(z, q, orders) for z, q, steps in history)
    return float(np.min(epsilon_from_rdp(rdp, np.asarray(orders, dtype=np.float64), delta)))


ACCOUNTANTS.add("rdp-wor", Accountant(
    epsilon_of_history, "Wang et al.'s bound for fixed-size sampling without replacement, the "
    "adaptive-clipping paper's: looser than the Poisson analysis"))
