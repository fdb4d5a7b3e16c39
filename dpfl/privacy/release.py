"""Releases: the Gaussian mechanisms of a run, and every conversion between noise and std.

An algorithm declares the mechanisms it runs as :class:`Query` objects: the released value's
norm bound per record (its *radius*), the neighbouring relation, the sample rate, the number of
compositions per round and the exchange that sends it. Calibration
(:mod:`dpfl.privacy.calibration`) turns a query into a :class:`Release` by fixing its noise
multiplier. Three numbers describe the same noise, and only this module converts between them:

* the **noise multiplier** of a release, ``std / sensitivity``: what an accountant composes
  (Opacus' ``noise_multiplier`` under add/remove neighbours, the replace-one multiplier
  otherwise); :meth:`Relation.multiplier` re-expresses it under the other relation;
* the **Opacus multiplier** of the run-config key ``noise-multiplier``, ``std / radius``: the
  noise std on a sum of clipped vectors over the clip radius, whatever the relation — the
  add/remove multiplier, whose sensitivity is the radius (:meth:`Query.multiplier_of`);
* the **std** actually drawn, ``noise multiplier · sensitivity`` (:meth:`Release.std`), over
  √shares where the noise is split over the clients whose uploads the server sees summed
  (distributed noise: :attr:`Release.shares`).

The sensitivity is ``radius`` times the relation's :attr:`Relation.factor`: replacing one record
moves a sum of vectors of norm at most ``r`` by up to ``2r``, adding or removing one by ``r``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch


class Relation(StrEnum):
    """The neighbouring relation (dp-accounting's ``NeighboringRelation``): which datasets are
    neighbours. A member is its run-config and JSON spelling."""

    REPLACE_ONE = "replace-one"  # one record replaced by another
    ADD_REMOVE = "add-remove"  # one record added or removed

    @property
    def factor(self) -> float:
        """The sensitivity of a sum of vectors of norm at most r, over r."""
        return 2.0 if self is Relation.REPLACE_ONE else 1.0

    def multiplier(self, multiplier: float, of: Relation | str) -> float:
        """The noise multiplier under this relation of the noise whose multiplier under ``of``
        is ``multiplier`` (the same std over another sensitivity)."""
        return multiplier * Relation(of).factor / self.factor


class Side(StrEnum):
    """Who draws a release's noise: the client before anything leaves it (local DP), or the
    server in its step (central noise)."""

    CLIENT = "client"
    SERVER = "server"


@dataclass(frozen=True)
class Query:
    """A Gaussian mechanism an algorithm runs in each round it takes part in (uncalibrated).

    Parameters
    ----------
    name : str
        Names it in the algorithm's exchanges (:class:`dpfl.algorithms.Upload`) and in
        ``ctx.privatize``.
    exchange : str
        The exchange whose message carries it (or a function of it).
    radius : float or None
        ℓ2 bound of one record's contribution to the released value (one client's, for
        client-level clipping): τ for a clipped client vector, C/b for a mean of b per-sample
        gradients clipped at C. None when it changes every round (a radius the server sends):
        it is then given to each draw, and only the noise multiplier is fixed.
    relation : Relation
        The neighbouring relation (its spelling, ``"replace-one"`` or ``"add-remove"``, is
        taken too).
    sample_rate : float
        Probability that a given record takes part in one composition (b/m for a fixed-size
        batch of b out of m records; 1 when every record is used, e.g. any client-level
        mechanism: no amplification).
    steps : int
        Compositions per round (local steps that each draw noise).
    stream : str
        The random stream its noise is drawn from: streams are keyed by (seed, client, round,
        stream), so two queries of one algorithm must not share one.
    side : Side
        ``"client"`` (local DP: drawn by the client before anything leaves it) or ``"server"``
        (central noise, drawn by the server in ``server_step``).
    """

    name: str
    exchange: str
    radius: float | None
    relation: Relation
    sample_rate: float = 1.0
    steps: int = 1
    stream: str = "noise"
    side: Side = Side.CLIENT

    def __post_init__(self) -> None:
        for key, kind in (("relation", Relation), ("side", Side)):
            value = getattr(self, key)
            if value not in tuple(kind):
                raise ValueError(f"{key} {value!r} is not one of {[m.value for m in kind]}")
            object.__setattr__(self, key, kind(value))
        if not 0 < self.sample_rate <= 1 or self.steps < 1:
            raise ValueError(f"query {self.name!r}: sample rate in (0, 1] and steps >= 1")

    def sensitivity(self, radius: float | None = None) -> float:
        """ℓ2 sensitivity of the released value under the relation, for ``radius`` (the
        query's own when None)."""
        r = self.radius if radius is None else radius
        if r is None:
            raise ValueError(f"query {self.name!r} has no fixed radius: pass the round's")
        return self.relation.factor * r

    def record(self) -> dict[str, Any]:
        """The fields as plain values, the relation and side by their spelling: what results
        folders, checkpoints and node caches keep (checkpoints load only plain types)."""
        return {**dataclasses.asdict(self), "relation": self.relation.value,
                "side": self.side.value}

    def multiplier_of(self, opacus_multiplier: float) -> float:
        """The noise multiplier (std / sensitivity) of the noise of std ``opacus_multiplier ·
        radius`` (the run-config key ``noise-multiplier``, Opacus' convention): its add/remove
        multiplier, under this query's relation."""
        return self.relation.multiplier(opacus_multiplier, of=Relation.ADD_REMOVE)


@dataclass(frozen=True)
class Release(Query):
    """A calibrated :class:`Query`: ``noise_multiplier`` is std / sensitivity (0: no noise) of
    the noise the server's view of it carries.

    ``shares`` > 1 is distributed noise (run-config ``distributed-noise``): the server sees only
    the sum of the uploads (secure aggregation), which holds the draws of at least ``shares``
    clients, so each client draws std/√shares and the sum's noise has at least the release's
    std. The release's own event (:attr:`event`) is then the guarantee against a server that
    follows the protocol; :attr:`local_event` is one client's draw alone, the guarantee that is
    left where the server reads one client's upload unmasked."""

    noise_multiplier: float = 0.0
    shares: int = 1

    @classmethod
    def of(cls, query: Query, noise_multiplier: float) -> Release:
        return cls(**dataclasses.asdict(query), noise_multiplier=float(noise_multiplier))

    def record(self) -> dict[str, Any]:
        """:meth:`Query.record` with the noise multiplier, and the shares where split."""
        record = super().record()
        if self.shares == 1:  # as every release was recorded before noise could be split
            del record["shares"]
        return record

    def split(self, shares: int) -> Release:
        """This release with its noise split over ``shares`` clients (distributed noise)."""
        if shares < 1:
            raise ValueError(f"release {self.name!r}: shares must be >= 1, got {shares}")
        return dataclasses.replace(self, shares=int(shares))

    @property
    def drawn_multiplier(self) -> float:
        """The noise multiplier of one client's own draw: :attr:`noise_multiplier`, over
        √shares where the noise is split."""
        if self.shares == 1:
            return self.noise_multiplier
        return self.noise_multiplier / math.sqrt(self.shares)

    def std(self, radius: float | None = None) -> float:
        """The noise std one client draws: :attr:`drawn_multiplier` times the sensitivity for
        ``radius`` (the release's own when None)."""
        return self.drawn_multiplier * self.sensitivity(radius)

    @property
    def event(self) -> tuple[float, float, int]:
        """``(noise multiplier, sample rate, steps)``: one round of it, as Opacus' accountants
        keep their history (the server's view: the sum of every share, when split)."""
        return (self.noise_multiplier, self.sample_rate, self.steps)

    @property
    def local_event(self) -> tuple[float, float, int]:
        """The event of one client's own draw: :attr:`event` when the noise is not split, else
        at noise multiplier / √shares."""
        return (self.drawn_multiplier, self.sample_rate, self.steps)


def stds(releases: list[Release], radius: float | None = None) -> torch.Tensor:
    """float32 noise stds ``[C]`` that a cohort's clients draw for one query (``releases[i]``
    is client i's calibration of it, its share when split: :meth:`Release.std`; clients
    calibrate from their own data size, the sensitivity is the query's and the same for every
    client)."""
    sensitivity = releases[0].sensitivity(radius)
    if any(r.sensitivity(radius) != sensitivity for r in releases[1:]):
        raise ValueError(f"query {releases[0].name!r}: the clients' sensitivities differ")
    return torch.tensor([r.drawn_multiplier for r in releases],
                        dtype=torch.float32) * sensitivity
