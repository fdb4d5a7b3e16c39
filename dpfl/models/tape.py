"""The per-sample gradient engine: per-sample gradients from the tapes of one forward and one
backward pass (:mod:`dpfl.models.functional` explains the method), clipped and summed without
forming the ``[b, d]`` matrix where a layer has ghost norms."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from dpfl.models import grad_sample, stacked
from dpfl.models.calls import Outputs, rows_of
from dpfl.models.calls import zeroed as zeroed_rows
from dpfl.models.flat import FlatParameters
from dpfl.models.grad_samplers import fallback
from dpfl.models.rows import (
    Chunk,
    Dropped,
    InputSquares,
    Layer,
    aligned,
    aligned_rows,
    batch_shape,
    chunks,
    client_records,
    non_finite_rows,
    same_bits,
    value_like,
    sample_radii,
    zero_rows,
)
from dpfl.privacy.clipping import FLAT, ClippingFunction



class Shifts(Protocol):
    """A forward pass at a point moved within a gradient span
    (:class:`dpfl.models.span.Shifts`): how much less each layer outputs on its inputs."""

    def output(self, layer: Layer, h: Tensor) -> Tensor | None: ...

#: one chunk's record: (layer, its input a, its output gradient δ) per trainable layer (a
#: whole-module layer's: its call and its outputs' gradients, :class:`~dpfl.models.calls.Batched`)
Tape = list[tuple[Layer, Any, Any]]
#: each layer's materialised per-sample gradients, None for a layer with ghost norms
Materialised = list[list[Tensor] | None]


class TapeEngine:
    """Per-sample gradients of ``flat``'s module by tapes: forward hooks on its trainable
    layers record each layer's input while :meth:`record` runs; non-finite records are zeroed
    and counted in ``dropped``. With ``joint``, a group's clients at one point share one tape
    where their layout was checked to give the same numbers (:meth:`by_layout`)."""

    def __init__(self, flat: FlatParameters, dropped: Dropped, *, joint: bool = True) -> None:
        self.flat = flat
        self.dropped = dropped
        self.tape: Tape | None = None
        #: while a tape is recorded at a point moved within a span: each layer's output shift
        #: (:meth:`~dpfl.models.span.GradientSpan.shifts`)
        self.shifts: Shifts | None = None
        #: by a group's layout (:func:`layout`): whether one tape over its samples gave, split by
        #: chunk, the same clipped means, norms and losses bit for bit as a tape per chunk; None
        #: without ``joint``: every chunk's tape its own, no layout checked
        self.joint: dict[tuple, bool] | None = {} if joint else None
        #: the module as a sequence of (module, its Layer or None, the positions of its weight
        #: and bias among the parameters), where clients at points of their own may share a
        #: pass (:meth:`record_stacked`); None for any other model
        self.sequence = stacked.sequence(flat) if joint else None
        self.samples = 0  # in the pass being recorded
        for layer in flat.layers:
            layer.module.register_forward_hook(partial(self.capture, layer), with_kwargs=True)

    def capture(self, layer: Layer, module: nn.Module, inputs: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any) -> Any:
        """Forward hook: put the layer's call on the tape (:func:`entry`) while one is recorded."""
        tape = self.tape
        if tape is None:
            return None
        if any(entry[0] is layer for entry in tape):
            name = type(module).__name__
            raise RuntimeError(f"per-sample gradients: {name} is called twice in one forward")
        a, output, tracked = entry(layer, inputs, kwargs, output, self.samples)
        tape.append((layer, a, tracked))
        if self.shifts is not None and (shift := self.shifts.output(layer, inputs[0])) is not None:
            # the moved layer's output; its gradient is the recorded output's
            return output - shift
        return output

    def record(self, params: list[Tensor], x: Tensor, y: Tensor,
               losses_out: Tensor | None = None, *, shifts: Shifts | None = None) -> Tape:
        """One forward and backward pass at ``params`` (views of a detached point): (layer,
        input, output gradient) per trainable layer; per-sample losses to ``losses_out``. With
        ``shifts``, at the point moved within a span: each layer's output less its shift (its
        gradient is the recorded output's, as the two differ by a function of the input)."""
        self.tape, self.shifts, self.samples = [], shifts, len(x)
        try:
            with torch.enable_grad():
                losses = self.flat.loss.per_sample(self.flat.forward_with(params, x), y)
            tape = self.tape
        finally:
            self.tape, self.shifts = None, None
        return output_gradients(tape, losses, losses_out)

    def rows(self, flat: Tensor, x: Tensor, y: Tensor, size: int,
             losses: Tensor | None = None) -> Iterator[tuple[int, int, Tensor]]:
        """``(client, start, [n, d])``: every sample's gradient, regulariser included, in
        fresh memory, in chunks of ``size`` (a row may be inf or NaN); losses to ``losses``."""
        for c in range(x.shape[0]):
            point = self.flat.point(flat, c)
            params = self.flat.params(point.detach())
            reg = self.flat.reg_grad(point) if self.flat.nonconvex_reg else None
            for start, xs, ys in chunks(x[c], y[c], size):
                losses_out = None if losses is None else losses[c, start:start + len(xs)]
                rows = value_like(xs, point).new_zeros(len(xs), self.flat.d)
                for layer, a, g in self.record(params, xs, ys, losses_out):
                    grads = grad_sample.materialise(layer, a, g)
                    for p, where in zip(grads, layer.slices):
                        rows[:, where] = p
                if reg is not None:
                    rows += reg
                yield c, start, rows

    def clipped_mean(self, flat: Tensor, x: Tensor, y: Tensor, radii: list[float], size: int,
                     out: Tensor, norms: Tensor, losses: Tensor | None, offset: Tensor | None,
                     *, group_size: int | None = None, lengths: Sequence[int] | None = None,
                     divisor: int, clipping: ClippingFunction = FLAT) -> None:
        """:meth:`~dpfl.models.FlatModel.clipped_mean` into ``out`` and ``norms``, group by
        group of at most ``group_size`` samples (:meth:`groups`; :meth:`clip_group`)."""
        results = {"out": out, "norms": norms} | ({} if losses is None else {"losses": losses})
        b = batch_shape(x, lengths)[1]  # a whole batch's length, for the layout
        for group in self.groups(flat, x, y, size, group_size=group_size, offset=offset,
                                 lengths=lengths):
            own = [radii[chunk.client] for chunk in group]
            self.by_layout(("mean", *results), group, b,
                           partial(self.clip_group, clipping, own, divisor), results)

    def clip_group(self, clipping: ClippingFunction, radii: list[float], b: int,
                   group: list[Chunk], into: dict[str, Tensor], joint: bool) -> None:
        """One group's share of :meth:`clipped_mean` (``radii``: its chunks'; ``b``: the
        divisor): pass 1 records the tapes and norms (:meth:`tapes_and_norms`), pass 2 adds
        each chunk's weighted sums, ``clipping``'s factors, into ``into`` at its row."""
        out, norms = into["out"], into["norms"]
        tapes, norm = self.tapes_and_norms(group, into.get("losses"), joint)
        w = clipping.factors(norm, sample_radii(radii, group)).div_(b)  # flat: 1/b if ‖g_j‖ ≤ C
        if (bad := non_finite_rows(norm)) is not None:  # weight 0 (the regulariser's share
            self.dropped.drop(bad, norm, w)  # too), norm reported 0, and no NaN in the GEMMs
            tapes = [zeroed(chunk.of(bad), *pair) for chunk, pair in zip(group, tapes)]
        for chunk, (tape, materialised) in zip(group, tapes):  # pass 2: the weighted sums
            norms[chunk.client, chunk.start:chunk.start + chunk.n] = chunk.of(norm)
            self.add_weighted(tape, materialised, chunk.reg, aligned(chunk.of(w)),
                              out[chunk.client], first=chunk.start == 0)
        del tapes, tape, materialised  # no tape lives into the next group's passes

    def tapes_and_norms(self, group: list[Chunk], losses: Tensor | None, joint: bool
                        ) -> tuple[list[tuple[Tape, Materialised]], Tensor]:
        """Pass 1 of :meth:`clip_group`: each chunk's tape (one per chunk, or with ``joint`` one
        for the group: :meth:`joint_tapes`) and its materialised gradients, and the group's
        per-sample norms ‖g_j + reg‖ ``[n]`` (inf or NaN where not finite); the per-sample
        losses go to ``losses`` if given."""
        sq = group[0].values.new_zeros(sum(chunk.n for chunk in group))
        recorded = (tape for tape, in self.joint_tapes(group, losses, "params")) \
            if joint else (self.record(chunk.params, chunk.x, chunk.y, chunk_losses(losses, chunk))
                           for chunk in group)
        tapes = [(tape, squares(tape, chunk.reg, chunk.of(sq))[1])
                 for chunk, tape in zip(group, recorded)]
        return tapes, sq.clamp_min_(0).sqrt_()

    def norms(self, flat: Tensor, x: Tensor, y: Tensor, size: int, out: Tensor, *,
              group_size: int | None = None, lengths: Sequence[int] | None = None) -> None:
        """:meth:`~dpfl.models.FlatModel.per_sample_norms` into ``out [C, b]``: pass 1 of
        :meth:`clip_group` alone, group by group (:meth:`groups`; :meth:`norm_group`)."""
        b = batch_shape(x, lengths)[1]
        for group in self.groups(flat, x, y, size, group_size=group_size, lengths=lengths):
            self.by_layout(("norms",), group, b, self.norm_group, {"norms": out})

    def norm_group(self, group: list[Chunk], into: dict[str, Tensor], joint: bool) -> None:
        """One group's share of :meth:`norms` (a norm not finite: 0, dropped, as there)."""
        norm = self.tapes_and_norms(group, None, joint)[1]
        if (bad := non_finite_rows(norm)) is not None:
            self.dropped.drop(bad, norm)
        for chunk in group:
            into["norms"][chunk.client, chunk.start:chunk.start + chunk.n] = chunk.of(norm)

    def clipped_difference_mean(self, flat: Tensor, flat_before: Tensor, x: Tensor, y: Tensor,
                                size: int, out: Tensor, weights: partial, *,
                                group_size: int | None = None,
                                lengths: Sequence[int] | None = None) -> None:
        """:meth:`~dpfl.models.FlatModel.clipped_difference_mean` into ``out``, group by group
        of at most ``group_size`` samples (:meth:`groups`; :meth:`clip_difference_group`;
        ``weights``: :func:`~dpfl.models.rows.difference_weights` with the clips bound)."""
        b = batch_shape(x, lengths)[1]
        for group in self.groups(flat, x, y, size, group_size=group_size, before=flat_before,
                                 lengths=lengths):
            self.by_layout(("difference",), group, b,
                           partial(self.clip_difference_group, weights), {"out": out})

    def clip_difference_group(self, weights: partial, group: list[Chunk],
                              into: dict[str, Tensor], joint: bool) -> None:
        """One group's share of :meth:`clipped_difference_mean`: pass 1 records both points'
        tapes of each chunk (or with ``joint`` each point's one for the group) and the squared
        norms and cross terms, pass 2 adds the weighted sums into ``into``'s ``out``."""
        out = into["out"]
        sq, sq_before, dots = group[0].values.new_zeros(3, sum(chunk.n for chunk in group))
        tapes = []
        recorded = self.joint_tapes(group, None, "params", "params_before") \
            if joint else ((self.record(chunk.params, chunk.x, chunk.y),
                            self.record(chunk.params_before, chunk.x, chunk.y)) for chunk in group)
        for chunk, (tape, tape_before) in zip(group, recorded):  # pass 1: both tapes, the
            inputs = InputSquares()  # squared norms and the cross terms
            grads = squares(tape, chunk.reg, chunk.of(sq), inputs)[1]
            grads_before = squares(tape_before, chunk.reg_before, chunk.of(sq_before),
                                        inputs)[1]
            pair_dots(tape, grads, chunk.reg, tape_before, grads_before, chunk.reg_before,
                      chunk.of(dots), inputs)
            tapes.append((tape, grads, tape_before, grads_before))
        w, w_before = weights(sq, sq_before, dots)
        if (bad := non_finite_rows(sq, sq_before)) is not None:
            self.dropped.drop(bad, w, w_before)
            tapes = [(*zeroed(chunk.of(bad), *pair[:2]), *zeroed(chunk.of(bad), *pair[2:]))
                     for chunk, pair in zip(group, tapes)]
        for chunk, (tape, grads, tape_before, grads_before) in zip(group, tapes):  # pass 2
            row = out[chunk.client]
            self.add_weighted(tape, grads, chunk.reg, aligned(chunk.of(w)), row,
                              first=chunk.start == 0)
            self.add_weighted(tape_before, grads_before, chunk.reg_before,
                              aligned(chunk.of(w_before)), row, first=False)
        del tapes, recorded, tape, grads, tape_before, grads_before  # as in clip_group

    def by_layout(self, kind: tuple[str, ...], group: list[Chunk], b: int, clip: Callable,
                  results: dict[str, Tensor]) -> None:
        """``clip(group, results, joint)``, jointly where :attr:`joint` holds that it is the
        same for the group's layout (``kind`` names the method and what it returns); the first
        group of a layout is computed chunk by chunk and then checked (:meth:`same_jointly`)."""
        key = layout(group, b, kind, self.sequence is not None) if self.joint is not None \
            else None
        clip(group, results, key is not None and self.joint.get(key, False))
        if key is not None and key not in self.joint:
            self.joint[key] = self.same_jointly(group, clip, results)

    def joint_tapes(self, group: list[Chunk], losses: Tensor | None, *points: str
                    ) -> list[tuple[Tape, ...]]:
        """Each chunk's tapes at ``points`` (names of :class:`Chunk`'s parameters: one list the
        group's chunks share, or each client's own, rows of one tensor, for a model of
        :meth:`record_stacked`; the chunks share one size: :func:`layout`), taken from one
        forward and backward pass over the group's samples at each point: every layer's input
        and output gradient split along the samples. Per-sample losses at the first point go to
        ``losses``."""
        n = group[0].n
        xs, ys = joined([chunk.x for chunk in group]), joined([chunk.y for chunk in group])
        joint_losses = None if losses is None else value_like(xs, losses).new_empty(len(ys))
        tapes = []
        for i, name in enumerate(points):
            lists = [getattr(chunk, name) for chunk in group]
            out = joint_losses if i == 0 else None
            tapes.append(self.record(lists[0], xs, ys, out) if shared(lists)
                         else self.record_stacked(stacked.views(lists), xs, ys, out))
        if joint_losses is not None:  # whole batches of consecutive clients: whole rows
            first = group[0].client
            losses[first:first + len(group)].copy_(joint_losses.view(len(group), n))
        return [tuple([(layer, rows_of(a, i * n, (i + 1) * n), rows_of(g, i * n, (i + 1) * n))
                       for layer, a, g in tape]
                      for tape in tapes) for i in range(len(group))]

    def record_stacked(self, params: list[Tensor], x: Tensor, y: Tensor,
                       losses_out: Tensor | None = None) -> Tape:
        """:meth:`record` for clients at points of their own, each with ``len(x) / G`` of the
        samples: one pass of :func:`dpfl.models.stacked.forward` over this engine's
        :attr:`sequence`, ``params`` each parameter's ``[G, *shape]`` view."""
        assert self.sequence is not None
        return output_gradients(*stacked.forward(self.flat, self.sequence, params, x, y),
                                losses_out)

    def same_jointly(self, group: list[Chunk], clip: Callable, results: dict[str, Tensor]
                     ) -> bool:
        """Whether ``clip`` with one tape for ``group`` gives what it gave ``results`` with a
        tape per chunk, bit for bit (a Flower node computes a lone client by chunks, and the
        engine must equal it): the group is computed again jointly, into rows of its own laid
        out as the caller's, and compared (one layout, one verdict: :func:`layout`)."""
        clients = [chunk.client for chunk in group]
        own = {name: aligned_rows(v, len(group), v.shape[1]) for name, v in results.items()}
        counted = self.dropped.count
        try:
            clip(replace_clients(group), own, True)
        finally:
            self.dropped.count = counted  # the same records, counted once
        return all(torch.equal(own[name], v[clients]) for name, v in results.items())

    def add_weighted(self, tape: Tape, materialised: Materialised, reg: Tensor | None,
                     w: Tensor, row: Tensor, first: bool) -> None:
        """``row`` (overwritten if ``first``) plus Σ_j w_j (g_j + reg) over one chunk: one
        weighted GEMM per layer."""
        beta = 0.0 if first else 1.0
        for (layer, a, g), grads in zip(tape, materialised):
            targets = [row[s].view(shape) for s, shape in zip(layer.slices, layer.shapes)]
            if grads is None:
                grad_sample.ghost_add_weighted_sum(a, g, layer.trainable, w, targets, beta)
            else:
                for target, p in zip(targets, grads):
                    target.view(-1).addmv_(p.t(), w, beta=beta)
        if first:
            for layer in set(self.flat.layers) - {layer for layer, _, _ in tape}:  # unused
                for where in layer.slices:
                    row[where] = 0
        if reg is not None:
            row.add_(reg, alpha=w.sum().item())

    def groups(self, flat: Tensor, x: Tensor, y: Tensor, size: int, *,
               group_size: int | None = None, offset: Tensor | None = None,
               before: Tensor | None = None, lengths: Sequence[int] | None = None
               ) -> Iterator[list[Chunk]]:
        """Every client's chunks of at most ``size`` samples, client by client, gathered into
        groups of consecutive chunks of at most ``group_size`` samples in all (default
        ``size``; :meth:`~dpfl.models.FlatModel.group_length`): a group's per-sample values are
        held at once, and its per-sample scalar arithmetic (norms, clip factors) is one pass for
        the group instead of one per client. That arithmetic is elementwise and correctly
        rounded, so no value depends on the grouping. ``offset [C, d]`` is added to client c's
        per-sample gradients (with the regulariser's); ``before``: a second point each chunk is
        also taken at; ``lengths``: a ragged batch (:func:`~dpfl.models.rows.client_records`).
        Consecutive clients at points of the same bits (a round's first local step) share one
        list of parameters, so that a group of them may be taken jointly (:func:`layout`)."""
        group: list[Chunk] = []
        held, most = 0, group_size or size
        points: dict[str, tuple[Tensor, list[Tensor], Tensor | None]] = {}
        for c, (records, labels) in enumerate(client_records(x, y, lengths)):
            for name, where in (("now", flat), ("before", before)):
                if where is not None and (where.dim() > 1 or name not in points):
                    point = self.flat.point(where, c)
                    if self.joint is not None and name in points \
                            and same_bits(point, points[name][0]):
                        continue  # the client before it is at this point: its parameters
                    reg = self.flat.reg_grad(point) if self.flat.nonconvex_reg else None
                    points[name] = (point, self.flat.params(point.detach()), reg)
            _, params, reg = points["now"]
            if offset is not None:
                reg = aligned(offset[c]) if reg is None else reg + offset[c]
            _, params_before, reg_before = points.get("before", (None, None, None))
            for start, xs, ys in chunks(records, labels, size):
                if group and held + len(xs) > most:
                    yield group
                    group, held = [], 0
                group.append(Chunk(c, start, len(xs), held, xs, ys, params, reg,
                                   params_before, reg_before))
                held += len(xs)
        if group:
            yield group

    def sample_bytes(self, flat: Tensor, x: Tensor, y: Tensor, *, rows: bool) -> int:
        """Bytes of per-sample values one sample of ``x [C, b, ...]`` adds to a chunk, counted
        by one pass on one sample: the distinct tensors autograd saves with a leading axis of 1
        (the parameters' views are not), the layers' output gradients, and the per-sample
        gradients materialised — every layer's that has no ghost norm, or the whole ``d`` when
        ``rows``."""
        saved: dict[int, int] = {}

        def pack(t: Tensor) -> Tensor:
            if t.dim() and t.shape[0] == 1:
                saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), t.nbytes)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            tape = self.record(self.flat.params(self.flat.point(flat, 0).detach()),
                               aligned(x[0, :1]), aligned(y[0, :1]))
        count = self.flat.d if rows else sum(
            sum(s.numel() for s in layer.shapes)
            for layer, a, _ in tape if not grad_sample.has_ghost(layer.module, a))
        values = sum(saved.values()) + sum(g.nbytes for _, _, g in tape)
        return values + value_like(x, flat).element_size() * count


