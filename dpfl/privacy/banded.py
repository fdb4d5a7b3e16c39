"""Banded matrix-factorization noise: the banded square root of the prefix-sum workload.

Choquette-Choo, McMahan, Rush, Thakurta, "Multi-Epoch Matrix Factorization Mechanisms for
Private Machine Learning", ICML 2023, and Choquette-Choo, Ganesh, McKenna, McMahan, Rush,
Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A unified approach to private training",
NeurIPS 2023 (arXiv:2306.08153), for the mechanism and its accounting; Kalinin, Lampert, "Banded
Square Root Matrix Factorization for Differentially Private Model Training", NeurIPS 2024
(arXiv:2405.13763), for the strategy.

The released prefix sums are A(G + C⁻¹Z): A the lower-triangular ones (the workload), G the
rounds' sums, Z i.i.d. N(0, σ² I) a round, C a lower-triangular banded Toeplitz matrix whose
first column is c = (c_0, …, c_{b−1}, 0, …). Round t's released value is g_t plus the noise
increment (C⁻¹Z)_t, which the recurrence

    e_t = (z_t − Σ_{j=1}^{b−1} c_j e_{t−j}) / c_0

streams with the last b − 1 increments as its state (:func:`increment`). The banded square root
(BSR) takes c_k = binom(2k, k)/4^k, the first b coefficients of (1 − x)^{−1/2}, whose square is
A's generating function 1/(1 − x): with b as long as the run, C = A^{1/2} (the optimal
factorization's shape), with b = 1 independent noise (DP-SGD's).

Sensitivity. Releasing A(G + C⁻¹Z) is post-processing of CG + Z. A record's contribution to
round t moves CG by c shifted to row t (column t of C, rows t … t + b − 1): norm ‖c‖ per unit of
contribution. Where a record's rounds are at least b apart, those columns have disjoint
supports, so k participations move CG by √k·‖c‖: a Gaussian mechanism of multiplier σ/‖c‖ per
participation, composed over the participations (the banded matrix's property, Choquette-Choo
et al. 2023, Theorem 2). The schedule must keep every client's rounds at least b apart: a
cyclic one, each client every R ≥ b rounds.
"""

from __future__ import annotations

import math

import torch


def square_root_coefficients(bands: int) -> list[float]:
    """c_k = binom(2k, k) / 4^k for k < ``bands``: the first ``bands`` coefficients of
    (1 − x)^{−1/2} (c_0 = 1, c_1 = 1/2, c_2 = 3/8, …), by the ratio c_k = c_{k−1}(2k − 1)/(2k)."""
    if bands < 1:
        raise ValueError(f"a banded matrix needs at least one band, got {bands}")
    coefficients = [1.0]
    for k in range(1, bands):
        coefficients.append(coefficients[-1] * (2 * k - 1) / (2 * k))
    return coefficients


def column_norm(coefficients: list[float]) -> float:
    """‖c‖: one participation's sensitivity over the contribution's norm."""
    return math.sqrt(sum(c * c for c in coefficients))


def increment(history: torch.Tensor, coefficients: list[float],
              fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The round's noise e_t and the history after it, from ``history [b − 1, d]`` (e_{t−1},
    e_{t−2}, …, most recent first; zeros before the first round) and ``fresh``, the round's
    z_t ``[d]``. ``history`` is not modified."""
    noise = fresh.clone()
    for j, c in enumerate(coefficients[1:], start=1):
        noise.sub_(history[j - 1], alpha=c)
    noise.div_(coefficients[0])
    return noise, torch.cat([noise.unsqueeze(0), history[:-1]]) if len(history) else history
