"""Buffered-linear-Toeplitz (BLT) matrix-factorization noise, optimised by jax_privacy.

Dvijotham, McKenna, Pillutla, Rush, Thakurta, "Efficient and Near-Optimal Noise Generation for
Streaming Differential Privacy", FOCS 2024 (arXiv:2404.16706), for the mechanism; McMahan, Xu,
Zhang, "A Hassle-free Algorithm for Private Learning in Practice: Don't Use Tree Aggregation,
Use BLTs", EMNLP 2024 (arXiv:2408.08868), for its multi-participation form in federated
learning (BLT-DP-FTRL).

As for banded noise (:mod:`dpfl.privacy.banded`), the released prefix sums are A(G + C⁻¹Z), C
lower-triangular Toeplitz, and round t releases g_t plus (C⁻¹Z)_t. A BLT is a Toeplitz matrix
whose first column is c_0 = 1, c_k = Σ_j ω_j θ_j^{k−1} (k ≥ 1): the buffers' decays θ and
output scales ω. C⁻¹ is a BLT too, (θ', ω'), so the noise streams with one model-sized buffer
per decay, whatever the horizon (:func:`increment`):

    e_t = z_t + Σ_j ω'_j s_j,    then s_j ← θ'_j s_j + z_t.

The strategy C is jax_privacy's ``buffered_toeplitz.optimize`` for the horizon n (the rounds
the noise is calibrated for), min-separation R (the rounds between a client's participations)
and k = ⌈n/R⌉ participations, minimising the largest prefix-sum error: a library written for
this by the mechanism's authors, which optimises the buffers with their closed forms and checks
the result (a dependency of ``dpfl[blt]`` only; see :func:`optimised`).

Sensitivity. C's columns overlap (c_k > 0 for every k), so unlike banded noise j
participations do not move CG by √j·‖c‖. For non-negative, non-increasing c, the worst j
participations at least R apart move it by Δ_j = ‖Σ_{i<j} C e_{iR}‖ (Kalinin & Lampert, NeurIPS
2024, arXiv:2405.13763, Theorem 2; jax_privacy's ``toeplitz.minsep_sensitivity_squared``). The
ledger composes one Gaussian per participation: each is declared with sensitivity ν per unit
of contribution, ν² = max_{j ≤ k} Δ_j²/j, so that j participations compose to j·ν² ≥ Δ_j² for
every j ≤ k (Gaussian mechanisms compose by adding their squared sensitivities over σ²): exact
at the horizon where Δ_j²/j is largest there, and an upper bound before it. dpfl computes ν
itself from θ and ω (:func:`sensitivity`), after checking that c is positive and
non-increasing, the theorem's condition: jax_privacy supplies the buffers, never the number
the guarantee rests on, and a cached strategy cannot bring its own.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import torch

from dpfl.atomic import write_atomically
from dpfl.folders import user_cache


@dataclass(frozen=True)
class Strategy:
    """A BLT factor C for ``horizon`` rounds: its buffers (``decay`` θ, ``scale`` ω) and its
    inverse's (θ', ω'); :attr:`norm` is ν, a participation's sensitivity over the
    contribution's norm (module docstring)."""

    horizon: int
    separation: int
    decay: tuple[float, ...]
    scale: tuple[float, ...]
    inverse_decay: tuple[float, ...]
    inverse_scale: tuple[float, ...]

    @property
    def participations(self) -> int:
        """k = ⌈n/R⌉: the most a client takes part in over the horizon."""
        return math.ceil(self.horizon / self.separation)

    def coefficients(self, n: int) -> list[float]:
        """C's first column to n entries: c_0 = 1, c_k = Σ_j ω_j θ_j^{k−1}."""
        return [1.0] + [sum(w * d ** (k - 1) for d, w in zip(self.decay, self.scale,
                                                             strict=True))
                        for k in range(1, n)]

    @functools.cached_property
    def norm(self) -> float:
        """ν = √(max_{j ≤ k} Δ_j²/j) (:func:`sensitivity`)."""
        return sensitivity(self.coefficients(self.horizon), self.separation,
                           self.participations)


