"""Noise calibration: from a target (ε, δ) to each query's noise multiplier.

The run-config key ``calibration`` names an entry of :data:`CALIBRATIONS`. ``accountant``
(registered here, for every algorithm with one query per round) asks an Opacus accountant for
the smallest noise multiplier whose ε over the run meets the target (the ledger's ε: for ``rdp``
over its extended orders, :mod:`dpfl.privacy.rdp`). Papers' own formulas
(``paper``: the proven bound; ``practice``: the mapping a paper's experiments used) are
registered by each algorithm family from its own module, for its own algorithms. A
calibration may read run-config keys of its own (``Calibration.options``, a frozen dataclass
of :func:`dpfl.config.hyperparameter` fields). :func:`calibrate` applies the chosen one, or a
``noise-multiplier`` given directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dpfl.errors import ConfigError
from dpfl.privacy import prv, rdp, subsampled_rdp  # noqa: F401  (register their accountants)
from dpfl.privacy.accountants import ACCOUNTANTS
from dpfl.privacy.release import Query, Release


@dataclass(frozen=True)
class Target:
    """What calibration aims at, for one client."""

    epsilon: float
    delta: float
    rounds: int  # rounds the client may take part in: every round of the run
    accountant: str  # "rdp" or "prv"
    num_samples: int  # the client's records
    steps: int  # compositions of all the client's releases over those rounds


# (algorithm, query, target, options) -> noise multiplier (std / sensitivity)
Formula = Callable[[Any, Query, Target, Any], float]


@dataclass(frozen=True)
class Calibration:
    """A registered calibration: ``formula`` for ``algorithms`` (None: any algorithm);
    ``targets_epsilon`` is false for one that sets the noise from its own keys instead of
    meeting ``epsilon``."""

    name: str
    formula: Formula
    algorithms: tuple[str, ...] | None = None
    options: type | None = None  # its own run-config keys, as a hyperparameter dataclass
    targets_epsilon: bool = True


class CalibrationRegistry:
    """Calibrations by name; an algorithm's own entry comes before one for any algorithm."""

    def __init__(self) -> None:
        self._entries: list[Calibration] = []

    def register(self, name: str, *algorithms: str, options: type | None = None,
                 targets_epsilon: bool = True) -> Callable[[Formula], Formula]:
        """Decorator: ``formula`` is calibration ``name`` for ``algorithms`` (all if none)."""
        def add(formula: Formula) -> Formula:
            entry = Calibration(name, formula, algorithms or None, options, targets_epsilon)
            if any(e.name == name and e.algorithms == entry.algorithms for e in self._entries):
                raise ValueError(f"calibration {name!r} is registered twice for {algorithms}")
            self._entries.append(entry)
            return formula

        return add

    def offered(self, algorithm: str) -> tuple[str, ...]:
        """The calibration names ``algorithm`` offers, sorted."""
        return tuple(sorted({e.name for e in self._entries
                             if e.algorithms is None or algorithm in e.algorithms}))

    def get(self, name: str, algorithm: str) -> Calibration:
        own = [e for e in self._entries if e.name == name and e.algorithms
               and algorithm in e.algorithms]
        generic = [e for e in self._entries if e.name == name and e.algorithms is None]
        if not own + generic:
            raise ConfigError("calibration", f"{name!r} is not offered by algorithm "
                              f"{algorithm!r}", allowed=self.offered(algorithm))
        return (own + generic)[0]

    def all(self) -> list[Calibration]:
        return list(self._entries)


CALIBRATIONS = CalibrationRegistry()


@functools.lru_cache(maxsize=1024)
def accountant_noise_multiplier(*, epsilon: float, delta: float, sample_rate: float,
                                steps: int, accountant: str) -> float:
    """Smallest multiplier with ε(accountant; multiplier, sample_rate, steps) ≤ epsilon, by the
    registered accountant's own search (:class:`~dpfl.privacy.accountants.Accountant`: Opacus'
    ``get_noise_multiplier``; for ``rdp`` its search with the ledger's ε, whose orders extend
    Opacus' defaults: :func:`dpfl.privacy.rdp.noise_multiplier`)."""
    search = ACCOUNTANTS.get(accountant).noise_multiplier
    if search is None:
        raise ConfigError("accountant", f"{accountant!r} gives ε only, it calibrates no noise",
                          allowed=", ".join(n for n in ACCOUNTANTS.names()
                                            if ACCOUNTANTS.get(n).noise_multiplier))
    try:
        return search(epsilon=epsilon, delta=delta, sample_rate=sample_rate, steps=steps)
    except ValueError as exc:  # Opacus: "The privacy budget is too low."
        raise ConfigError("epsilon", f"ε={epsilon} at δ={delta} over {steps} steps is not "
                          f"reachable: {exc}") from None


@CALIBRATIONS.register("accountant")
def accountant(algorithm: Any, query: Query, target: Target, options: None) -> float:
    """Opacus' smallest multiplier for the target over all of the run's compositions
    (``target.steps``: every release of the client, each round it runs in, times its steps) at
    the query's sample rate, which every release shares (:func:`calibrate`). Opacus analyses
    Poisson sampling with add/remove neighbours; the multiplier is used as std / sensitivity
    under the algorithm's own relation (the usual conservative proxy for fixed-size batches and
    replace-one neighbours)."""
    return accountant_noise_multiplier(epsilon=target.epsilon, delta=target.delta,
                                       sample_rate=query.sample_rate, steps=target.steps,
                                       accountant=target.accountant)


def calibrate(algorithm: Any, queries: list[Query], target: Target, *, calibration: str,
              noise_multiplier: float, options: Any = None) -> list[Release]:
    """The releases of ``queries`` for one client: none of them noised for a ``noise_free``
    algorithm; ``noise_multiplier`` (run-config convention, std / radius, as the algorithm's
    ``noise_multipliers`` maps it) when it is ≥ 0; else
    the calibration ``calibration`` registered for ``algorithm.name``. A calibration meets the
    target for the whole run; the generic ``accountant`` one gives every release the same
    multiplier, which is how to do that when they share a sample rate (one release per round; or
    one in the first round, another in the others) and only then."""
    if getattr(algorithm, "noise_free", False):
        return [Release.of(q, 0.0) for q in queries]
    if noise_multiplier >= 0:
        return [Release.of(q, z) for q, z in
                zip(queries, algorithm.noise_multipliers(queries, noise_multiplier), strict=True)]
    entry = CALIBRATIONS.get(calibration, algorithm.name)
    if entry.algorithms is None and len({q.sample_rate for q in queries}) > 1:
        raise ConfigError("calibration", f"{calibration!r} calibrates releases of one sample "
                          f"rate; algorithm {algorithm.name!r} makes releases at "
                          f"{len({q.sample_rate for q in queries})}: set "
                          f"noise-multiplier, or use a calibration of its own",
                          allowed=[n for n in CALIBRATIONS.offered(algorithm.name)
                                   if n != calibration])
    return [Release.of(q, entry.formula(algorithm, q, target, options)) for q in queries]