def entry(layer: Layer, inputs: tuple[Any, ...], kwargs: dict[str, Any], output: Any, n: int
          ) -> tuple[Any, Any, Tensor | Outputs]:
    """What the tape keeps of a layer's call on ``n`` samples: (its input, the output to hand
    on, what to differentiate). A rule reads its input's samples on the first axis; a layer
    of a whole-module rule keeps its whole call
    (:func:`~dpfl.models.grad_samplers.fallback.record`)."""
    if layer.rule.whole:
        return fallback.record(layer, inputs, kwargs, output, n)
    if len(inputs[0]) != n:
        raise ValueError(f"per-sample gradients: {type(layer.module).__name__} is called on "
                         f"{len(inputs[0])} rows, not the batch's {n} samples")
    if not output.requires_grad:
        # Nothing below this layer is trainable: start the graph here.
        output = output.detach().requires_grad_()
    return inputs[0].detach(), output, output


def output_gradients(tape: list[tuple[Layer, Any, Tensor | Outputs]], losses: Tensor,
                     losses_out: Tensor | None) -> Tape:
    """A recorded forward pass's tape: (layer, input, output) per trainable layer becomes
    (layer, input, the output's gradient of the summed per-sample ``losses``; zero for an
    output the losses do not use; a whole-module layer's tracked outputs' gradients, samples
    leading); the losses are copied into ``losses_out`` when given."""
    if losses_out is not None:
        losses_out.copy_(losses.detach())
    if not tape:
        return []
    outs = [out.tensors if isinstance(out, Outputs) else (out,) for _, _, out in tape]
    grads = iter(torch.autograd.grad(losses.sum(), [t for ts in outs for t in ts],
                                     allow_unused=True))
    recorded: Tape = []
    for (layer, a, out), ts in zip(tape, outs):
        mine = [next(grads) for _ in ts]
        g = out.gradients(mine) if isinstance(out, Outputs) else \
            torch.zeros_like(out) if mine[0] is None else mine[0]
        recorded.append((layer, a, g))
    return recorded


