"""The closed-form path of a linear model: per-sample and mean-loss gradients without autograd.

For ``o = aWᵀ + b`` and a loss whose output gradient ``δ_j = ∂loss_j/∂o_j`` has a closed form,
``∇W_j = δ_j a_jᵀ`` and ``∇b_j = δ_j``: the rows are products, which matters for the thousands
of tiny rounds of a logistic-regression sweep. A client's samples form one chunk (unless a byte
budget says otherwise), and the clipped sums are one matrix-vector product per chunk. A model
of several such blocks on disjoint input columns, outputs side by side (an audit's canary
model: :mod:`dpfl.audit.gradient_canary`), has each block's rows side by side.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from functools import partial

import torch
from torch import Tensor

from dpfl.models.flat import FlatParameters, LinearBlock
from dpfl.models.rows import Dropped, Layer, aligned, chunks, client_records, non_finite_rows
from dpfl.privacy.clipping import FLAT, ClippingFunction


class ClosedFormLinear:
    """The per-sample gradients of the linear model ``flat`` made of ``blocks`` (one for a
    plain linear model), in closed form; non-finite records are zeroed and counted in
    ``dropped``. Each block's trainable parameters sit in the flat vector in block order
    (:meth:`~dpfl.models.flat.FlatParameters.linear_blocks`)."""

    def __init__(self, flat: FlatParameters, blocks: list[LinearBlock],
                 dropped: Dropped) -> None:
        assert flat.loss.output_grad is not None, "a closed form needs the output gradient"
        self.flat = flat
        self.dropped = dropped
        layers = {id(layer.module): layer for layer in flat.layers}
        self.blocks = [(block.inputs, layers[id(block.layer)]) for block in blocks]
        order = [s for _, layer in self.blocks for s in layer.slices]
        assert [s.start for s in order] == [0, *(s.stop for s in order[:-1])] \
            and order[-1].stop == flat.d, "blocks must hold the flat vector in order"
        #: the layer of a one-block model (a plain linear model), else None
        self.layer = blocks[0].layer if len(blocks) == 1 else None
        self.widths = [block.layer.out_features for block in blocks]  # each block's outputs
        self.out_features = sum(self.widths)

    def _inputs(self, a: Tensor) -> list[Tensor]:
        """Each block's columns of the flattened inputs ``a``."""
        return [a if cols is None else a[:, cols] for cols, _ in self.blocks]

    def outputs(self, point: Tensor, x: Tensor) -> tuple[list[Tensor], Tensor]:
        """``(a, o)`` at ``point``: each block's flattened inputs ``a_k`` and the outputs
        ``o = [a_k W_kᵀ + b_k]_k`` side by side."""
        inputs = self._inputs(x.reshape(len(x), -1))
        outputs = [torch.nn.functional.linear(a, *layer.parts(point))
                   for a, (_, layer) in zip(inputs, self.blocks, strict=True)]
        return inputs, outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def _deltas(self, delta: Tensor) -> list[Tensor]:
        """Each block's columns of the output gradients ``δ`` ``[n, outputs]``."""
        return [delta] if len(self.blocks) == 1 else list(delta.split(self.widths, dim=1))

    def record(self, point: Tensor, x: Tensor, y: Tensor) -> list[tuple[Layer, Tensor, Tensor]]:
        """The tape :meth:`~dpfl.models.tape.TapeEngine.record` makes by autograd, in closed
        form: (layer, its flattened inputs ``a_k``, the per-sample output gradients ``δ_k``)
        per block."""
        inputs, outputs = self.outputs(point, x)
        deltas = self._deltas(self.flat.loss.output_grad(outputs, y).reshape(len(x), -1))
        return [(layer, a, delta)
                for a, delta, (_, layer) in zip(inputs, deltas, self.blocks, strict=True)]

    def per_sample(self, point: Tensor, x: Tensor, y: Tensor,
                   losses_out: Tensor | None = None) -> Tensor:
        """``[n, d]``: the per-sample loss gradients (without the regulariser), in the
        parameters' flat order (each block's weight row-major, then its bias); the per-sample
        losses go to ``losses_out`` if given."""
        loss = self.flat.loss
        inputs, outputs = self.outputs(point, x)
        n = len(x)
        if losses_out is not None:
            losses_out.copy_(loss.per_sample(outputs, y))
        deltas = self._deltas(loss.output_grad(outputs, y).reshape(n, -1))
        parts = []
        for a, delta, (_, layer) in zip(inputs, deltas, self.blocks, strict=True):
            weight, bias = layer.trainable
            if weight:
                parts.append((delta.unsqueeze(2) * a.unsqueeze(1)).reshape(n, -1))
            if bias:
                parts.append(delta)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def gradient(self, point: Tensor, x: Tensor, y: Tensor, out: Tensor,
                 losses_out: Tensor | None) -> None:
        """The mean-loss gradient into ``out``: with ``δ = ∂loss_j/∂o_j / n``, ``∇W_k = δ_kᵀa_k``,
        ``∇b_k = Σ_j δ_kj``, plus the regulariser's gradient."""
        loss = self.flat.loss
        inputs, outputs = self.outputs(point, x)
        if losses_out is not None:
            losses_out.copy_(loss.per_sample(outputs, y))
        deltas = self._deltas(loss.output_grad(outputs, y).reshape(len(x), -1) / len(x))
        for a, delta, (_, layer) in zip(inputs, deltas, self.blocks, strict=True):
            targets = iter(layer.parts(out))
            weight, bias = layer.trainable
            if weight:
                torch.mm(delta.t(), a, out=next(targets))
            if bias:
                torch.sum(delta, dim=0, out=next(targets))
        if self.flat.nonconvex_reg:
            out += self.flat.reg_grad(point)

    def rows(self, flat: Tensor, x: Tensor, y: Tensor, size: int,
             losses: Tensor | None = None) -> Iterator[tuple[int, int, Tensor]]:
        """``(client, start, [n, d])``: every sample's gradient, regulariser included, in
        chunks of ``size`` (a row may be inf or NaN); losses to ``losses [C, b]`` if given."""
        for c in range(x.shape[0]):
            point = self.flat.point(flat, c)
            reg = self.flat.reg_grad(point) if self.flat.nonconvex_reg else None
            for start, xs, ys in chunks(x[c], y[c], size):
                rows = self.per_sample(point, xs, ys, None if losses is None
                                       else losses[c, start:start + len(xs)])
                if reg is not None:
                    rows += reg
                yield c, start, rows

    def clipped_mean(self, flat: Tensor, x: Tensor, y: Tensor, radii: list[float], size: int,
                     out: Tensor, norms: Tensor, losses: Tensor | None,
                     offset: Tensor | None, *, lengths: Sequence[int] | None = None,
                     divisor: int, clipping: ClippingFunction = FLAT) -> None:
        """:meth:`~dpfl.models.FlatModel.clipped_mean` into ``out`` and ``norms``: the rows of
        a chunk (n·d memory) scaled by ``clipping``'s factors and summed by one matrix-vector
        product, the sum divided by ``divisor``; with ``lengths`` a ragged batch
        (:func:`~dpfl.models.rows.client_records`)."""
        for c, (records, labels) in enumerate(client_records(x, y, lengths)):
            point = self.flat.point(flat, c)
            reg = self.flat.reg_grad(point) if self.flat.nonconvex_reg else None
            if offset is not None:
                reg = aligned(offset[c]) if reg is None else reg + offset[c]
            row = out[c]
            for start, xs, ys in chunks(records, labels, size):
                n = len(xs)
                rows = self.per_sample(
                    point, xs, ys, None if losses is None else losses[c, start:start + n])
                if reg is not None:
                    rows += reg
                norms[c, start:start + n] = torch.linalg.vector_norm(rows, dim=1)
                if (bad := non_finite_rows(norms[c, start:start + n])) is not None:
                    self.dropped.drop(bad, rows, norms[c, start:start + n])
                w = clipping.factors(norms[c, start:start + n], radii[c]).div_(divisor)
                if start == 0:
                    torch.mv(rows.t(), w, out=row)
                else:
                    row.addmv_(rows.t(), w)

    def clipped_difference_mean(self, flat: Tensor, flat_before: Tensor, x: Tensor, y: Tensor,
                                size: int, out: Tensor, weights: partial, *,
                                lengths: Sequence[int] | None = None) -> None:
        """:meth:`~dpfl.models.FlatModel.clipped_difference_mean` into ``out``, from both
        points' rows of each chunk (``weights``: :func:`~dpfl.models.rows.difference_weights`
        with the clips and divisor bound); with ``lengths`` a ragged batch
        (:func:`~dpfl.models.rows.client_records`)."""
        for c, (records, labels) in enumerate(client_records(x, y, lengths)):
            point, before = self.flat.point(flat, c), self.flat.point(flat_before, c)
            reg = self.flat.reg_grad(point) if self.flat.nonconvex_reg else None
            reg_before = self.flat.reg_grad(before) if self.flat.nonconvex_reg else None
            row = out[c]
            for start, xs, ys in chunks(records, labels, size):
                rows = self.per_sample(point, xs, ys)
                rows_before = self.per_sample(before, xs, ys)
                if reg is not None and reg_before is not None:  # both or neither
                    rows += reg
                    rows_before += reg_before
                sq, sq_before = rows.square().sum(dim=1), rows_before.square().sum(dim=1)
                w, w_before = weights(sq, sq_before, (rows * rows_before).sum(dim=1))
                if (bad := non_finite_rows(sq, sq_before)) is not None:
                    self.dropped.drop(bad, rows, rows_before, w, w_before)
                if start == 0:
                    torch.mv(rows.t(), w, out=row)
                else:
                    row.addmv_(rows.t(), w)
                row.addmv_(rows_before.t(), w_before)

    def sample_bytes(self, x: Tensor) -> int:
        """Bytes one sample of ``x [C, b, ...]`` adds to a chunk: its row, its input, and the
        output and its gradient."""
        features = math.prod(x.shape[2:])
        return x.element_size() * (self.flat.d + features + 2 * self.out_features)
