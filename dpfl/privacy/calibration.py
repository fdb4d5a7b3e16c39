"""Noise calibration: from a target (ε, δ) to a noise multiplier.

Three ways, chosen by the run-config key ``calibration`` (each algorithm offers a subset):

* ``accountant`` — Opacus' RDP or PRV accountant (``get_noise_multiplier``): the
  smallest multiplier whose composed ε over the run is at most the target.
* ``paper`` — the paper's own proven closed form, where the paper gives one
  (DPSGD-GC / PriSMA: Theorem 3 with Corollary 1, specs/prisma.md §4.4; Clip21: App. G).
* ``practice`` — the mapping the paper's experiments used when it differs from the
  proof (Clip21: σ_ω = (τ/ε)·√(T·ln(1/δ)), specs/clip21-sgd2m.md §4, §9 A1).

Noise multipliers here are always *accountant multipliers*: noise std divided by
the sensitivity under the neighbouring relation the algorithm protects.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from dataclasses import dataclass

from opacus.accountants.utils import get_noise_multiplier

from dpfl.errors import ConfigError

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1024)
def accountant_noise_multiplier(*, epsilon: float, delta: float, sample_rate: float,
                                steps: int, accountant: str) -> float:
    """Smallest multiplier with ε(accountant; multiplier, sample_rate, steps) ≤ epsilon."""
    try:
        with warnings.catch_warnings():  # "optimal order is the largest alpha" at tiny ε
            warnings.simplefilter("ignore", UserWarning)
            return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta,
                                              sample_rate=sample_rate, steps=steps,
                                              accountant=accountant,
                                              epsilon_tolerance=0.01))
    except ValueError as exc:  # Opacus: "The privacy budget is too low."
        raise ConfigError("epsilon", f"ε={epsilon} at δ={delta} over {steps} steps is not "
                          f"reachable: {exc}") from None


@dataclass(frozen=True)
class PrismaCalibration:
    """PriSMA Theorem 3 + Corollary 1 (eqs. 17-18, 102), specs/prisma.md §4.4.

    ``noise_multiplier`` is σ̂ = (b/N)·sqrt(3.5·T·α/ρ) with α = 1 + 2 ln(1/δ)/ε and
    ρ = ε/2: the ratio of the noise std to the replace-one sensitivity of the
    averaged query, the same in every round. ``valid`` says whether the theorem's
    sufficient condition (18) holds; the paper's own experiments violate it.
    """

    noise_multiplier: float
    alpha: float
    rho: float
    valid: bool


def prisma_paper_calibration(*, epsilon: float, delta: float, batch_size: int,
                             num_samples: int, rounds: int) -> PrismaCalibration:
    alpha = 1 + 2 * math.log(1 / delta) / epsilon
    rho = epsilon / 2
    scale = math.sqrt(3.5 * rounds * alpha / rho)
    z = batch_size / num_samples * scale
    inner = num_samples / (batch_size * alpha * (1 + z * z))
    valid = z * z >= 0.7 and inner > 0 and alpha <= (2 * z * z / 3) * math.log(inner) + 1
    if not valid:
        log.warning("PriSMA Theorem 3 condition (18) does not hold for ε=%s, δ=%s, b=%s, N=%s, "
                    "T=%s (σ̂=%.4g); the ledger's accountant ε is the guarantee to rely on.",
                    epsilon, delta, batch_size, num_samples, rounds, z)
    return PrismaCalibration(noise_multiplier=z, alpha=alpha, rho=rho, valid=valid)


def clip21_paper_noise_std(*, epsilon: float, delta: float, rounds: int, clip: float) -> float:
    """Clip21-SGD2M's proven noise level (specs/clip21-sgd2m.md §4; 002 App. G = 004 App. F).

    ``σ_ω = (8τ/ε)·sqrt(T·ln(5T/(4δ))·ln(1/δ))``: each of the T releases, of replace-one
    sensitivity 2τ, is (ε̃, δ/T)-DP with ε̃ = ε/(2·sqrt(2T ln(1/δ))) (Dwork–Roth Thm 3.22), and
    advanced composition gives (ε, δ) over T rounds (strictly (ε, 2δ), and Thm 3.22 needs
    ε̃ < 1). ``clip`` is τ, half the sensitivity of the released vector. Returns σ_ω, the
    per-coordinate standard deviation.
    """
    t = float(rounds)
    return 8 * clip / epsilon * math.sqrt(t * math.log(5 * t / (4 * delta)) * math.log(1 / delta))


def clip21_practice_noise_std(*, epsilon: float, delta: float, rounds: float,
                              clip: float) -> float:
    """The noise level of Clip21-SGD2M's DP experiments (specs/clip21-sgd2m.md §4, §9 A1).

    ``σ_ω = (τ/ε)·sqrt(T·ln(1/δ))``, inferred from the authors' related public code (the
    papers do not state it; ``rounds`` is T, which the run-config key ``practice-horizon``
    makes the number of rounds or of epochs, §9 A4). It is not a DP guarantee: the ledger's
    accountant ε for this noise is the one to report. For n = 25, batch 64, 150 epochs
    (T = 5625), δ = 1e-3: σ_ω/τ = 65.7, 37.9, 21.9, 12.6, 7.30 for ε = 3, 5.2, 9, 15.6, 27.
    """
    return clip / epsilon * math.sqrt(float(rounds) * math.log(1 / delta))
