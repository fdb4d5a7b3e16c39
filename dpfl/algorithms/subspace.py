"""Subspaces of R^d with an orthonormal coordinate system: what a projected DP-SGD step (PCDP-SGD
and its baselines, :mod:`dpfl.algorithms.projected`) clips, noises and lifts back in."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from torch import Tensor


class Subspace(ABC):
    """A subspace of R^d with an orthonormal coordinate system."""

    @abstractmethod
    def coords(self, g: Tensor) -> Tensor:
        """``[..., d]`` → ``[..., k]``: Vᵀg."""

    @abstractmethod
    def lift(self, a: Tensor) -> Tensor:
        """``[..., k]`` → ``[..., d]``: Va."""


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