def zeroed(bad: Tensor, tape: Tape, materialised: Materialised) -> tuple[Tape, Materialised]:
    """A chunk's tape and materialised per-sample gradients with the samples ``bad`` zeroed,
    out of place (the first input is a view of the client's data): a weight of 0 does not
    remove a NaN from a GEMM."""
    if not bool(bad.any()):
        return tape, materialised
    return ([(layer, zeroed_rows(a, bad), zeroed_rows(g, bad)) for layer, a, g in tape],
            [None if grads is None else [zero_rows(p, bad) for p in grads]
             for grads in materialised])


def pair_dots(now: Tape, now_grads: Materialised, reg: Tensor | None, before: Tape,
              before_grads: Materialised, reg_before: Tensor | None, dots: Tensor,
              inputs: InputSquares) -> None:
    """⟨g_j + reg, g̃_j + reg_before⟩ ``[n]`` of the same samples' per-sample gradients at two
    points: for a Linear layer (g_j = δ_j a_jᵀ) ⟨δ_j a_jᵀ, δ̃_j ã_jᵀ⟩ = (δ_j·δ̃_j)(a_j·ã_j),
    plus δ_j·δ̃_j for the bias (on sequences the sum of these over pairs of positions); else
    the materialised rows' dot products. Added to ``dots`` in place."""
    for (layer, a, g), grads, (_, a2, g2), grads2 in zip(now, now_grads, before, before_grads,
                                                        strict=True):
        if grads is None or grads2 is None:  # the same layer on the same samples: both ghost
            if a.dim() > 2:  # a sequence: Σ_{t,s} (δ_t·δ̃_s)(a_t·ã_s)
                dots += grad_sample.ghost_pair_dots(a, g, a2, g2, layer.trainable)
            else:
                deltas = (g * g2).sum(dim=1)
                if layer.trainable[0]:  # an input that does not depend on the point: ‖a_j‖²
                    dots += deltas * (inputs.of(a) if InputSquares.same(a, a2)
                                      else (a * a2).sum(dim=1))
                if layer.trainable[1]:
                    dots += deltas
            if reg_before is not None:
                dots += grad_sample.ghost_dots(a, g, layer.trainable, layer.parts(reg_before))
            if reg is not None:
                dots += grad_sample.ghost_dots(a2, g2, layer.trainable, layer.parts(reg))
            continue
        for p, p2, where in zip(grads, grads2, layer.slices, strict=True):  # type: ignore
            dots += (p * p2).sum(dim=1)
            if reg_before is not None:
                dots += torch.mv(p, reg_before[where])
            if reg is not None:
                dots += torch.mv(p2, reg[where])
    if reg is not None and reg_before is not None:
        dots += torch.dot(reg, reg_before)


