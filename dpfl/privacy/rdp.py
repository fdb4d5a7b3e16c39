"""Opacus' RDP accountant over orders extended past its defaults, evaluated where they can help.

Opacus' ``RDPAccountant`` converts the RDP of a history to (ε, δ)-DP with Balle et al.'s bound
("Hypothesis testing interpretations and Rényi differential privacy", AISTATS 2020,
arXiv:1905.09982, Theorem 21), ε = min_α RDP(α) + c(α) with
c(α) = ln((α − 1)/α) − (ln δ + ln α)/(α − 1), over its ``DEFAULT_ALPHAS``: 1.1 to 10.9 by
tenths and the integers 12 to 63. Where the best of them is an end of that range, its ε is only
an upper bound of what the RDP curve certifies: for little noise (ε above about 140 at
δ = 1e-5) the best order lies below 1.1, for much noise (ε below about 2 ln(1/δ)/63, 0.37 at
δ = 1e-5) above 63. :data:`ORDERS` adds :data:`LOW_ORDERS` (20 orders from 1.001 to 1.08,
geometric in α − 1) and :data:`HIGH_ORDERS` (17 from 64 to 1024, ratio 2^¼; Opacus' sum for
an integer order overflows above 1030, and 1024 already covers ε down to 2 ln(1/δ)/1024, 0.022 at
δ = 1e-5).

The extensions cost more than the defaults (an order near 1 of a subsampled Gaussian is a slowly
converging series, an integer order α a sum of α terms), so each is evaluated only when a lower
bound on its ε shows it could beat the default range's best; :func:`epsilon` is nevertheless
the minimum over all of :data:`ORDERS`:

* below 1.1, RDP(α) ≥ 0, so ε(α) ≥ c(α);
* above 63, (α − 1)·RDP(α) is convex in α (for a Rényi divergence, van Erven & Harremoës,
  "Rényi divergence and Kullback-Leibler divergence", IEEE Trans. Inf. Theory 2014,
  arXiv:1206.2459; a composition's RDP is a sum of them), so it lies above the line through its
  values at 62 and 63, which bounds RDP(α) from below.

Opacus' own fractional orders (1.1 to 10.9) are the costly ones too (a series each), and the same
convexity prunes them without changing the result: the integer orders 2–11 (a closed-form sum;
computed for the bound, never minimised over) and Opacus' integers bound f(α) = (α − 1)·RDP(α)
below on each interval [n, n + 1] by its neighbouring secants, and an order whose bound on
ε(α) is not below the best ε found is not evaluated: it cannot be the minimum. Every order
that is evaluated gets Opacus' value, so :func:`epsilon` equals the minimum over all of them bit
for bit; a calibration, which evaluates many multipliers, runs about 1.7× faster.

:func:`noise_multiplier` is Opacus' ``get_noise_multiplier`` (the same doubling and bisection)
with this ε, so a multiplier calibrated for ε gives the ledger ε ≤ target; where the default
orders' optimum is interior both are Opacus' values bit for bit.

The analysis is Opacus' module ``opacus.accountants.analysis.rdp``, loaded from its file alone
(:func:`analysis`): importing it the usual way runs Opacus' package ``__init__``, which loads
its ``PrivacyEngine``, every optimizer and ``scipy.stats``, about 2 s of CPU that a SuperNode
checking its own budget would pay on every message (Flower starts a ClientApp process per
message).

:func:`epsilon` is the ledger's accountant ``rdp``; :func:`classical_epsilon`, ``rdp-classical``,
converts the same RDP the classical way, which papers of the TF-Privacy era report.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np

from dpfl.privacy.accountants import ACCOUNTANTS, Accountant, Event

#: orders below Opacus' smallest (1.1): 1 + 10^(−3 + k/10), k = 0…19
LOW_ORDERS = tuple(1 + 10 ** (-3 + k / 10) for k in range(20))
#: orders above Opacus' largest (63): 64·2^(k/4) rounded, k = 0…16 (64 to 1024)
HIGH_ORDERS = tuple(round(64 * 2 ** (k / 4)) for k in range(17))
#: Opacus' largest order, the one below it, and its smallest
_TOP, _BELOW_TOP, _BOTTOM = 63, 62, 1.1
#: Opacus' MAX_SIGMA: calibration gives up above it
MAX_NOISE_MULTIPLIER = 1e6


#: Opacus' ``RDPAccountant.DEFAULT_ALPHAS`` (1.1 to 10.9 by tenths, the integers 12 to 63),
#: written out because reading it imports the whole of Opacus (a test holds it equal)
DEFAULT_ORDERS = tuple(1 + x / 10.0 for x in range(1, 100)) + tuple(range(12, 64))


@functools.cache
def analysis() -> ModuleType:
    """Opacus' ``opacus.accountants.analysis.rdp``, its file loaded alone (it imports only
    numpy and ``scipy.special``), without running Opacus' package ``__init__`` (module
    docstring): the same code, so the same numbers."""
    package = importlib.util.find_spec("opacus")  # found, not imported
    assert package is not None and package.origin is not None, "opacus is a dependency"
    path = Path(package.origin).parent / "accountants" / "analysis" / "rdp.py"
    spec = importlib.util.spec_from_file_location(f"{__name__}._opacus_rdp", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def orders() -> tuple[float, ...]:
    """Every order :func:`epsilon` minimises over: the low extension, Opacus' defaults, the
    high extension."""
    return LOW_ORDERS + DEFAULT_ORDERS + HIGH_ORDERS


def curve(noise_multiplier: float, sample_rate: float, alphas: tuple[float, ...]) -> np.ndarray:
    """Opacus' RDP of one Poisson-subsampled Gaussian step at ``alphas``, each order computed
    once per (σ, q) (:func:`_order_rdp`); the RDP of ``steps`` compositions is ``steps`` times
    it, as in Opacus."""
    return np.asarray([_order_rdp(noise_multiplier, sample_rate, a) for a in alphas],
                      dtype=np.float64)


@functools.lru_cache(maxsize=65536)
def _order_rdp(noise_multiplier: float, sample_rate: float, alpha: float) -> float:
    """Opacus' ``compute_rdp`` of one step at the single order ``alpha`` (it computes each
    order on its own, so the value equals that order's entry of a call with many). Cached by
    order, not by the tuple of orders asked: the orders a history's ε evaluates change from
    one history to the next (:func:`_default_best` prunes by the history's own values), while
    a run's rounds keep asking for the same (σ, q, α)."""
    return float(analysis().compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier,
                                        steps=1, orders=[alpha])[0])


