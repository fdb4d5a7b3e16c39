"""The reduction under secure aggregation: each client's noised upload quantised to integers
on a public grid, summed exactly, and read back as the sum of the grid's values.

Secure aggregation sums integers modulo a power of two (Flower's SecAgg+: 2^32 by default),
so each upload is put on a grid first. dpfl chooses the grid from the upload's release, public
values only: the un-noised upload has norm at most the release's radius r, so each coordinate
lies in [−r, r], and the noise the client draws (std s, its share under distributed noise)
adds a Gaussian tail; the grid covers [−(r + 8s), r + 8s] (a coordinate of the noise falls
outside ±8s with probability 1.2e-15) in steps of 2^−k, the largest power of two at most
s/1024 (r/1024 without noise). A client's coordinate u becomes the integer

    q = clamp(rint(u · 2^k), −L, L) + L,    L = ceil((r + 8s) · 2^k),

rounded to nearest (ties to even) in float64, where multiplying by 2^k is exact: the same
integer on every machine. The clamp is the only place a value can change by more than half a
step, and it is post-processing of a noised release (no privacy cost; a saturated coordinate
is logged where it happens). Integer sums do not depend on their order or on how clients are
grouped into nodes, so the engine, summing the same integers, gives the server the same bits
as a federation whose nodes sum their clients' integers and mask them. The server reads

    sum = float32((Σ q − N·L) · 2^−k)

for the N rows summed. The bias of the rounding is at most half a step a coordinate, a
1/2048 of the noise's std.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dpfl.algorithms import State
from dpfl.errors import ConfigError
from dpfl.problem import Problem
from dpfl.rounds.transport import Reduction, RowSum

#: noise stds beyond the radius that the grid covers
TAIL = 8.0
#: grid steps per noise std (per radius without noise), at least: 2^10
RESOLUTION_BITS = 10
#: the modulus of the masked sums (Flower's ``SecAggPlusWorkflow`` default ``modulus_range``)
MODULUS = 2**32
#: the range a node's integer sum K is passed to Flower's SecAgg+ at (its ``max_weight`` and
#: ``quantization_range``), as the float64 2K − T: Flower's quantiser, given a weight of one
#: (its factor 1/T) and a clipping range of one, maps it back to K exactly (2K/T − 1 + 1 and
#: the scaling by T/2 are exact in float64 for K ≤ T ≤ 2^30, and an integer is never rounded
#: stochastically); K must stay below 2^31, Flower's int32 cast
FLOWER_RANGE = 2**30

log = logging.getLogger("dpfl")


@dataclass(frozen=True)
class Quantisation:
    """The grid of one upload: steps of 2^−``bits``, integers in [0, 2·``bound``]."""

    bits: int
    bound: int

    @classmethod
    def of(cls, radius: float, std: float) -> Quantisation:
        """The grid of an upload of norm at most ``radius`` plus noise of std ``std``."""
        scale = std if std > 0 else radius
        bits = RESOLUTION_BITS - math.floor(math.log2(scale))
        return cls(bits, math.ceil(math.ldexp(radius + TAIL * std, bits)))

    def block_sum(self, rows: Tensor) -> Tensor:
        """The int64 sum over ``rows`` ``[b, ...]`` of their grid points q = round(u·2^k)
        clamped to ±L, plus L (each in [0, 2L]; saturated coordinates are counted on this
        node's log), summed where that is exact and fast — float32 points in groups of
        rows whose sums stay within ±2^24 (every partial sum of integers there is exact, in any
        order), float64 points whole (exact below 2^53)."""
        points = self._points(rows)
        if points.dtype == torch.float64:
            return points.sum(dim=0).to(torch.int64) + len(rows) * self.bound
        group = max(1, 2**24 // max(self.bound, 1))
        total = points[:group].sum(dim=0).to(torch.int64)
        for start in range(group, len(points), group):
            total += points[start:start + group].sum(dim=0).to(torch.int64)
        return total + len(rows) * self.bound

    def _points(self, rows: Tensor) -> Tensor:
        """round(u·2^k) clamped to ±L, integer-valued, in float32 where that is exact (float32
        rows and L ≤ 2^24: multiplying by a power of two, rounding and clamping are then exact
        there as in float64, and a pass over float32 costs half), else float64."""
        exact = rows.dtype == torch.float32 and self.bound <= 2**24
        points = (rows if exact else rows.double()) * 2.0 ** self.bits
        low, high = torch.aminmax(points)  # one pass; the count only where some saturate
        if low < -self.bound or high > self.bound:
            saturated = int(torch.count_nonzero(points.abs() > self.bound))
            log.warning("secure aggregation: %d coordinate(s) of an upload beyond its grid's "
                        "range (radius + %g noise stds) were clamped; logged on this node only",
                        saturated, TAIL)
        return points.round_().clamp_(-self.bound, self.bound)

    def dequantise(self, total: Tensor, count: int) -> Tensor:
        """The float32 sum of ``count`` rows whose grid points sum to ``total`` (int64)."""
        return ((total - count * self.bound).double() * 2.0 ** -self.bits).float()


def quantisations(problem: Problem, exchange: str) -> dict[str, Quantisation]:
    """The grid of each upload of ``exchange`` (every client is calibrated alike under secure
    aggregation, so one client's releases are every client's); raises :class:`ConfigError`
    where the participants' integers could pass :data:`FLOWER_RANGE` (below :data:`MODULUS`:
    they never wrap)."""
    releases = {r.name: r for r in problem.releases(problem.hosted[0] if problem.hosted else 0)}
    grids = {}
    for key, upload in problem.algorithm.exchange(exchange).uploads.items():
        release = releases[upload.release]
        assert release.radius is not None, "secure_aggregation_refusal admits fixed radii only"
        grids[key] = Quantisation.of(release.radius, release.std())
    algorithm = problem.algorithm
    clients = algorithm.participants_per_round(algorithm.hp, problem.num_clients)
    widest = max((2 * g.bound for g in grids.values()), default=0)
    if clients * widest > FLOWER_RANGE:
        raise ConfigError("secure-aggregation", f"{clients} clients' uploads on grids of "
                          f"{widest} points would overflow the secure sum's range 2^30 "
                          f"(the grid spans the radius and {TAIL:g} noise stds in steps of "
                          f"1/{2**RESOLUTION_BITS} std)", allowed="fewer clients an exchange")
    return grids


class SecureSum:
    """The reduction under secure aggregation, with :class:`~dpfl.rounds.RowSum`'s interface:
    rows fed a block at a time (:meth:`add`), quantised and summed as int64, read back as
    float32 sums (:attr:`sums`)."""

    def __init__(self, grids: dict[str, Quantisation], device: torch.device) -> None:
        self.grids = grids
        self.device = device
        self.totals: dict[str, Tensor] = {}
        self.count = 0

    def add(self, rows: State) -> None:
        for key, values in rows.items():
            block = self.grids[key].block_sum(values)
            self.totals[key] = self.totals[key] + block if key in self.totals else block
        self.count += len(next(iter(rows.values()))) if rows else 0

    @property
    def sums(self) -> State:
        return {key: self.grids[key].dequantise(total, self.count).to(self.device)
                for key, total in self.totals.items()}


def node_vector(grid: Quantisation, rows: Tensor) -> np.ndarray:
    """What a node passes Flower's SecAgg+ mod for one upload of its participants ``rows``
    ``[m, ...]``: their grid points summed, K, as the float64 2K − T (:data:`FLOWER_RANGE`)."""
    total = grid.block_sum(rows)
    return (2 * total - FLOWER_RANGE).double().numpy()


def from_flower(grid: Quantisation, aggregate: np.ndarray, nodes: int, count: int) -> Tensor:
    """The float32 sum of ``count`` participants' uploads from the aggregate Flower's SecAgg+
    workflow hands its strategy for one upload, over ``nodes`` nodes each passed as
    :func:`node_vector`: Flower's dequantisation gives (2R − n·T)/n for the integer total R of
    the n nodes, which float64 holds to far better than half a unit, so R comes back exact and
    the sum is :meth:`Quantisation.dequantise`'s, bit for bit the engine's."""
    total = np.rint((aggregate * nodes + nodes * FLOWER_RANGE) / 2).astype(np.int64)
    return grid.dequantise(torch.from_numpy(total), count)


@contextmanager
def quiet_flower() -> Iterator[None]:
    """Flower's SecAgg+ workflow (server) and mod (node) log every stage at INFO and DEBUG (the
    workflow's "configure_fit: strategy sampled 3 clients (out of 0)" counts its shim's empty
    client manager): kept to warnings while dpfl drives them."""
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def reduction(problem: Problem, exchange: str) -> Reduction:
    """The reduction of ``exchange``'s uploads: :class:`SecureSum` under
    ``secure-aggregation``, else :class:`~dpfl.rounds.RowSum`."""
    if problem.config.secure.secure_aggregation:
        return SecureSum(quantisations(problem, exchange), problem.device)
    return RowSum(problem.device)