def squares(tape: Tape, reg: Tensor | None, sq: Tensor,
            inputs: InputSquares | None = None) -> tuple[Tensor, Materialised]:
    """``sq`` plus ‖g_j + reg‖² of one chunk's per-sample gradients ``[n]`` (ghost norms
    where a layer has them), and each layer's materialised per-sample gradients (None for
    a ghost layer); ``inputs`` shares the layers' ‖a_j‖² between tapes of the same chunk."""
    materialised: Materialised = []
    for layer, a, g in tape:
        if grad_sample.has_ghost(layer.module, a):
            sq += grad_sample.ghost_sq_norms(a, g, layer.trainable,
                                             None if inputs is None or a.dim() > 2
                                             else inputs.of(a))
            if reg is not None:
                sq += 2 * grad_sample.ghost_dots(a, g, layer.trainable, layer.parts(reg))
            materialised.append(None)
        else:
            grads = grad_sample.materialise(layer, a, g)
            for p, where in zip(grads, layer.slices):
                sq += p.square().sum(dim=1)
                if reg is not None:
                    sq += 2 * torch.mv(p, reg[where])
            materialised.append(grads)
    if reg is not None:
        sq += reg.square().sum()
    return sq, materialised


def layout(group: list[Chunk], b: int, kind: tuple[str, ...], stackable: bool) -> tuple | None:
    """What decides whether one tape for ``group`` equals a tape per chunk. Which kernel a
    library runs, and so the rounding, depends on the shapes, strides and alignment of its
    operands and on the threads, not on their values; a layer that mixes samples, or whose tape
    does not lead with the samples, gives other numbers and stays per chunk. So: ``kind`` (the
    method, what it returns), whether each point is shared or each client's own (``stackable``:
    the model can take those in one pass), the shapes, dtypes, device, threads, and whether a
    regulariser or offset is added; or None where the group cannot be taken jointly: fewer than
    two chunks, a chunk that is not a client's whole batch of ``b``, or points that are neither
    one shared point nor each client's own rows of one tensor
    (:func:`~dpfl.models.stacked.views`)."""
    first = group[0]
    if len(group) < 2 or any(chunk.start or chunk.n != b for chunk in group):
        return None
    points = []
    for name in ("params", "params_before"):
        lists = [getattr(chunk, name) for chunk in group]
        if shared(lists):
            points.append("one point")
        elif stackable and stacked.views(lists) is not None:
            points.append("stacked")
        else:
            return None
    return (*kind, *points, len(group), b, tuple(first.x.shape[1:]), first.x.dtype,
            first.y.dtype, first.x.device.type, torch.get_num_threads(), first.reg is not None,
            first.reg_before is not None)