def _rdp(history: tuple[Event, ...], alphas: tuple[float, ...]) -> np.ndarray:
    return sum(curve(z, q, alphas) * steps for z, q, steps in history)


#: integer orders below Opacus' integer defaults: evaluated to bound its fractional orders
_BOUND_ORDERS = tuple(range(2, 12))
#: an order is skipped only when its bound exceeds the best ε by this relative margin (the
#: bound and the series of a fractional order are computed in floating point)
_PRUNE_MARGIN = 1e-9
#: the fractional orders of least bound evaluated first (their ε prunes the others)
_FIRST_FRACTIONS = 3


def _default_best(history: tuple[Event, ...], delta: float) -> tuple[float, dict[float, float]]:
    """``(ε, RDP)``: the minimum over Opacus' default orders of ε(α) = RDP(α) + c(α), and the
    RDP of the history at its integer orders (2–63). A fractional order is evaluated only if
    the convexity of f(α) = (α − 1)·RDP(α) leaves room for it below the best ε so far (module
    docstring); the result is the minimum over all of them, bit for bit."""
    defaults = DEFAULT_ORDERS
    integers = tuple(a for a in defaults if float(a).is_integer())
    fractions = [a for a in defaults if not float(a).is_integer()]
    known = dict(zip(_BOUND_ORDERS + integers, _rdp(history, _BOUND_ORDERS + integers),
                     strict=True))
    values = np.asarray(list(known.values()))
    if not (np.isfinite(values).all() and set(range(2, 13)) <= known.keys()):
        rdp = _rdp(history, defaults)  # nothing to bound with: every order
        return _best(defaults, rdp, delta), dict(zip(defaults, rdp, strict=True))
    f = {int(a): (a - 1) * r for a, r in known.items()} | {1: 0.0}
    best = _best(integers, np.asarray([known[a] for a in integers]), delta)
    bounds: list[float] = []
    for a in fractions:
        n = math.floor(a)
        right = f[n + 1] - (f[n + 2] - f[n + 1]) * (n + 1 - a)
        left = f[n] + (f[n] - f[n - 1]) * (a - n) if n >= 2 else 0.0
        bounds.append(max(left, right, 0.0) / (a - 1) + _conversion_at(a, delta))
    # the most promising orders first, then those the best ε they give leaves in play
    by_bound = sorted(range(len(fractions)), key=bounds.__getitem__)
    for chosen in (by_bound[:_FIRST_FRACTIONS], by_bound[_FIRST_FRACTIONS:]):
        needed = tuple(fractions[i] for i in chosen
                       if bounds[i] <= best + _PRUNE_MARGIN * abs(best))
        if needed:
            best = min(best, _best(needed, _rdp(history, needed), delta))
    return best, known


