"""The span of a few records' per-sample gradients, kept as their tapes: inner products with other
records' per-sample gradients, with a vector, and weighted sums, none of which forms the
``[m, d]`` gradient matrix.

For a ``Linear`` layer on ``[n, in]`` inputs a per-sample gradient is ``δ_i a_iᵀ`` (``δ_i``
the output gradient, ``a_i`` the input), so ``⟨δ_i a_iᵀ, δ_j a_jᵀ⟩ = (δ_i·δ_j)(a_i·a_j)``:
the inner products of two sets of records are ``(Δ_1Δ_2ᵀ)∘(A_1A_2ᵀ)`` (plus ``Δ_1Δ_2ᵀ`` for the
bias), ``m·n·(in + out)`` work instead of ``m·n·in·out`` on materialised gradients; a weighted
sum ``Σ_i w_i δ_i a_iᵀ`` is one GEMM ``(w∘Δ)ᵀA`` (the "ghost" identities of Li et al. 2022 and
Bu et al. 2023, applied across two sets of records). Conv and norm layers are materialised
per sample (small in the papers' models). The Gram matrix is computed in float64; the other
products in the dtype the caller names (a projection onto the span goes through ``Λ^{-1/2}``
of the Gram matrix, which amplifies their rounding by the condition number:
:mod:`dpfl.algorithms.projected` picks float64 where that matters)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dpfl.models import grad_sample
from dpfl.models.rows import Layer, chunks, non_finite_rows, zero_rows

if TYPE_CHECKING:
    from dpfl.models.functional import FlatModel


@dataclass(frozen=True)
class Factors:
    """One layer's per-sample gradients of ``n`` records, in float64: the input ``a`` and the
    output gradient ``delta`` of a layer with ghost products, else ``grads`` (its trainable
    parameters' materialised ``[n, numel]``, concatenated)."""

    layer: Layer
    a: Tensor | None = None
    delta: Tensor | None = None
    grads: Tensor | None = None

    def dots(self, other: Factors, inputs: Tensor | None = None) -> Tensor:
        """``[n_self, n_other]``: the inner products of the two sets' per-sample gradients of
        this layer; ``inputs``: their inputs' inner products ``a_self a_otherᵀ`` where already
        computed (:class:`Shifts`)."""
        if self.grads is not None and other.grads is not None:
            return self.grads @ other.grads.t()
        assert self.delta is not None and other.delta is not None
        deltas = self.delta @ other.delta.t()
        weight, bias = self.layer.trainable
        if not weight:
            return deltas
        assert self.a is not None and other.a is not None
        products = deltas * (self.a @ other.a.t() if inputs is None else inputs)
        return products + deltas if bias else products

    def sq_norms(self) -> Tensor:
        """``[n]``: the squared norms of this layer's per-sample gradients."""
        if self.grads is not None:
            return self.grads.square().sum(dim=1)
        assert self.a is not None and self.delta is not None
        return grad_sample.ghost_sq_norms(self.a, self.delta, self.layer.trainable)

    def dot_vector(self, parts: list[Tensor]) -> Tensor:
        """``[n]``: each per-sample gradient's inner product with a vector, given as its pieces
        for the layer's parameters (:meth:`Layer.parts`)."""
        if self.grads is not None:
            return self.grads @ torch.cat([p.reshape(-1) for p in parts])
        assert self.a is not None and self.delta is not None
        return grad_sample.ghost_dots(self.a, self.delta, self.layer.trainable, parts)

    def output_shift(self, c: Tensor, inputs: Tensor | None, n: int) -> Tensor:
        """``[n, out]`` (``c``'s dtype): how much less this ``Linear`` layer outputs on ``n``
        inputs h once its parameters are moved by −Σ_j c_j g_j (``c [m]``), given ``inputs``
        = hAᵀ (None for a layer without a trainable weight): the weight by −Δᵀdiag(c)A, so its
        outputs by ((hAᵀ)∘c)Δ, and the bias by −Δᵀc; m·n·(in + out) multiply-adds instead of
        the m·in·out of forming the moved weight."""
        assert self.delta is not None
        shift = c.expand(n, -1) if inputs is None else inputs * c
        out = shift @ self.delta
        return out + c @ self.delta if inputs is not None and self.layer.trainable[1] else out

    def add_weighted(self, w: Tensor, out: Tensor) -> None:
        """Write ``Σ_i w_i g_i`` (``w [n]``) into this layer's positions of ``out [d]``."""
        targets = self.layer.parts(out)
        if self.grads is not None:
            for target, part in zip(targets, (self.grads.t() @ w).split(
                    [t.numel() for t in targets])):
                target.copy_(part.view_as(target))
            return
        assert self.a is not None and self.delta is not None
        grad_sample.ghost_add_weighted_sum(self.a, self.delta, self.layer.trainable, w,
                                           targets, beta=0.0)


class Shifts:
    """A forward pass at a point moved within ``span`` by −Σ_j c_j g_j, taken at the point it
    was moved from (:meth:`GradientSpan.shifts`): :meth:`output` gives how much less a layer
    outputs on its inputs h, and keeps hAᵀ, the inputs' inner products with the span's, which
    the span's products with the pass's per-sample gradients need again
    (:meth:`GradientSpan.sample_dots`)."""

    def __init__(self, span: GradientSpan, c: Tensor, dtype: torch.dtype) -> None:
        self.span = span
        self.dtype = dtype
        self.factors = {id(f.layer): f for f in span.factors_in(dtype)}
        self.c = c.to(dtype)
        #: by layer, hAᵀ of the last pass's inputs (detached)
        self.inputs: dict[int, Tensor] = {}

    def output(self, layer: Layer, h: Tensor) -> Tensor | None:
        """``[n, out]`` (``h``'s dtype): how much less ``layer`` outputs on ``h`` at the moved
        point (computed in :attr:`dtype`: c carries Λ^{-1/2}, which amplifies rounding as it
        would a lift's), or None for a layer outside the span (its gradients are zero, so the
        move leaves it)."""
        f = self.factors.get(id(layer))
        if f is None:
            return None
        inputs = None
        if layer.trainable[0]:
            assert f.a is not None
            inputs = h.to(self.dtype) @ f.a.t()
            self.inputs[id(layer)] = inputs.detach()
        return f.output_shift(self.c, inputs, len(h)).to(h.dtype)


def layer_factors(model: FlatModel, point: Tensor, x: Tensor, y: Tensor,
                  dtype: torch.dtype | None = None, shifts: Shifts | None = None
                  ) -> list[Factors]:
    """Each trainable layer's factors of the per-sample gradients of the records ``x`` at
    ``point`` (one tape, in closed form for a linear model; a layer the forward pass does not
    use is absent: its gradients are zero), in ``dtype`` (default: the point's); with
    ``shifts``, at the point moved within a span (:meth:`GradientSpan.shifts`)."""
    dtype = dtype or point.dtype
    tape = (model.tapes.record(model.flat.params(point.detach()), x, y, shifts=shifts)
            if model.linear is None else model.linear.record(point.detach(), x, y))
    factors = []
    for layer, a, g in tape:
        if grad_sample.has_products(layer.module, a):
            factors.append(Factors(layer, a=a.to(dtype), delta=g.to(dtype)))
        else:
            grads = grad_sample.materialise(layer, a, g)
            factors.append(Factors(layer, grads=torch.cat(grads, dim=1).to(dtype)))
    return factors


class GradientSpan:
    """The per-sample gradients ``g_i + r`` (``r`` the nonconvex regulariser's gradient, if
    any) of the ``m`` records ``x [m, ...]``, ``y [m]`` at ``point [d]``, kept as their layers'
    factors. Its products run in the ``dtype`` each call names (the factors converted once per
    dtype). A record whose tape is not finite contributes the zero vector (its rows of the
    factors zeroed; these are public records, not a client's, so not counted as dropped)."""

    def __init__(self, model: FlatModel, point: Tensor, x: Tensor, y: Tensor) -> None:
        self.model = model
        self.m = len(y)
        self.device = point.device
        self.reg = self._reg(point)
        factors = layer_factors(model, point, x, y)
        if (bad := _non_finite(factors)) is not None:
            factors = [zeroed(f, bad) for f in factors]
        self.factors = {point.dtype: factors}

    def _reg(self, point: Tensor) -> Tensor | None:
        flat = self.model.flat
        return flat.reg_grad(point) if flat.nonconvex_reg else None

    def factors_in(self, dtype: torch.dtype) -> list[Factors]:
        """The span's factors in ``dtype``."""
        if dtype not in self.factors:
            native = next(iter(self.factors.values()))
            self.factors[dtype] = [Factors(f.layer, *(None if t is None else t.to(dtype)
                                                      for t in (f.a, f.delta, f.grads)))
                                   for f in native]
        return self.factors[dtype]

    def gram(self) -> Tensor:
        """``[m, m]`` (float64): ⟨g_i + r, g_j + r⟩."""
        factors = self.factors_in(torch.float64)
        gram = self._cross(factors, self.m, torch.float64)
        if self.reg is not None:
            reg = self.reg.double()
            own = _vector_dots(factors, reg, self.m)
            gram = gram + own[:, None] + own[None, :] + reg.square().sum()
        return gram

    def dot_vector(self, v: Tensor, dtype: torch.dtype) -> Tensor:
        """``[m]`` (``dtype``): ⟨g_i + r, v⟩ for ``v [d]``."""
        v = v.to(dtype)
        dots = _vector_dots(self.factors_in(dtype), v, self.m)
        return dots + torch.dot(self.reg.to(dtype), v) if self.reg is not None else dots

    @property
    def shiftable(self) -> bool:
        """Whether a point moved within the span can be taken as the point it was moved from
        and :meth:`shifts` of its layers' outputs: every layer of the span a ``Linear`` on
        ``[n, in]`` inputs (ghost factors), no regulariser (its gradient depends on the moved
        point) and no closed-form linear model."""
        return (self.model.linear is None and self.reg is None
                and all(f.grads is None for f in next(iter(self.factors.values()))))

    def shifts(self, c: Tensor, dtype: torch.dtype) -> Shifts:
        """The forward pass at ``point − Σ_i c_i (g_i + r)`` (``c [m]``) taken at ``point``:
        each layer's output less its :meth:`Factors.output_shift`, computed in ``dtype`` (the
        products' of a projection) and subtracted in the output's. Needs :attr:`shiftable`."""
        return Shifts(self, c, dtype)

    def combine(self, w: Tensor, dtype: torch.dtype) -> Tensor:
        """``[d]`` (``dtype``): Σ_i w_i (g_i + r) for ``w [m]``."""
        w = w.to(dtype)
        out = w.new_empty(self.model.d)  # every layer's positions written once, below
        factors = self.factors_in(dtype)
        for f in factors:
            f.add_weighted(w, out)
        for layer in set(self.model.flat.layers) - {f.layer for f in factors}:  # unused: zero
            for where in layer.slices:
                out[where] = 0
        if self.reg is not None:
            out += w.sum() * self.reg.to(dtype)
        return out

    def sample_dots(self, point: Tensor, x: Tensor, y: Tensor, dtype: torch.dtype, *,
                    norms: bool = False, shifts: Shifts | None = None
                    ) -> Iterator[tuple[Tensor, Tensor | None]]:
        """``([n, m], [n] or None)`` (``dtype``), chunk by chunk (the model's chunks):
        ⟨h_j + r', g_i + r⟩ for the per-sample gradients ``h_j + r'`` of the records
        ``x [b, ...]``, ``y [b]`` at ``point [d]`` (moved by ``shifts``, a span's
        :meth:`shifts`, where given), and with ``norms`` their squared norms ‖h_j + r'‖², no
        gradient materialised where a layer has ghost products. A record whose gradient is not
        finite gets zero rows, dropped and counted as in
        :meth:`~dpfl.models.FlatModel.per_sample_gradient_chunks`."""
        model = self.model
        size = model.chunk_length(point, x[None], y[None], rows=False)
        reg = self._reg(point)
        towards_reg = None if reg is None else self.dot_vector(reg, dtype)
        own_reg = None if self.reg is None else self.reg.to(dtype)
        # a pass moved within this span computed its inputs' products with the span's
        known = shifts.inputs if shifts is not None and shifts.span is self \
            and shifts.dtype == dtype else {}
        for _, xs, ys in chunks(x, y, size):
            factors = layer_factors(model, point, xs, ys, dtype, shifts)
            dots = self._cross(factors, len(ys), dtype, known)
            if own_reg is not None:
                dots = dots + _vector_dots(factors, own_reg, len(ys))[:, None]
            if towards_reg is not None:
                dots = dots + towards_reg[None, :]
            sq = _sq_norms(factors, reg, dots.new_zeros(len(ys))) if norms else None
            rows = (dots,) if sq is None else (dots, sq)
            if (bad := non_finite_rows(*rows)) is not None:
                model.dropped.drop(bad, *rows)
            yield dots, sq

    def _cross(self, factors: list[Factors], n: int, dtype: torch.dtype,
               known: dict[int, Tensor] | None = None) -> Tensor:
        """``[n, m]``: the inner products of ``factors``' ``n`` records' gradients with the
        span's, summed over the layers (a layer absent from a tape has zero gradients);
        ``known``: by layer, their inputs' products with the span's, where a moved pass
        computed them (:class:`Shifts`)."""
        mine = {id(f.layer): f for f in self.factors_in(dtype)}
        known = known or {}
        total = torch.zeros(n, self.m, dtype=dtype, device=self.device)
        for f in factors:
            if (g := mine.get(id(f.layer))) is not None:
                total += f.dots(g, known.get(id(f.layer)))
        return total


def _vector_dots(factors: list[Factors], v: Tensor, n: int) -> Tensor:
    """``[n]``: the inner products of ``factors``' ``n`` per-sample gradients with ``v [d]``."""
    total = v.new_zeros(n)
    for f in factors:
        total += f.dot_vector(f.layer.parts(v))
    return total


def _sq_norms(factors: list[Factors], reg: Tensor | None, zeros: Tensor) -> Tensor:
    """``[n]`` (``zeros``' dtype): ‖h_j + r'‖² of ``factors``' per-sample gradients h_j plus
    ``reg`` (r'), added to ``zeros [n]``."""
    sq = sum((f.sq_norms() for f in factors), zeros)
    if reg is None:
        return sq
    at = reg.to(zeros.dtype)
    return sq + 2 * _vector_dots(factors, at, len(zeros)) + at.square().sum()


def _non_finite(factors: list[Factors]) -> Tensor | None:
    """``[n]``: the records whose factors hold inf or NaN, or None."""
    tensors = [t for f in factors for t in (f.a, f.delta, f.grads) if t is not None]
    return non_finite_rows(*tensors) if tensors else None


def zeroed(f: Factors, bad: Tensor) -> Factors:
    """``f`` with the records ``bad`` ``[n]`` zeroed, out of place."""
    return Factors(f.layer, *(None if t is None else zero_rows(t, bad)
                              for t in (f.a, f.delta, f.grads)))
