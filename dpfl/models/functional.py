"""A torch module seen as a function of its flat trainable parameter vector, batched over clients.

Every algorithm in dpfl works on flat parameter vectors (the trainable parameters concatenated in
``named_parameters()`` order) with a leading client axis: ``x`` is ``[C, b, ...]``, ``y`` is
``[C, b]``, and the point is shared (``[d]``) or per client (``[C, d]``).

How per-sample gradients are computed. One forward pass records, for every layer with trainable
parameters, its input ``a`` (forward hooks), and one backward pass of the summed per-sample
losses gives each such layer's output gradient ``g`` (``torch.autograd.grad`` with respect to the
layer outputs only, so no parameter gradient is ever formed by autograd). The per-sample
gradients follow layer by layer (``dpfl.models.grad_sample``). ``clipped_mean`` never forms the
``[b, d]`` matrix: per-sample norms of ``Linear`` layers come from ``‖g_j‖·‖a_j‖`` and their
clipped sum from one weighted GEMM ("ghost clipping"); conv and norm layers are materialised
(``b × d_layer``), which is cheap for the small conv layers of the papers' models.

Memory. Clients are processed one at a time, and each client's samples in chunks of at most
``chunk_size`` samples, or of as many as fit a byte budget ``chunk_bytes`` for the chunk's
per-sample values; so beyond the ``[C, d]`` result, a step's peak memory is one chunk's, whatever
the batch or the number of clients (``benchmarks/bench_memory.py`` measures it). Per-sample
clipping holds consecutive clients' chunks together up to one chunk's samples (a group), so
that the scalar arithmetic from norms to clip factors runs once per group, not once per client.

Reproducibility. Clients are processed one at a time, in fixed chunks (their length depends on
the model and the input shape only), on 64-byte-aligned copies of their data, into
64-byte-aligned output rows (``_aligned_rows``), and a group's clip factors come from
elementwise, correctly rounded operations, so client i's result does not depend on how many
other clients share the call: a Flower client (C = 1) and the in-process engine (C = 100) agree
bit for bit on CPU. (Measured: stacking the clients' samples into the rows of one GEMM changes
the rounding of every client's rows, because MKL picks its kernel by the matrix shape.)

Non-finite values: a record is dropped on the client. A record with an inf or NaN feature, or
on which the model overflows, has a per-sample gradient that is not finite; clipping cannot
repair it (a NaN norm passes ``min(1, C/‖g‖)`` as 1, and 0 × NaN is NaN in the weighted GEMMs),
and an error would tell the server a fact about the data outside any release. So a sample whose
per-sample gradient is not finite (inf or NaN in it, or a norm beyond the float range; for a
difference, at either point) contributes zero: clip factor 0, its rows of the tapes (layer
inputs a_j, output gradients δ_j) and of the materialised gradients zeroed — out of place: a
tape's first input is a view of the client's data — and its norm reported as 0 (it contributed
nothing; AdaptDP's radius statistic reads these norms). This is a record-wise map: a record
contributes at most what a clipped record can (here nothing), so every sensitivity stays what
its release declares, and the output depends on the event only through the release. A
client-level mini-batch gradient (:meth:`FlatModel.batch_gradients`) that is not finite is the
mean over the client's records whose loss and gradient are finite (the others contribute zero,
still divided by b), or zero if even that is not finite: the methods that use it clip the
client's message (Clip21's radius τ, the quantile family's C) afterwards, which covers any value
of it. Finding out costs one reduction per group (or call) on the hot path
(:func:`non_finite_rows`); the masks run only when something is not finite, so finite data
gives the same bits as before. The records dropped are counted for the caller
(:meth:`FlatModel.take_dropped`), which logs them on the node (``dpfl.rounds.client``).

The nonconvex regulariser. ``nonconvex_reg = λ`` adds ``(λ/2) Σ_k x_k² / (1 + x_k²)`` to every
per-sample loss, the convention of PriSMA eq. 22. The Clip21 paper's logistic regression
(App. I.1) writes ``λ Σ_k x_k² / (1 + x_k²)``: pass ``nonconvex_reg = 2 λ_clip21`` (2e-3 for
λ = 1e-3).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from dpfl.models import grad_sample
from dpfl.models.losses import LOSSES
from dpfl.privacy.clipping import clip_factors

_ALIGNMENT = 64  # bytes; PyTorch's CPU allocator aligns every fresh tensor to this


@dataclass(frozen=True, eq=False)  # compared and hashed by identity
class _Layer:
    """A layer with trainable parameters and where they sit in the flat vector."""

    module: nn.Module
    trainable: tuple[bool, bool]  # (weight, bias)
    slices: tuple[slice, ...]  # flat positions of the trainable ones, in that order
    shapes: tuple[torch.Size, ...]


def _is_aligned(t: Tensor) -> bool:
    return t.data_ptr() % _ALIGNMENT == 0


def _aligned(t: Tensor) -> Tensor:
    """``t`` itself if contiguous and 64-byte aligned, else an aligned copy (same values)."""
    if t.is_contiguous() and _is_aligned(t):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _aligned_rows(like: Tensor, n: int, d: int) -> Tensor:
    """An uninitialised ``[n, d]`` tensor whose every row starts on a 64-byte boundary: the
    first ``d`` columns of ``[n, d']``, ``d'`` rounded up to a whole number of boundaries.

    MKL's result depends on where its output sits (measured on an AVX-512 CPU: a client's clipped
    mean written into row 1 of a ``[4, d]`` tensor, 40 bytes past a 64-byte boundary, differs in
    the last bit from the same mean written at offset 0); on aligned rows every client's kernels
    see the same alignment whatever ``C`` is, with no copy."""
    per = max(1, _ALIGNMENT // like.element_size())
    return like.new_empty(n, -(-d // per) * per)[:, :d]


def non_finite_rows(*values: Tensor) -> Tensor | None:
    """``[n]``: which rows (entries along the first axis) hold inf or NaN in any of ``values``
    (each ``[n, ...]``), or None when none does. One sum per tensor when all are finite (inf or
    NaN among the entries makes the sum inf or NaN); the elementwise check, about 50× slower on
    large tensors, runs only when a sum is not (an overflow of finite entries is told apart
    there)."""
    if all(math.isfinite(v.sum().item()) for v in values):
        return None
    bad = torch.zeros(len(values[0]), dtype=torch.bool, device=values[0].device)
    for v in values:
        bad |= ~torch.isfinite(v).reshape(len(v), -1).all(dim=1)
    return bad if bool(bad.any()) else None


def zero_rows(t: Tensor, rows: Tensor) -> Tensor:
    """``t`` with the rows (first axis) set in ``rows`` ``[n]`` replaced by zeros, out of place:
    masked, not multiplied (0 × NaN is NaN)."""
    return t.masked_fill(_rows_mask(rows, t), 0)


def _rows_mask(rows: Tensor, t: Tensor) -> Tensor:
    """``rows [n]`` as a mask that broadcasts over ``t [n, ...]``'s rows."""
    return rows.view(-1, *(1,) * (t.dim() - 1))


