"""The ``accountant`` registry: the ledger's accountants by name.

Each entry is ε(history, δ) of a history of ``(noise multiplier, sample rate, steps)`` events
(Opacus' compact history), registered where its analysis is written: ``rdp`` and
``rdp-classical`` (:mod:`dpfl.privacy.rdp`), ``prv`` (:mod:`dpfl.privacy.prv`), ``rdp-wor``
(:mod:`dpfl.privacy.subsampled_rdp`) and the independent ``dp-accounting-pld``,
``dp-accounting-rdp`` and ``dp-accounting-rdp-wor`` (:mod:`dpfl.privacy.independent`). The
ledger looks a name up (:mod:`dpfl.privacy.ledger`), for a history with steps and positive
multipliers.
"""

from __future__ import annotations

from collections.abc import Callable

from dpfl.registry import Registry

Event = tuple[float, float, int]  # (noise_multiplier, sample_rate, steps)
#: ε at δ of a history of events
Epsilon = Callable[[tuple[Event, ...], float], float]

ACCOUNTANTS: Registry[Epsilon] = Registry("accountant")