def sensitivity(coefficients: list[float], separation: int, participations: int) -> float:
    """ν for the Toeplitz C of first column ``coefficients`` (n = their number of rounds): Δ_j,
    the norm of the sum of C's columns 0, R, …, (j − 1)R, is the worst j participations at
    least R = ``separation`` apart where the coefficients are positive and non-increasing
    (Kalinin & Lampert 2024, Theorem 2), which is checked; ν² = max_{j ≤ k} Δ_j²/j."""
    c = torch.tensor(coefficients, dtype=torch.float64)
    if not (bool((c > 0).all()) and bool((c[1:] <= c[:-1]).all())):
        raise ValueError("a BLT's coefficients must be positive and non-increasing for its "
                         "min-separation sensitivity")
    n, moved, ratios = len(c), torch.zeros(len(c), dtype=torch.float64), []
    for j in range(participations):
        start = j * separation
        if start >= n:
            break
        moved[start:] += c[:n - start]  # column j·R of C
        ratios.append(float(moved.square().sum()) / (j + 1))
    return math.sqrt(max(ratios))


def optimised(horizon: int, separation: int) -> Strategy:
    """jax_privacy's max-error BLT for ``horizon`` rounds, participations at least
    ``separation`` apart (at most ⌈horizon/separation⌉). The optimisation takes tens of
    seconds on a CPU, so its result is kept: in the process, and in ``blt`` in dpfl's user
    cache folder (:func:`dpfl.folders.user_cache`), one JSON file per (jax_privacy version,
    horizon, separation), written whole; an unreadable one is computed again. A strategy is
    public (it depends on the schedule alone), so the file holds nothing private. jax_privacy
    evaluates in float64 inside its own ``jax.enable_x64`` context: the process's jax settings
    are left as they are."""
    if horizon < 1 or separation < 1:
        raise ValueError(f"a BLT needs horizon and separation >= 1, got {horizon}, "
                         f"{separation}")
    return _kept(horizon, separation)


def cache_file(horizon: int, separation: int) -> Path:
    """Where :func:`optimised` keeps the strategy for (``horizon``, ``separation``)."""
    return user_cache() / "blt" / f"{version('jax-privacy')}-{horizon}-{separation}.json"


@functools.cache
def _kept(horizon: int, separation: int) -> Strategy:
    path = cache_file(horizon, separation)
    try:
        strategy = Strategy(**{k: tuple(v) if isinstance(v, list) else v
                               for k, v in json.loads(path.read_text()).items()})
        if (strategy.horizon, strategy.separation) == (horizon, separation):
            strategy.norm  # noqa: B018 (checks the coefficients: a bad file is computed again)
            return strategy
    except (OSError, ValueError, TypeError):
        pass
    strategy = _optimised(horizon, separation)
    try:
        write_atomically(path, lambda p: p.write_text(json.dumps(dataclasses.asdict(strategy))))
    except OSError:  # a read-only cache costs the next run the optimisation, nothing more
        pass
    return strategy


def _optimised(horizon: int, separation: int) -> Strategy:
    import jax
    from jax_privacy.matrix_factorization import buffered_toeplitz, toeplitz

    k = math.ceil(horizon / separation)
    with jax.enable_x64(True):
        blt = buffered_toeplitz.optimize(n=horizon, min_sep=separation, max_participations=k,
                                         error="max")
        inverse = blt.inverse()
        strategy = Strategy(horizon, separation, _floats(blt.buf_decay),
                            _floats(blt.output_scale), _floats(inverse.buf_decay),
                            _floats(inverse.output_scale))
        theirs = float(toeplitz.minsep_sensitivity_squared(
            strategy_coef=blt.toeplitz_coefs(horizon), min_sep=separation,
            max_participations=k)) / k
    if theirs > strategy.norm ** 2 * (1 + 1e-6):  # ours is the larger, max_j Δ_j²/j
        raise RuntimeError(f"jax_privacy's sensitivity {theirs} exceeds dpfl's "
                           f"{strategy.norm ** 2} for this BLT")
    return strategy


def _floats(values) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def increment(buffers: torch.Tensor, strategy: Strategy,
              fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The round's noise e_t = z_t + Σ_j ω'_j s_j and the buffers after it, s_j ← θ'_j s_j +
    z_t, from ``buffers [nbuf, d]`` (zeros before the first round) and ``fresh``, the round's
    z_t ``[d]``. ``buffers`` is not modified."""
    noise = fresh.clone()
    after = torch.empty_like(buffers)
    for j, (decay, scale) in enumerate(zip(strategy.inverse_decay, strategy.inverse_scale,
                                           strict=True)):
        noise.add_(buffers[j], alpha=scale)
        after[j] = buffers[j] * decay + fresh
    return noise, after