def shared(lists: list) -> bool:
    """Whether every chunk of a group holds the same list of parameters (or None)."""
    return all(params is lists[0] for params in lists)


def joined(parts: list[Tensor]) -> Tensor:
    """``torch.cat(parts)`` (parts of one shape), as a view where they lie one after another
    in one tensor's memory (consecutive clients' batches, as a cohort's batches are drawn)."""
    first = parts[0]
    start, storage = first.data_ptr(), first.untyped_storage().data_ptr()
    if first.is_contiguous() and all(
            p.is_contiguous() and p.shape == first.shape and p.data_ptr() == start + i * p.nbytes
            and p.untyped_storage().data_ptr() == storage for i, p in enumerate(parts)):
        return first.as_strided((len(parts) * len(first), *first.shape[1:]), first.stride())
    return torch.cat(parts)


def chunk_losses(losses: Tensor | None, chunk: Chunk) -> Tensor | None:
    """The chunk's entries of the per-sample losses ``[C, b]``, if kept."""
    return None if losses is None else losses[chunk.client, chunk.start:chunk.start + chunk.n]


def replace_clients(group: list[Chunk]) -> list[Chunk]:
    """``group`` with its chunks' clients renumbered 0, 1, …: rows of memory of its own."""
    return [dataclasses.replace(chunk, client=i) for i, chunk in enumerate(group)]
