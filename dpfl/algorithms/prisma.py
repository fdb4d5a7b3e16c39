"""PriSMA's family: its baseline DPSGD-GC and the calibration of its Theorem 3.

Huang, Zhang, Ling, "Differential Privacy in Distributed Learning: Beyond Uniformly Bounded
Stochastic Gradients", AISTATS 2025, PMLR 258:3223–3231.

Distributed DPSGD-GC (the paper's baseline; Abadi et al. 2016). Per round t and client
i, with a fresh batch B_i^t of b records drawn uniformly without replacement::

    v_i^t   = (1/b) Σ_{j∈B_i^t} clip_C(∇f_ij(x^t)) + ξ_i^t,   ξ_i^t ~ N(0, σ² I_d)
    x^{t+1} = x^t − η · (1/M) Σ_i v_i^t                       (no server clip, no momentum)

with clipping per sample on the flattened gradient (eq. 3). That is per-sample Clip-SGD
exactly, so ``dpsgd-gc`` is a registered preset of :class:`~dpfl.algorithms.clip21.ClipSGD`
with ``clipping="per-sample"``; what it adds is the paper's calibration. The averaged query has
replace-one sensitivity 2C/b (eqs. (7)–(9)). Calibration: ``paper`` uses σ̂ of Theorem 3 with
Corollary 1 (:func:`prisma_paper_calibration`); ``accountant`` the smallest multiplier whose
Opacus ε over T rounds at sampling rate b/N meets the target.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import ClassVar

from dpfl.algorithms.clip21 import Clip21Hyperparameters, ClipSGD
from dpfl.algorithms.registry import ALGORITHMS
from dpfl.config import CLIP, hyperparameter
from dpfl.privacy import CALIBRATIONS, Query, Target

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DPSGDGCHyperparameters(Clip21Hyperparameters):
    clip: float = hyperparameter(CLIP)  # C
    clipping: ClassVar[str] = "per-sample"
    gradient_noise: ClassVar[float] = 0.0


@ALGORITHMS.register_class
class DPSGDGC(ClipSGD):
    """Distributed DPSGD-GC: per-sample clipped, client-noised SGD with plain averaging, one
    step per round (per-sample Clip-SGD with the paper's calibration)."""

    name = "dpsgd-gc"
    Hyperparameters = DPSGDGCHyperparameters
    protection = "record-level local DP per client (replace-one neighbours), client-side noise"


@dataclass(frozen=True)
class PrismaCalibration:
    """Theorem 3 with Corollary 1 (eqs. 17–18, 102).

    ``noise_multiplier`` is σ̂ = (b/N)·sqrt(3.5·T·α/ρ) with α = 1 + 2 ln(1/δ)/ε and
    ρ = ε/2: the ratio of the noise std to the replace-one sensitivity of the averaged query,
    the same in every round. ``valid`` says whether the theorem's sufficient condition (18)
    holds; the paper's own experiments violate it.
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


@CALIBRATIONS.register("paper", "dpsgd-gc")
def paper_calibration(algorithm: DPSGDGC, query: Query, target: Target, options: None) -> float:
    """σ̂ of Theorem 3 for the client's N records."""
    return prisma_paper_calibration(epsilon=target.epsilon, delta=target.delta,
                                    batch_size=algorithm.hp.batch_size,
                                    num_samples=target.num_samples,
                                    rounds=target.rounds).noise_multiplier
