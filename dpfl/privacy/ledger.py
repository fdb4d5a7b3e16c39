"""The privacy ledger: what a client released, and the ε it has spent.

Following ``dp_accounting``'s event view, the ledger never adds ε values by
hand. It records each release as an event (noise multiplier, sample rate,
steps) in Opacus' compact history format and asks an Opacus accountant (RDP or
PRV) for the ε of the whole history at the run's δ.

The multiplier recorded is noise std over the sensitivity under the protected
``relation``. Opacus' accountants analyse Poisson subsampling with add/remove
neighbours; for fixed-size sampling without replacement and replace-one
neighbours we feed std / (replace-one sensitivity), the usual conservative
proxy (specs/prisma.md §4.5), and say so in the ledger.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from dataclasses import dataclass, field

import numpy as np
from opacus.accountants import RDPAccountant, create_accountant
from opacus.accountants.analysis import rdp as rdp_analysis

Event = tuple[float, float, int]  # (noise_multiplier, sample_rate, steps)


@functools.lru_cache(maxsize=4096)
def _rdp_per_step(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """Opacus' RDP curve of one subsampled-Gaussian step at its default orders."""
    return np.asarray(rdp_analysis.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier,
                                               steps=1, orders=RDPAccountant.DEFAULT_ALPHAS))


@functools.lru_cache(maxsize=65536)
def _epsilon(accountant: str, history: tuple[Event, ...], delta: float) -> float:
    if not history:
        return 0.0
    if any(z <= 0 for z, _, _ in history):
        return math.inf
    if accountant == "rdp":
        # RDPAccountant.get_epsilon, with each (z, q) curve computed once: the RDP of
        # `steps` compositions is `steps` times the one-step curve (Opacus does the same).
        rdp = sum(_rdp_per_step(z, q) * steps for z, q, steps in history)
        eps, _ = rdp_analysis.get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp,
                                                delta=delta)
        return float(eps)
    acc = create_accountant(mechanism=accountant)
    acc.history = list(history)
    with warnings.catch_warnings():  # PRV's numerics warn (and give inf) at tiny noise
        warnings.simplefilter("ignore")
        return float(acc.get_epsilon(delta=delta))


def _merge(history: list[Event], event: Event) -> None:
    z, q, steps = event
    if steps <= 0:
        return
    if history and history[-1][:2] == (z, q):
        history[-1] = (z, q, history[-1][2] + steps)
    else:
        history.append((z, q, steps))


@dataclass
class PrivacyLedger:
    """Cumulative privacy spending of one client."""

    accountant: str
    relation: str
    history: list[Event] = field(default_factory=list)

    def record(self, *, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        _merge(self.history, (float(noise_multiplier), float(sample_rate), int(steps)))

    def epsilon(self, delta: float) -> float:
        return _epsilon(self.accountant, tuple(self.history), delta)

    def epsilon_after(self, events: list[Event], delta: float) -> float:
        """ε if ``events`` were released next (nothing is recorded)."""
        history = list(self.history)
        for event in events:
            _merge(history, event)
        return _epsilon(self.accountant, tuple(history), delta)

    @property
    def steps(self) -> int:
        return sum(steps for _, _, steps in self.history)

    def to_json(self) -> str:
        return json.dumps({"accountant": self.accountant, "relation": self.relation,
                           "history": self.history})

    @classmethod
    def from_json(cls, text: str) -> PrivacyLedger:
        data = json.loads(text)
        return cls(accountant=data["accountant"], relation=data["relation"],
                   history=[tuple(e) for e in data["history"]])
