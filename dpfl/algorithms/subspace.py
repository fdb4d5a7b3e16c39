"""Subspaces of R^d with an orthonormal coordinate system: what a projected DP-SGD step (PCDP-SGD
and its baselines, :mod:`dpfl.algorithms.projected`) clips, noises and lifts back in."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dpfl.models.span import GradientSpan, Shifts

if TYPE_CHECKING:
    from dpfl.models import FlatModel


class Subspace(ABC):
    """A subspace of R^d with an orthonormal coordinate system."""

    @abstractmethod
    def coords(self, g: Tensor) -> Tensor:
        """``[..., d]`` → ``[..., k]``: Vᵀg."""

    @abstractmethod
    def lift(self, a: Tensor) -> Tensor:
        """``[..., k]`` → ``[..., d]``: Va."""

    def lift_into(self, a: Tensor, out: Tensor) -> None:
        """Write Va (``a [k]``) into ``out [d]``, in ``out``'s dtype."""
        out.copy_(self.lift(a))

    def sample_coords(self, model: FlatModel, point: Tensor, x: Tensor,
                      y: Tensor) -> Iterator[Tensor]:
        """``[n, k]``, chunk by chunk: Vᵀ∇ℓ(point, x_j) for the records ``x [b, ...]``, ``y
        [b]``, from the materialised per-sample gradients (a record whose gradient is not
        finite gets a zero row: :meth:`~dpfl.models.FlatModel.per_sample_gradient_chunks`)."""
        for _, _, rows in model.per_sample_gradient_chunks(point[None], x[None], y[None]):
            yield self.coords(rows)


@dataclass
class Basis(Subspace):
    """The span of the orthonormal columns of ``v`` (``[d, k]``; zero columns allowed)."""

    v: Tensor

    def coords(self, g: Tensor) -> Tensor:
        return g @ self.v

    def lift(self, a: Tensor) -> Tensor:
        return a @ self.v.t()


@dataclass
class Coordinates(Subspace):
    """The span of the unit vectors of the coordinates ``kept`` (a sparsification mask)."""

    kept: Tensor
    d: int

    def coords(self, g: Tensor) -> Tensor:
        return g[..., self.kept]

    def lift(self, a: Tensor) -> Tensor:
        out = a.new_zeros(*a.shape[:-1], self.d)
        out[..., self.kept] = a
        return out


@dataclass
class GradientBasis(Subspace):
    """The span of the columns of V = GᵀR, G the ``[m, d]`` per-sample gradients a
    :class:`~dpfl.models.span.GradientSpan` holds and ``r`` ``[m, k]`` (float64) chosen so
    that V is orthonormal (zero columns allowed), without ever forming V or G: Vᵀg = Rᵀ(Gg),
    Va = Gᵀ(Ra), and a record's coordinates Rᵀ(Gh_j) from the inner products of its tape with
    the span's (:meth:`GradientSpan.sample_dots`). The inner products with G and the weighted
    sums of G run in ``dtype`` (R is applied in float64); results come back in the argument's
    dtype."""

    span: GradientSpan
    r: Tensor
    dtype: torch.dtype = torch.float64

    def coords(self, g: Tensor) -> Tensor:
        rows = g.reshape(-1, g.shape[-1])
        dots = torch.stack([self.span.dot_vector(row, self.dtype) for row in rows])
        out = dots.double() @ self.r
        return out.reshape(*g.shape[:-1], self.r.shape[1]).to(g.dtype)

    def lift(self, a: Tensor) -> Tensor:
        return lift_rows(self, a, self.span.model.d)

    def weights(self, a: Tensor) -> Tensor:
        """``[m]`` (float64): the weights w = Ra (``a [k]``: one vector, as a one-row product,
        so that a client's weights do not depend on how many others share its call) of the
        span's gradients whose sum is Va."""
        (w,) = a.reshape(1, -1).double() @ self.r.t()
        return w

    def lift_into(self, a: Tensor, out: Tensor) -> None:
        """Va: the weights w = Ra (float64), then Σ_i w_i g_i in the products' dtype, copied
        into ``out``. Not summed in place: a GEMM writing into a row of a stacked tensor may
        round by where the row lies in memory (seen on an AMD EPYC), and the engine's rows of
        many clients must equal a node's one client bit for bit."""
        out.copy_(self.span.combine(self.weights(a), self.dtype))

    def sample_coords(self, model: FlatModel, point: Tensor, x: Tensor, y: Tensor,
                      shifts: Shifts | None = None) -> Iterator[Tensor]:
        """As :meth:`Subspace.sample_coords`, from the tapes; ``shifts``: at ``point`` moved
        within the span (:meth:`~dpfl.models.span.GradientSpan.shifts`)."""
        for dots, _ in self.span.sample_dots(point, x, y, self.dtype, shifts=shifts):
            yield self.coords_of(dots, point.dtype)

    def sample_coords_and_norms(self, point: Tensor, x: Tensor, y: Tensor,
                                shifts: Shifts | None = None
                                ) -> Iterator[tuple[Tensor, Tensor]]:
        """``([n, k], [n])``, chunk by chunk: each record's coordinates Vᵀ∇ℓ(point, x_j) and
        its whole gradient's norm ‖∇ℓ(point, x_j)‖ (what clipping before the projection clips
        by), from the same tapes, in ``point``'s dtype (a record whose gradient is not finite:
        zeros, dropped and counted); ``shifts``: at ``point`` moved within the span
        (:meth:`~dpfl.models.span.GradientSpan.shifts`)."""
        for dots, sq in self.span.sample_dots(point, x, y, self.dtype, norms=True,
                                              shifts=shifts):
            assert sq is not None
            yield self.coords_of(dots, point.dtype), sq.clamp_min(0).sqrt().to(point.dtype)

    def coords_of(self, dots: Tensor, dtype: torch.dtype) -> Tensor:
        """``[n, k]`` (``dtype``): Rᵀ(Gh_j) from the inner products ``dots [n, m]`` of records'
        gradients with the span's."""
        return (dots.double() @ self.r).to(dtype)


def lift_rows(space: Subspace, a: Tensor, d: int) -> Tensor:
    """``[..., k]`` → ``[..., d]``: Va row by row through ``space.lift_into``, for a subspace
    whose lift is built for one vector at a time."""
    rows = a.reshape(-1, a.shape[-1])
    out = rows.new_empty(len(rows), d)
    for row, target in zip(rows, out, strict=True):
        space.lift_into(row, target)
    return out.reshape(*a.shape[:-1], d)