class _InputSquares:
    """‖a_j‖² ``[n]`` of the layer inputs of one chunk, computed once per input: a layer whose
    input does not depend on the point (the first, fed the data) has the same input in the
    tapes at two points, and there ⟨a_j, ã_j⟩ = ‖a_j‖² (the same products, summed alike)."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, tuple[int, ...], tuple[int, ...]], Tensor] = {}

    @staticmethod
    def key(a: Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        return a.data_ptr(), tuple(a.shape), a.stride()

    @classmethod
    def same(cls, a: Tensor, b: Tensor) -> bool:
        """Whether ``a`` and ``b`` are the same memory, seen alike (so the same values)."""
        return cls.key(a) == cls.key(b)

    def of(self, a: Tensor) -> Tensor:
        key = self.key(a)
        if key not in self._known:
            self._known[key] = a.square().sum(dim=1)
        return self._known[key]


@dataclass(frozen=True, eq=False)
class _Chunk:
    """One chunk of one client's samples (:meth:`FlatModel._groups`), at ``pos`` in its group:
    its data, the parameters it is taken at (and at a second point, for a difference), and
    the regulariser's (or an offset's) gradient added to each of its per-sample gradients."""

    client: int
    start: int
    n: int
    pos: int
    x: Tensor
    y: Tensor
    params: list[Tensor]
    reg: Tensor | None
    params_before: list[Tensor] | None = None
    reg_before: Tensor | None = None

    def of(self, values: Tensor) -> Tensor:
        """The chunk's entries of a group's per-sample ``values``."""
        return values[self.pos:self.pos + self.n]


def _per_sample(radii: list[float], group: list[_Chunk]) -> float | Tensor:
    """The clip radius of every sample of ``group`` (one float when its clients share one)."""
    if len({radii[chunk.client] for chunk in group}) == 1:
        return radii[group[0].client]
    return torch.cat([torch.full((chunk.n,), radii[chunk.client]) for chunk in group])


def _difference_weights(sq: Tensor, sq_before: Tensor, dots: Tensor, *, clip: float,
                        clip_diff: float | None, gamma: float, b: int) -> tuple[Tensor, Tensor]:
    """The weights ``(w, w̃)`` of ``Σ_j w_j g_j + Σ_j w̃_j g̃_j`` in
    :meth:`FlatModel.clipped_difference_mean`, from ‖g_j‖², ‖g̃_j‖² and ⟨g_j, g̃_j⟩."""
    alpha = clip_factors(sq.clamp_min(0).sqrt(), clip)
    alpha_before = clip_factors(sq_before.clamp_min(0).sqrt(), clip)
    diff_sq = (alpha.square() * sq + alpha_before.square() * sq_before
               - 2 * alpha * alpha_before * dots)
    beta = (torch.ones_like(alpha) if clip_diff is None
            else clip_factors(diff_sq.clamp_min(0).sqrt(), clip_diff))
    return (gamma + (1 - gamma) * beta) * alpha / b, -(1 - gamma) * beta * alpha_before / b


class FlatModel:
    """A torch module seen as a function of its flat trainable parameter vector.

    Parameters
    ----------
    module : nn.Module
        The model; copied, never modified. Its trainable parameters must belong to ``Linear``,
        ``Conv2d`` or ``GroupNorm`` layers, each called once per forward pass; parameters with
        ``requires_grad=False`` stay fixed and are not part of the flat vector.
    loss : str
        A name in ``LOSSES``: ``cross-entropy``, ``logistic`` (labels ±1) or ``squared``.
    nonconvex_reg : float, default 0.0
        λ of the regulariser ``(λ/2) Σ_k x_k²/(1 + x_k²)`` added to every per-sample loss
        (PriSMA eq. 22; Clip21's λ is half of this one).
    chunk_size : int, default 256
        Most samples per forward/backward pass in the per-sample methods (a linear model's
        closed form ignores it: one chunk per client, unless ``chunk_bytes`` says otherwise).
    chunk_bytes : int or None, default None
        A byte budget for the per-sample values one chunk holds at once: the tensors autograd
        saves for the backward pass, the layers' output gradients, and the materialised
        per-sample gradients (conv and norm layers in :meth:`clipped_mean`; whole ``[n, d]``
        rows in :meth:`per_sample_gradient_chunks` and in a linear model's closed form). Chunks
        are then ``min(chunk_size, max(1, chunk_bytes // bytes per sample))`` samples, the
        bytes per sample counted once per input shape by a one-sample pass
        (:meth:`sample_bytes`). The chunk length depends on the model and the input shape only,
        never on the number of clients or the data, so results stay reproducible; splitting
        a batch differently changes only the rounding of the sums. None: ``chunk_size`` alone.
    """

    def __init__(
        self, module: nn.Module, loss: str, nonconvex_reg: float = 0.0, chunk_size: int = 256,
        chunk_bytes: int | None = None,
    ):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        if chunk_bytes is not None and chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive or None, got {chunk_bytes}")
        self.loss = LOSSES.get(loss)
        self.nonconvex_reg = float(nonconvex_reg)
        self.chunk_size = int(chunk_size)
        self.chunk_bytes = None if chunk_bytes is None else int(chunk_bytes)
        self._sample_bytes: dict[tuple[torch.Size, torch.dtype, bool], int] = {}
        self._template = copy.deepcopy(module)
        self._module = copy.deepcopy(module)

        # Trainable parameters in named_parameters() order, as (owner module, attribute name).
        self._slots: list[tuple[nn.Module, str]] = []
        self._shapes: list[torch.Size] = []
        self._numels: list[int] = []
        where: dict[str, slice] = {}
        owners = dict(self._module.named_modules())
        for name, p in self._module.named_parameters():
            if p.requires_grad:
                where[name] = slice(sum(self._numels), sum(self._numels) + p.numel())
                prefix, _, attr = name.rpartition(".")
                self._slots.append((owners[prefix], attr))
                self._shapes.append(p.shape)
                self._numels.append(p.numel())
        self.d = sum(self._numels)

        self._layers: list[_Layer] = []
        for prefix, m in self._module.named_modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                raise TypeError("per-sample gradients: BatchNorm mixes samples; use GroupNorm")
            own = [(n, p) for n, p in m.named_parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            grad_sample.check_supported(m)
            if any(n not in ("weight", "bias") for n, _ in own):
                raise TypeError(f"per-sample gradients: unexpected parameter in {type(m).__name__}")
            full = [f"{prefix}.{n}" if prefix else n for n, _ in own]
            layer = _Layer(
                module=m,
                trainable=(getattr(m, "weight", None) is not None and m.weight.requires_grad,
                           getattr(m, "bias", None) is not None and m.bias.requires_grad),
                slices=tuple(where[f] for f in full),
                shapes=tuple(p.shape for _, p in own),
            )
            self._layers.append(layer)
            m.register_forward_hook(partial(self._capture, layer))
        self._tape: list[tuple[_Layer, Tensor, Tensor]] | None = None
        self._linear = self._linear_layer(self._module)
        self._dropped = 0  # records dropped for a non-finite gradient, until take_dropped()

    # ----------------------------------------------------------------------------- parameters

    def initial_params(self) -> Tensor:
        """The module's initial trainable parameters, flattened: ``[d]`` float32."""
        trainable = [p for p in self._template.parameters() if p.requires_grad]
        return torch.cat([p.detach().reshape(-1) for p in trainable]).to(torch.float32)

    def load_into(self, flat: Tensor) -> nn.Module:
        """A copy of the module holding ``flat`` (``[d]``) as its trainable parameters."""
        module = copy.deepcopy(self._template)
        trainable = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():
            for p, v in zip(trainable, flat.detach().split(self._numels)):
                p.copy_(v.view_as(p))
        return module

    # ----------------------------------------------------------------------------- evaluation

    def losses(self, flat: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """Per-sample losses, regulariser included, without gradients.

        ``flat [d]`` with ``x [B, ...]`` gives ``[B]``; ``flat [C, d]`` with ``x [C, B, ...]``
        gives ``[C, B]``.
        """
        with torch.no_grad():
            if flat.dim() == 1:
                return self._losses(flat, x, y)
            return torch.stack(
                [self._losses(self._point(flat, c), _aligned(x[c]), y[c]) for c in range(len(flat))]
            )

    def evaluate(
        self, flat: Tensor, x: Tensor, y: Tensor, batch_size: int = 1024
    ) -> dict[str, float | None]:
        """Mean loss (regulariser included) and accuracy (``None`` for regression) of ``flat [d]``
        on the samples ``x [N, ...]``, ``y [N]``, in batches of ``batch_size``."""
        total, correct = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(x), batch_size):
                xs, ys = x[start : start + batch_size], y[start : start + batch_size]
                out = self._forward(flat, xs)
                total += self.loss.per_sample(out, ys).double().sum().item()
                if self.loss.correct is not None:
                    correct += int(self.loss.correct(out, ys).sum())
            loss = total / len(x) + (self._reg_value(flat).item() if self.nonconvex_reg else 0.0)
        accuracy = correct / len(x) if self.loss.correct is not None else None
        return {"loss": loss, "accuracy": accuracy}

    # ------------------------------------------------------------------------------ gradients

    def take_dropped(self) -> int:
        """The records dropped since the last call (a gradient or loss that is not finite: see
        the module docstring), and the count starts again from 0. Its caller (the client
        runtime, after each client step) logs it on the node; it never leaves the node."""
        dropped, self._dropped = self._dropped, 0
        return dropped

    def batch_gradients(self, flat: Tensor, x: Tensor, y: Tensor, *,
                        losses: Tensor | None = None) -> Tensor:
        """``[C, d]``: the gradient of each client's mean loss over its ``b`` samples; the
        per-sample losses (without the regulariser) are written into ``losses [C, b]`` if given.
        A client's gradient that is not finite is the mean over its records whose loss and
        gradient are finite, or zero (:meth:`_finite_mean`; module docstring)."""
        n_clients = x.shape[0]
        out = _aligned_rows(x, n_clients, self.d)
        if self._linear is not None and self.loss.output_grad is not None:
            for c in range(n_clients):
                self._linear_gradient(self._point(flat, c), _aligned(x[c]), y[c], out[c],
                                      None if losses is None else losses[c])
            return self._finite_means(flat, x, y, out)
        shared: list[Tensor] | None = None  # a shared point's leaves, made once
        for c in range(n_clients):
            if self.nonconvex_reg:  # the regulariser's gradient joins autograd's on the point
                point = self._point(flat, c).detach().requires_grad_()
                params = self._params(point)
            else:  # each parameter's gradient is written straight into its part of the row
                if shared is None or flat.dim() > 1:
                    shared = [p.requires_grad_()
                              for p in self._params(self._point(flat, c).detach())]
                params = shared
            with torch.enable_grad():
                per_sample = self.loss.per_sample(self._forward_with(params, _aligned(x[c])),
                                                  y[c])
                if losses is not None:
                    losses[c].copy_(per_sample.detach())
                loss = per_sample.mean()
                if self.nonconvex_reg:
                    out[c] = torch.autograd.grad(loss + self._reg_value(point), point)[0]
                    continue
                grads = torch.autograd.grad(loss, params, materialize_grads=True)
            torch.cat([g.view(-1) for g in grads], out=out[c])
        return self._finite_means(flat, x, y, out)

    def _finite_means(self, flat: Tensor, x: Tensor, y: Tensor, out: Tensor) -> Tensor:
        """``out`` (:meth:`batch_gradients`), each of its rows that is not finite replaced by
        :meth:`_finite_mean` (one sum over ``out`` when all are finite)."""
        if (bad := non_finite_rows(out)) is not None:
            for c in bad.nonzero().flatten().tolist():
                out[c] = self._finite_mean(flat[None] if flat.dim() == 1 else flat[c:c + 1],
                                           x[c:c + 1], y[c:c + 1])
        return out

    def _finite_mean(self, flat: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """``[d]``: one client's (``x [1, b, ...]``) mean-loss gradient over its records whose
        per-sample loss and gradient are finite, the others contributing zero (still divided
        by b), or zero if even that is not finite; the records left out are counted. The
        client's message is clipped after this (Clip21's τ, the quantile family's C), so any
        value of it is covered."""
        b = x.shape[1]
        total = flat.new_zeros(self.d)
        losses = flat.new_empty(1, b)
        kept = 0
        for _, start, rows in self._per_sample_rows(flat, x, y, losses):
            keep = (torch.isfinite(rows).all(dim=1)
                    & torch.isfinite(losses[0, start:start + len(rows)]))
            total += rows[keep].sum(dim=0)
            kept += int(keep.sum())
        mean = total / b
        if non_finite_rows(mean[None]) is not None:
            mean.zero_()
            kept = 0
        self._dropped += b - kept
        return mean

    def full_gradient(self, flat: Tensor, x: Tensor, y: Tensor, batch_size: int = 4096) -> Tensor:
        """``[d]``: the gradient of the mean loss (regulariser included) over all of ``x [N, ...]``,
        accumulated over batches of ``batch_size`` (an evaluation quantity, e.g. ‖∇F(x)‖)."""
        total = flat.new_zeros(self.d, dtype=torch.float64)
        for start in range(0, len(x), batch_size):
            xs, ys = x[start : start + batch_size], y[start : start + batch_size]
            grad = self.batch_gradients(flat, xs.unsqueeze(0), ys.unsqueeze(0))[0]
            total += grad.double() * (len(xs) / len(x))
        return total.to(flat.dtype)

    def per_sample_gradients(self, flat: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """``[C, b, d]``: every sample's gradient (materialised; use ``clipped_mean`` to clip)."""
        n_clients, b = x.shape[:2]
        out = x.new_zeros(n_clients, b, self.d)
        for c, start, rows in self.per_sample_gradient_chunks(flat, x, y):
            out[c, start : start + len(rows)] = rows
        return out

    def per_sample_gradient_chunks(self, flat: Tensor, x: Tensor, y: Tensor
                                   ) -> Iterator[tuple[int, int, Tensor]]:
        """``(client, start, [n, d])``: every sample's gradient, client by client in fixed chunks
        of ``chunk_size`` samples from ``start`` (what :meth:`per_sample_gradients` stacks, in
        ``chunk_size × d`` memory at a time). A sample whose gradient is not finite gets a zero
        row: it is dropped (module docstring), and counted."""
        for c, start, rows in self._per_sample_rows(flat, x, y):
            if (bad := non_finite_rows(rows)) is not None:
                self._drop(bad, rows)
            yield c, start, rows

    def _per_sample_rows(self, flat: Tensor, x: Tensor, y: Tensor, losses: Tensor | None = None
                         ) -> Iterator[tuple[int, int, Tensor]]:
        """:meth:`per_sample_gradient_chunks` as computed (a row may be inf or NaN), each in
        fresh memory; the per-sample losses (without the regulariser) go to ``losses [C, b]``
        if given."""
        closed_form = self._linear is not None and self.loss.output_grad is not None
        size = self.chunk_length(flat, x, y, rows=True)
        for c in range(x.shape[0]):
            point = self._point(flat, c)
            params = self._params(point.detach())
            reg = self._reg_grad(point) if self.nonconvex_reg else None
            for start, xs, ys in self._chunks(x, y, c, size):
                losses_out = None if losses is None else losses[c, start:start + len(xs)]
                if closed_form:
                    rows = self._linear_per_sample(point, xs, ys, losses_out)
                    if reg is not None:
                        rows += reg
                    yield c, start, rows
                    continue
                rows = x.new_zeros(len(xs), self.d)
                for layer, a, g in self._record(params, xs, ys, losses_out):
                    grads = grad_sample.materialise(layer.module, a, g, layer.trainable)
                    for p, where in zip(grads, layer.slices):
                        rows[:, where] = p
                if reg is not None:
                    rows += reg
                yield c, start, rows

    def clipped_mean(
        self, flat: Tensor, x: Tensor, y: Tensor, clip: float | Tensor, *,
        losses: Tensor | None = None, offset: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Per-sample clipping: ``(1/b) Σ_j clip_C(g_ij)`` for each client, with
        ``clip_C(g) = min(1, C/‖g‖)·g``; ``g`` is unchanged when ``‖g‖ ≤ C``, ``g = 0`` included.

        ``clip`` is one radius or one per client (``[C]``). Returns the ``[C, d]`` clipped means
        and the ``[C, b]`` norms of the unclipped per-sample gradients; if ``losses`` (``[C, b]``)
        is given, the per-sample losses of the forward pass are written into it (without the
        regulariser); ``offset`` (``[C, d]``) is added to each of client c's per-sample
        gradients before clipping (FedProx's proximal gradient μ(x − x_global)). Clients are
        processed in groups of at most one chunk's samples (:meth:`_groups`), so memory does
        not grow with ``C``: beyond the inputs and outputs it is one chunk's per-sample values
        (see ``chunk_bytes``; Linear layers on ``[n, in]`` inputs cost only their inputs and
        output gradients, ``‖g_j‖·‖a_j‖``). A sample whose gradient is not finite contributes
        zero and its norm is reported as 0 (module docstring).
        """
        n_clients, b = x.shape[:2]
        radii = self._radii(clip, n_clients)
        out = _aligned_rows(x, n_clients, self.d)  # the first chunk's GEMMs overwrite it (β = 0)
        norms = x.new_empty(n_clients, b)
        closed_form = self._linear is not None and self.loss.output_grad is not None
        size = self.chunk_length(flat, x, y, rows=closed_form)
        if closed_form:
            for c in range(n_clients):
                point = self._point(flat, c)
                reg = self._reg_grad(point) if self.nonconvex_reg else None
                if offset is not None:
                    reg = _aligned(offset[c]) if reg is None else reg + offset[c]
                row = out[c]
                for start, xs, ys in self._chunks(x, y, c, size):  # the rows: n·d memory a chunk
                    n = len(xs)
                    rows = self._linear_per_sample(
                        point, xs, ys, None if losses is None else losses[c, start:start + n])
                    if reg is not None:
                        rows += reg
                    norms[c, start:start + n] = torch.linalg.vector_norm(rows, dim=1)
                    if (bad := non_finite_rows(norms[c, start:start + n])) is not None:
                        self._drop(bad, rows, norms[c, start:start + n])
                    w = clip_factors(norms[c, start:start + n], radii[c]).div_(b)
                    if start == 0:
                        torch.mv(rows.t(), w, out=row)
                    else:
                        row.addmv_(rows.t(), w)
            return out, norms
        for group in self._groups(flat, x, y, size, offset=offset):
            sq = x.new_zeros(sum(chunk.n for chunk in group))
            tapes = []
            for chunk in group:  # pass 1: the tapes and the squared norms
                tape = self._record(chunk.params, chunk.x, chunk.y, None if losses is None else
                                    losses[chunk.client, chunk.start:chunk.start + chunk.n])
                tapes.append((tape, self._squares(tape, chunk.reg, chunk.of(sq))[1]))
            norm = sq.clamp_min_(0).sqrt_()
            w = clip_factors(norm, _per_sample(radii, group)).div_(b)  # exactly 1/b where ‖g_j‖ ≤ C
            if (bad := non_finite_rows(norm)) is not None:  # weight 0 (the regulariser's share
                self._drop(bad, norm, w)  # too), norm reported 0, and no NaN in the GEMMs
                tapes = [self._zeroed(chunk.of(bad), *pair) for chunk, pair in zip(group, tapes)]
            for chunk, (tape, materialised) in zip(group, tapes):  # pass 2: the weighted sums
                norms[chunk.client, chunk.start:chunk.start + chunk.n] = chunk.of(norm)
                self._add_weighted(tape, materialised, chunk.reg, _aligned(chunk.of(w)),
                                   out[chunk.client], first=chunk.start == 0)
            del tapes, tape, materialised  # no tape lives into the next group's passes
        return out, norms

    def clipped_difference_mean(
        self, flat: Tensor, flat_before: Tensor, x: Tensor, y: Tensor, *, clip: float,
        clip_diff: float | None, gamma: float,
    ) -> Tensor:
        """``[C, d]``: ``(1/b) Σ_j [γ·c_j + (1 − γ)·clip_C3(c_j − c̃_j)]`` for each client, with
        ``c_j = clip_C(g_j)`` and ``c̃_j = clip_C(g̃_j)`` the clipped gradients of sample j at
        ``flat`` and at ``flat_before`` (``[d]`` or ``[C, d]``); ``clip_diff=None``: no C3 clip.

        No per-sample gradient is materialised where a layer has ghost norms: with
        α_j = min(1, C/‖g_j‖), α̃_j likewise, ‖c_j − c̃_j‖² = α_j²‖g_j‖² + α̃_j²‖g̃_j‖² −
        2α_jα̃_j⟨g_j, g̃_j⟩ (the cross term per Linear layer is (δ_j·δ̃_j)(a_j·ã_j)), and with
        β_j = min(1, C3/‖c_j − c̃_j‖) the sum is two weighted GEMMs per layer:
        Σ_j (γ + (1 − γ)β_j)α_j g_j − Σ_j (1 − γ)β_j α̃_j g̃_j. Memory: two chunks' tapes.
        A sample whose gradient is not finite at either point contributes zero at both
        (module docstring).
        """
        n_clients, b = x.shape[:2]
        out = _aligned_rows(x, n_clients, self.d)
        closed_form = self._linear is not None and self.loss.output_grad is not None
        size = self.chunk_length(flat, x, y, rows=closed_form)
        weights = partial(_difference_weights, clip=clip, clip_diff=clip_diff, gamma=gamma, b=b)
        if closed_form:
            for c in range(n_clients):
                point, before = self._point(flat, c), self._point(flat_before, c)
                reg = self._reg_grad(point) if self.nonconvex_reg else None
                reg_before = self._reg_grad(before) if self.nonconvex_reg else None
                row = out[c]
                for start, xs, ys in self._chunks(x, y, c, size):
                    rows = self._linear_per_sample(point, xs, ys)
                    rows_before = self._linear_per_sample(before, xs, ys)
                    if reg is not None and reg_before is not None:  # both or neither
                        rows += reg
                        rows_before += reg_before
                    sq, sq_before = rows.square().sum(dim=1), rows_before.square().sum(dim=1)
                    w, w_before = weights(sq, sq_before, (rows * rows_before).sum(dim=1))
                    if (bad := non_finite_rows(sq, sq_before)) is not None:
                        self._drop(bad, rows, rows_before, w, w_before)
                    if start == 0:
                        torch.mv(rows.t(), w, out=row)
                    else:
                        row.addmv_(rows.t(), w)
                    row.addmv_(rows_before.t(), w_before)
            return out
        if self.chunk_bytes is not None:  # two tapes at once
            size = max(1, size // 2)
        for group in self._groups(flat, x, y, size, before=flat_before):
            sq, sq_before, dots = x.new_zeros(3, sum(chunk.n for chunk in group))
            tapes = []
            for chunk in group:  # pass 1: both tapes, the squared norms and the cross terms
                tape, tape_before = self._record(chunk.params, chunk.x, chunk.y), \
                    self._record(chunk.params_before, chunk.x, chunk.y)
                inputs = _InputSquares()
                grads = self._squares(tape, chunk.reg, chunk.of(sq), inputs)[1]
                grads_before = self._squares(tape_before, chunk.reg_before, chunk.of(sq_before),
                                             inputs)[1]
                self._pair_dots(tape, grads, chunk.reg, tape_before, grads_before,
                                chunk.reg_before, chunk.of(dots), inputs)
                tapes.append((tape, grads, tape_before, grads_before))
            w, w_before = weights(sq, sq_before, dots)
            if (bad := non_finite_rows(sq, sq_before)) is not None:
                self._drop(bad, w, w_before)
                tapes = [(*self._zeroed(chunk.of(bad), *pair[:2]),
                          *self._zeroed(chunk.of(bad), *pair[2:]))
                         for chunk, pair in zip(group, tapes)]
            for chunk, (tape, grads, tape_before, grads_before) in zip(group, tapes):  # pass 2
                row = out[chunk.client]
                self._add_weighted(tape, grads, chunk.reg, _aligned(chunk.of(w)), row,
                                   first=chunk.start == 0)
                self._add_weighted(tape_before, grads_before, chunk.reg_before,
                                   _aligned(chunk.of(w_before)), row, first=False)
            del tapes, tape, grads, tape_before, grads_before  # as in clipped_mean
        return out

    def chunk_length(self, flat: Tensor, x: Tensor, y: Tensor, *, rows: bool) -> int:
        """Samples per chunk for inputs like ``x [C, b, ...]``: ``chunk_size`` (a linear model's
        closed form: ``b``), capped by ``chunk_bytes`` // :meth:`sample_bytes` when a budget is
        set; ``rows``: whole ``[n, d]`` per-sample gradient rows are materialised."""
        closed_form = self._linear is not None and self.loss.output_grad is not None
        size = max(1, x.shape[1]) if closed_form else self.chunk_size
        if self.chunk_bytes is None:
            return size
        per_sample = self.sample_bytes(flat, x, y, rows=rows)
        return max(1, min(size, self.chunk_bytes // per_sample))

    def sample_bytes(self, flat: Tensor, x: Tensor, y: Tensor, *, rows: bool) -> int:
        """Bytes of per-sample values one sample of ``x [C, b, ...]`` adds to a chunk, counted
        by one pass on one sample (cached per input shape and dtype): the distinct tensors
        autograd saves with a leading axis of 1 (the parameters' views are not), the layers'
        output gradients, and the per-sample gradients materialised — every layer's that has
        no ghost norm, or the whole ``d`` when ``rows``. A linear model's closed form holds
        the row, the input and the output and its gradient."""
        key = (x.shape[2:], x.dtype, rows)
        if key in self._sample_bytes:
            return self._sample_bytes[key]
        itemsize = x.element_size()
        if self._linear is not None and self.loss.output_grad is not None:
            features = math.prod(x.shape[2:])
            self._sample_bytes[key] = itemsize * (self.d + features + 2 * self._linear.out_features)
        else:
            saved: dict[int, int] = {}

            def pack(t: Tensor) -> Tensor:
                if t.dim() and t.shape[0] == 1:
                    saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), t.nbytes)
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                tape = self._record(self._params(self._point(flat, 0).detach()),
                                    _aligned(x[0, :1]), _aligned(y[0, :1]))
            count = self.d if rows else sum(
                sum(s.numel() for s in layer.shapes)
                for layer, a, _ in tape if not grad_sample.has_ghost(layer.module, a))
            values = sum(saved.values()) + sum(g.nbytes for _, _, g in tape)
            self._sample_bytes[key] = values + itemsize * count
        return self._sample_bytes[key]

    # ------------------------------------------------------------------------------ internals

    @staticmethod
    def _linear_layer(module: nn.Module) -> nn.Linear | None:
        """The ``Linear`` layer of a linear model (``Linear`` or ``Sequential(Flatten,
        Linear)``), whose gradients :meth:`_linear_gradient` writes in closed form; else None."""
        layers = list(module) if isinstance(module, nn.Sequential) else [module]
        if (isinstance(layers[-1], nn.Linear) and all(type(m) is nn.Flatten for m in layers[:-1])
                and layers[-1].weight.requires_grad
                and (layers[-1].bias is None or layers[-1].bias.requires_grad)):
            return layers[-1]
        return None

    def _linear_outputs(self, point: Tensor, x: Tensor) -> tuple[Tensor, Tensor, bool]:
        """``(a, o, has bias)`` of a linear model at ``point``: the flattened inputs ``a`` and
        the outputs ``o = aWᵀ + b``."""
        linear = self._linear
        assert linear is not None
        a = x.reshape(len(x), -1)
        weight = point[: linear.weight.numel()].view(linear.weight.shape)
        bias = point[linear.weight.numel():] if linear.bias is not None else None
        return a, torch.nn.functional.linear(a, weight, bias), bias is not None

    def _linear_per_sample(self, point: Tensor, x: Tensor, y: Tensor,
                           losses_out: Tensor | None = None) -> Tensor:
        """``[n, d]``: a linear model's per-sample loss gradients in closed form (without the
        regulariser), ``∇W_j = δ_j a_jᵀ`` and ``∇b_j = δ_j`` with ``δ_j = ∂loss_j/∂o_j``, in
        the parameters' flat order (weight row-major, then bias); the per-sample losses go to
        ``losses_out`` if given."""
        assert self.loss.output_grad is not None
        a, outputs, has_bias = self._linear_outputs(point, x)
        if losses_out is not None:
            losses_out.copy_(self.loss.per_sample(outputs, y))
        delta = self.loss.output_grad(outputs, y).reshape(len(a), -1)
        weight = (delta.unsqueeze(2) * a.unsqueeze(1)).reshape(len(a), -1)
        return torch.cat([weight, delta], dim=1) if has_bias else weight

    def _linear_gradient(self, point: Tensor, x: Tensor, y: Tensor, out: Tensor,
                         losses_out: Tensor | None) -> None:
        """A linear model's mean-loss gradient in closed form (no autograd: the cost of the
        products themselves, which matters for the thousands of tiny rounds of a logistic
        regression sweep): with ``o = aWᵀ + b`` and ``δ = ∂loss_j/∂o_j / n``,
        ``∇W = δᵀa``, ``∇b = Σ_j δ_j``, plus the regulariser's gradient."""
        linear = self._linear
        assert linear is not None and self.loss.output_grad is not None
        a, outputs, has_bias = self._linear_outputs(point, x)
        if losses_out is not None:
            losses_out.copy_(self.loss.per_sample(outputs, y))
        delta = self.loss.output_grad(outputs, y).reshape(len(a), -1) / len(a)
        torch.mm(delta.t(), a, out=out[: linear.weight.numel()].view(linear.weight.shape))
        if has_bias:
            torch.sum(delta, dim=0, out=out[linear.weight.numel():])
        if self.nonconvex_reg:
            out += self._reg_grad(point)

    def _squares(self, tape: list[tuple[_Layer, Tensor, Tensor]], reg: Tensor | None,
                 sq: Tensor, inputs: _InputSquares | None = None
                 ) -> tuple[Tensor, list[list[Tensor] | None]]:
        """``sq`` plus ‖g_j + reg‖² of one chunk's per-sample gradients ``[n]`` (ghost norms
        where a layer has them), and each layer's materialised per-sample gradients (None for
        a ghost layer); ``inputs`` shares the layers' ‖a_j‖² between tapes of the same chunk."""
        materialised: list[list[Tensor] | None] = []
        for layer, a, g in tape:
            if grad_sample.has_ghost(layer.module, a):
                sq += grad_sample.ghost_sq_norms(a, g, layer.trainable,
                                                 None if inputs is None else inputs.of(a))
                if reg is not None:
                    sq += 2 * grad_sample.ghost_dots(a, g, layer.trainable, self._parts(layer, reg))
                materialised.append(None)
            else:
                grads = grad_sample.materialise(layer.module, a, g, layer.trainable)
                for p, where in zip(grads, layer.slices):
                    sq += p.square().sum(dim=1)
                    if reg is not None:
                        sq += 2 * torch.mv(p, reg[where])
                materialised.append(grads)
        if reg is not None:
            sq += reg.square().sum()
        return sq, materialised

    def _add_weighted(self, tape: list[tuple[_Layer, Tensor, Tensor]],
                      materialised: list[list[Tensor] | None], reg: Tensor | None, w: Tensor,
                      row: Tensor, first: bool) -> None:
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
            for layer in set(self._layers) - {layer for layer, _, _ in tape}:  # unused in forward
                for where in layer.slices:
                    row[where] = 0
        if reg is not None:
            row.add_(reg, alpha=w.sum().item())

    def _drop(self, bad: Tensor, *values: Tensor) -> None:
        """Zero the samples ``bad`` ``[n]`` in the rows of each of ``values`` (``[n, ...]``, the
        method's own memory), in place, and count them as dropped."""
        for v in values:
            v.masked_fill_(_rows_mask(bad, v), 0)
        self._dropped += int(bad.sum())

    @staticmethod
    def _zeroed(bad: Tensor, tape: list[tuple[_Layer, Tensor, Tensor]],
                materialised: list[list[Tensor] | None]
                ) -> tuple[list[tuple[_Layer, Tensor, Tensor]], list[list[Tensor] | None]]:
        """A chunk's tape and materialised per-sample gradients with the samples ``bad`` zeroed,
        out of place (the first input is a view of the client's data): a weight of 0 does not
        remove a NaN from a GEMM."""
        if not bool(bad.any()):
            return tape, materialised
        return ([(layer, zero_rows(a, bad), zero_rows(g, bad)) for layer, a, g in tape],
                [None if grads is None else [zero_rows(p, bad) for p in grads]
                 for grads in materialised])

    @staticmethod
    def _parts(layer: _Layer, vector: Tensor) -> list[Tensor]:
        """``vector [d]``'s pieces for the layer's trainable parameters, in their shapes."""
        return [vector[s].view(shape) for s, shape in zip(layer.slices, layer.shapes)]

    def _pair_dots(self, now: list[tuple[_Layer, Tensor, Tensor]],
                   now_grads: list[list[Tensor] | None], reg: Tensor | None,
                   before: list[tuple[_Layer, Tensor, Tensor]],
                   before_grads: list[list[Tensor] | None], reg_before: Tensor | None,
                   dots: Tensor, inputs: _InputSquares) -> None:
        """⟨g_j + reg, g̃_j + reg_before⟩ ``[n]`` of the same samples' per-sample gradients at
        two points: for a Linear layer (g_j = δ_j a_jᵀ) ⟨δ_j a_jᵀ, δ̃_j ã_jᵀ⟩ = (δ_j·δ̃_j)(a_j·ã_j),
        plus δ_j·δ̃_j for the bias; else the materialised rows' dot products. Added to
        ``dots`` in place."""
        for (layer, a, g), grads, (_, a2, g2), grads2 in zip(now, now_grads, before, before_grads,
                                                            strict=True):
            if grads is None or grads2 is None:  # the same layer on the same samples: both ghost
                deltas = (g * g2).sum(dim=1)
                if layer.trainable[0]:  # a layer whose input does not depend on the point: ‖a_j‖²
                    dots += deltas * (inputs.of(a) if _InputSquares.same(a, a2)
                                      else (a * a2).sum(dim=1))
                if layer.trainable[1]:
                    dots += deltas
                if reg_before is not None:
                    dots += grad_sample.ghost_dots(a, g, layer.trainable,
                                                   self._parts(layer, reg_before))
                if reg is not None:
                    dots += grad_sample.ghost_dots(a2, g2, layer.trainable, self._parts(layer, reg))
                continue
            for p, p2, where in zip(grads, grads2, layer.slices, strict=True):  # type: ignore
                dots += (p * p2).sum(dim=1)
                if reg_before is not None:
                    dots += torch.mv(p, reg_before[where])
                if reg is not None:
                    dots += torch.mv(p2, reg[where])
        if reg is not None and reg_before is not None:
            dots += torch.dot(reg, reg_before)

    def _capture(
        self, layer: _Layer, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor
    ) -> Tensor | None:
        """Forward hook: put (layer, input, output) on the tape while one is being recorded."""
        tape = self._tape
        if tape is None:
            return None
        if any(entry[0] is layer for entry in tape):
            name = type(module).__name__
            raise RuntimeError(f"per-sample gradients: {name} is called twice in one forward")
        if not output.requires_grad:
            # Nothing below this layer is trainable: start the graph here.
            output = output.detach().requires_grad_()
        tape.append((layer, inputs[0].detach(), output))
        return output

    def _record(self, params: list[Tensor], x: Tensor, y: Tensor,
                losses_out: Tensor | None = None) -> list[tuple[_Layer, Tensor, Tensor]]:
        """One forward and backward pass at ``params`` (:meth:`_params` of a detached point):
        (layer, input, output gradient) per trainable layer; the per-sample losses are copied
        into ``losses_out`` when given."""
        self._tape = []
        try:
            with torch.enable_grad():
                losses = self.loss.per_sample(self._forward_with(params, x), y)
            tape = self._tape
        finally:
            self._tape = None
        if losses_out is not None:
            losses_out.copy_(losses.detach())
        if not tape:
            return []
        outputs = [out for _, _, out in tape]
        grads = torch.autograd.grad(losses.sum(), outputs, allow_unused=True)
        return [
            (layer, a, torch.zeros_like(out) if g is None else g)
            for (layer, a, out), g in zip(tape, grads)
        ]

    def _params(self, point: Tensor) -> list[Tensor]:
        """The trainable parameters as views of ``point``, in their shapes."""
        return [v.view(shape) for v, shape in zip(point.split(self._numels), self._shapes)]

    def _forward(self, point: Tensor, x: Tensor) -> Tensor:
        """The private module's output with its trainable parameters replaced by views of
        ``point`` (a cheaper ``torch.func.functional_call``; the originals are put back)."""
        return self._forward_with(self._params(point), x)

    def _forward_with(self, params: list[Tensor], x: Tensor) -> Tensor:
        """The private module's output with its trainable parameters replaced by ``params``."""
        originals = [module._parameters[attr] for module, attr in self._slots]
        try:
            for (module, attr), param in zip(self._slots, params):
                module._parameters[attr] = param  # type: ignore[assignment]
            return self._module(x)
        finally:
            for (module, attr), original in zip(self._slots, originals):
                module._parameters[attr] = original

    def _losses(self, point: Tensor, x: Tensor, y: Tensor) -> Tensor:
        losses = self.loss.per_sample(self._forward(point, x), y)
        return losses + self._reg_value(point) if self.nonconvex_reg else losses

    def _reg_value(self, point: Tensor) -> Tensor:
        sq = point.square()
        return 0.5 * self.nonconvex_reg * (sq / (1 + sq)).sum()

    def _reg_grad(self, point: Tensor) -> Tensor:
        return self.nonconvex_reg * point / (1 + point.square()).square()

    def _point(self, flat: Tensor, c: int) -> Tensor:
        return _aligned(flat if flat.dim() == 1 else flat[c])

    def _groups(self, flat: Tensor, x: Tensor, y: Tensor, size: int, *,
                offset: Tensor | None = None, before: Tensor | None = None
                ) -> Iterator[list[_Chunk]]:
        """Every client's chunks (:meth:`_chunks`), client by client, gathered into groups of
        consecutive chunks of at most ``size`` samples in all: a group holds one chunk's
        per-sample values, and its per-sample scalar arithmetic (norms, clip factors) is one
        pass for the group instead of one per client. That arithmetic is elementwise and
        correctly rounded, so no value depends on the grouping. ``offset [C, d]`` is added
        to every per-sample gradient of client c (with the regulariser's); ``before`` is a
        second point (``[d]`` or ``[C, d]``) each chunk is also taken at."""
        group: list[_Chunk] = []
        held = 0
        points: dict[str, tuple[list[Tensor], Tensor | None]] = {}
        for c in range(x.shape[0]):
            for name, where in (("now", flat), ("before", before)):
                if where is not None and (where.dim() > 1 or name not in points):
                    point = self._point(where, c)
                    reg = self._reg_grad(point) if self.nonconvex_reg else None
                    points[name] = (self._params(point.detach()), reg)
            params, reg = points["now"]
            if offset is not None:
                reg = _aligned(offset[c]) if reg is None else reg + offset[c]
            params_before, reg_before = points.get("before", (None, None))
            for start, xs, ys in self._chunks(x, y, c, size):
                if group and held + len(xs) > size:
                    yield group
                    group, held = [], 0
                group.append(_Chunk(c, start, len(xs), held, xs, ys, params, reg,
                                    params_before, reg_before))
                held += len(xs)
        if group:
            yield group

    @staticmethod
    def _chunks(x: Tensor, y: Tensor, c: int, size: int):
        """(start, x, y) for client c's fixed-size sample chunks of ``size`` samples
        (:meth:`chunk_length`), each on aligned memory."""
        for start in range(0, x.shape[1], size):
            stop = start + size
            yield start, _aligned(x[c, start:stop]), _aligned(y[c, start:stop])

    @staticmethod
    def _radii(clip: float | Tensor, n_clients: int) -> list[float]:
        """One float32-representable radius per client, so that a radius given as a Python float
        and the same radius in a float32 tensor clip identically."""
        radii = torch.as_tensor(clip, dtype=torch.float32).reshape(-1).expand(n_clients).tolist()
        if not all(0 < r < float("inf") for r in radii):
            raise ValueError(f"clip radii must be positive and finite, got {clip}")
        return radii
