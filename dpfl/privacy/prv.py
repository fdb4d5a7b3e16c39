"""Opacus' PRV accountant for a ledger history (Gopi, Lee, Wutschitz, "Numerical composition
of differential privacy", NeurIPS 2021, arXiv:2106.02848), with ε = inf for a history whose
grid would be too large to make."""

from __future__ import annotations

import math
import warnings

from dpfl.privacy import rdp
from dpfl.errors import ConfigError
from dpfl.privacy.accountants import ACCOUNTANTS, Accountant, Event

#: the most points of the grid on which Opacus' PRV accountant discretises a history (it holds
#: several float64 arrays of that length). Its safe domain spans at least the RDP ε of the
#: history at δ/4,000, so a history over the limit has an RDP ε in the thousands (noise far too
#: small to protect anything); its grid would take gigabytes and minutes (a DPSGD-GC run at
#: noise multiplier 0.01 spent 6, 67 and 212 s on the ε of rounds 1–3; the quantile family's
#: calibration asked for 173 GiB at z ≈ 0.008), and its PRV ε is given as inf, a valid bound.
#: Runs with any useful noise stay far below it (σ = 1, q = 0.01, 10,000 steps: 7.8·10⁵ points).
MAX_POINTS = 2**22
#: the largest target ε whose noise Opacus' PRV search finds (above, it runs for minutes or more)
EPSILON_MAX = 100.0


def grid_points(history: tuple[Event, ...], delta: float) -> float:
    """A lower bound on the length of the grid Opacus' PRV accountant discretises ``history``
    on for ``get_epsilon(delta)`` at its default tolerances (ε error 0.01, δ error δ/1000): its
    safe domain [−L, L] has L ≥ 3 + the RDP ε of the history at a quarter of the δ error,
    which :func:`dpfl.privacy.rdp.epsilon` bounds from below (it minimises over more orders
    than Opacus' RDP accountant there), and its mesh is the ε error over
    √(T·ln(12/δ error)/2) for T steps (``PRVAccountant._get_domain``). No grid is made, and the
    RDP curves are the ledger's cached ones."""
    eps_error, delta_error = 0.01, delta / 1000
    half_width = 3 + max(rdp.epsilon(history, delta_error / 4), eps_error)
    steps = sum(n for *_, n in history)
    return 2 * half_width * math.sqrt(steps * math.log(12 / delta_error) / 2) / eps_error


def epsilon(history: tuple[Event, ...], delta: float) -> float:
    """Opacus' ``PRVAccountant.get_epsilon(delta)`` of ``history``; inf where its grid would
    exceed :data:`MAX_POINTS` points."""
    if grid_points(history, delta) > MAX_POINTS:
        return math.inf
    # Opacus is imported on use: a ClientApp that only records releases never loads it
    from opacus.accountants import PRVAccountant

    accountant = PRVAccountant()
    accountant.history = list(history)
    with warnings.catch_warnings():  # PRV's numerics warn (and give inf) at tiny noise
        warnings.simplefilter("ignore")
        return float(accountant.get_epsilon(delta=delta))


def noise_multiplier(*, epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """Opacus' ``get_noise_multiplier`` with its PRV accountant (ε tolerance 0.01); refused
    above :data:`EPSILON_MAX`."""
    if epsilon > EPSILON_MAX:
        raise ConfigError("epsilon", f"{epsilon:g} is beyond what the prv accountant's search "
                          f"handles (it does not end)", allowed=f"at most {EPSILON_MAX:g} "
                          f"with accountant=\"prv\", or accountant=\"rdp\"")
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():  # PRV's numerics warn at tiny ε
        warnings.simplefilter("ignore", UserWarning)
        return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta,
                                          sample_rate=sample_rate, steps=steps,
                                          accountant="prv", epsilon_tolerance=0.01))


ACCOUNTANTS.add("prv", Accountant(epsilon, "Opacus' PRV accountant, numerical",
                                  noise_multiplier))