def conversion(alphas: np.ndarray, delta: float) -> np.ndarray:
    """c(α) of Balle et al.'s conversion (Opacus' ``get_privacy_spent``): ε(α) = RDP(α) + c(α)."""
    return np.log((alphas - 1) / alphas) - (math.log(delta) + np.log(alphas)) / (alphas - 1)


@functools.lru_cache(maxsize=4096)
def _conversion_at(alpha: float, delta: float) -> float:
    """:func:`conversion` at one order (the same numpy arithmetic), computed once per (α, δ)."""
    return float(conversion(np.asarray(alpha), delta))


def _best(alphas: tuple[float, ...], rdp: np.ndarray, delta: float) -> float:
    with warnings.catch_warnings():  # "optimal order is the smallest/largest alpha"
        warnings.simplefilter("ignore", UserWarning)
        eps, _ = analysis().get_privacy_spent(orders=list(alphas), rdp=rdp, delta=delta)
    return float(eps)


def epsilon(history: tuple[Event, ...], delta: float, *, extended: bool = True) -> float:
    """ε at ``delta`` of a composition of Poisson-subsampled Gaussian events, by Opacus'
    RDP analysis minimised over :func:`orders` (over Opacus' defaults only if not
    ``extended``)."""
    eps, rdp = _default_best(history, delta)
    if not extended:
        return eps
    low = np.asarray(LOW_ORDERS)
    if eps > float(np.min(conversion(low, delta))):
        eps = min(eps, _best(LOW_ORDERS, _rdp(history, LOW_ORDERS), delta))
    top, below = rdp[_TOP], rdp[_BELOW_TOP]
    if math.isfinite(top):
        high = np.asarray(HIGH_ORDERS, dtype=np.float64)
        f_top = (_TOP - 1) * top
        slope = f_top - (_BELOW_TOP - 1) * below  # ≤ the slope of (α − 1)·RDP(α) at 63
        floor = (f_top + slope * (high - _TOP)) / (high - 1)
        if eps > float(np.min(floor + conversion(high, delta))):
            eps = min(eps, _best(HIGH_ORDERS, _rdp(history, HIGH_ORDERS), delta))
    return eps


#: the integer orders of the classical conversion (TF-Privacy's ``rdp_accountant`` and Opacus
#: before 1.0): Opacus' default orders stop at 63, too low for small ε
CLASSICAL_ORDERS = tuple(range(2, 257))


def classical_epsilon(history: tuple[Event, ...], delta: float) -> float:
    """ε at ``delta`` of the history's Opacus RDP (Poisson-subsampled Gaussian) converted the
    classical way, ε = min_α RDP(α) + ln(1/δ)/(α − 1) over :data:`CLASSICAL_ORDERS` (Mironov
    2017; TF-Privacy's ``rdp_accountant``). Opacus' own conversion (Balle et al. 2020,
    :func:`epsilon`) is tighter."""
    orders = np.asarray(CLASSICAL_ORDERS, dtype=np.float64)
    return float(np.min(_rdp(history, CLASSICAL_ORDERS) + math.log(1 / delta) / (orders - 1)))


def noise_multiplier(*, epsilon_target: float, delta: float, sample_rate: float, steps: int,
                     epsilon_tolerance: float = 0.01) -> float:
    """Opacus' ``get_noise_multiplier`` for the RDP accountant, with :func:`epsilon`: the
    multiplier σ found by bisection with target − tolerance < ε(σ) ≤ target. ValueError when
    no σ up to :data:`MAX_NOISE_MULTIPLIER` meets the target."""
    def eps_of(sigma: float) -> float:
        return epsilon(((sigma, sample_rate, steps),), delta)

    eps_high, sigma_low, sigma_high = math.inf, 0.0, 10.0
    while eps_high > epsilon_target:
        sigma_high = 2 * sigma_high
        eps_high = eps_of(sigma_high)
        if sigma_high > MAX_NOISE_MULTIPLIER:
            raise ValueError("The privacy budget is too low.")
    while epsilon_target - eps_high > epsilon_tolerance:
        sigma = (sigma_low + sigma_high) / 2
        eps = eps_of(sigma)
        if eps < epsilon_target:
            sigma_high, eps_high = sigma, eps
        else:
            sigma_low = sigma
    return sigma_high


def calibrated(*, epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """:func:`noise_multiplier` as the registry's accountants give it."""
    return noise_multiplier(epsilon_target=epsilon, delta=delta, sample_rate=sample_rate,
                            steps=steps)


ACCOUNTANTS.add("rdp", Accountant(epsilon, "Opacus' RDP accountant", calibrated))
ACCOUNTANTS.add("rdp-classical", Accountant(
    classical_epsilon, "the classical RDP conversion the PCDP paper's tables print: looser than "
    "Opacus' conversion"))
