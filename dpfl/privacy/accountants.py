"""The ``accountant`` registry: the ledger's accountants by name.

Each entry is ε(history, δ) of a history of ``(noise multiplier, sample rate, steps)`` events
(Opacus' compact history), registered where its analysis is written: ``rdp`` and
``rdp-classical`` (:mod:`dpfl.privacy.rdp`), ``prv`` (:mod:`dpfl.privacy.prv`), ``rdp-wor``
(:mod:`dpfl.privacy.subsampled_rdp`) and the independent ``dp-accounting-pld``,
``dp-accounting-rdp`` and ``dp-accounting-rdp-wor`` (:mod:`dpfl.privacy.independent`). The
ledger looks a name up (:mod:`dpfl.privacy.ledger`), for a history with steps and positive
multipliers. Each entry also says what it is (the run's statements name the ledger's other
accountants by it), and the accountants a run can calibrate its noise with (the run config's
``accountant``: ``rdp``, ``prv``) give the smallest noise multiplier that reaches a target ε.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dpfl.registry import Registry

Event = tuple[float, float, int]  # (noise_multiplier, sample_rate, steps)
#: ε at δ of a history of events
Epsilon = Callable[[tuple[Event, ...], float], float]



class NoiseMultiplier(Protocol):
    """The smallest noise multiplier σ whose ε over ``steps`` steps at ``sample_rate`` is at
    most ``epsilon`` at ``delta``; ValueError where none reaches it."""

    def __call__(self, *, epsilon: float, delta: float, sample_rate: float,
                 steps: int) -> float: ...


@dataclass(frozen=True)
class Accountant:
    """One accountant: ``epsilon`` of a history, ``about`` (what it is, in a few words), and
    ``noise_multiplier`` where a run can calibrate its noise with it (None: ε only)."""

    epsilon: Epsilon
    about: str
    noise_multiplier: NoiseMultiplier | None = None


ACCOUNTANTS: Registry[Accountant] = Registry("accountant")
