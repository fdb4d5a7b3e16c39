"""A torch module seen as a function of its flat trainable parameter vector, batched over clients.

Every algorithm in dpfl works on flat parameter vectors (the trainable parameters concatenated in
``named_parameters()`` order) with a leading client axis: ``x`` is ``[C, b, ...]``, ``y`` is
``[C, b]``, and the point is shared (``[d]``) or per client (``[C, d]``).

How per-sample gradients are computed. One forward pass records, for every layer with trainable
parameters, its input ``a`` (forward hooks), and one backward pass of the summed per-sample
losses gives each such layer's output gradient ``g`` (``torch.autograd.grad`` with respect to the
layer outputs only, so no parameter gradient is ever formed by autograd). The per-sample
gradients follow layer by layer (``dpfl.models.grad_sample``: a rule per layer type, and a
generic rule for any other module). ``clipped_mean`` never forms the ``[b, d]`` matrix:
per-sample norms of ``Linear`` layers come from ``‖g_j‖·‖a_j‖`` (on sequences, where cheaper,
from the Gram trick) and their clipped sum from one weighted GEMM ("ghost clipping"); other
layers are materialised (``b × d_layer``), which is cheap for the small conv layers of the
papers' models.

Memory. Clients are processed one at a time, and each client's samples in chunks of at most
``chunk_size`` samples, or of as many as fit a byte budget ``chunk_bytes`` for the chunk's
per-sample values. Per-sample clipping holds consecutive clients' chunks together (a group), so
that the scalar arithmetic from norms to clip factors runs once per group, not once per client,
and a joint tape (below) covers the group: as many samples as ``group_bytes`` of per-sample
values hold (4 MiB: about 1,960 samples of the MNIST MLP), never fewer than one chunk's and
never more than ``chunk_bytes`` allows. So beyond the ``[C, d]`` result, a step's peak memory is
one group's, whatever the batch or the number of clients (``benchmarks/bench_memory.py``
measures it). How chunks are grouped changes no result (only the joint tapes could, and they
are checked: below); how a batch is cut into chunks changes the rounding of its sums.

Reproducibility. Clients are processed one at a time, in fixed chunks (their length depends on
the model and the input shape only), on 64-byte-aligned copies of their data, into
64-byte-aligned output rows (:func:`~dpfl.models.rows.aligned_rows`), and a group's clip
factors come from elementwise, correctly rounded operations, so client i's result does not
depend on how many other clients share the call: a Flower client (C = 1) and the in-process
engine (C = 100) agree bit for bit on CPU. A ragged batch (Poisson sampling: ``lengths[i]``
records of client i, the clients' records packed one after another, ``x [Σ lengths, ...]``:
:func:`~dpfl.models.rows.client_records`) cuts each client's chunks from its own records alone,
so its result does not depend on the others' lengths either.

Joint tapes. Where a group's clients share one point (one ``[d]`` point, or rows of
``[C, d]`` holding the same bits, as at a round's first local step) and each brings a whole
batch of one size, one forward and backward pass over the group's samples gives every client's
tape at once (split along the samples), and only the weighted sums stay per client: several
times fewer calls, for the same numbers only where the kernels round alike. Whether they do
depends on the CPU and the shapes (on one AVX-512 CPU, 6 clients × 8 samples of the MNIST MLP
differ in the last bit from 6 passes of 8, while 6 × 16 do not; MKL picks its kernel by the
matrix shape), never on the values. So the first group of each layout (its sizes, dtypes, device, threads:
:func:`~dpfl.models.tape.layout`) is computed client by client, then again jointly, and
compared bit for bit (:meth:`~dpfl.models.tape.TapeEngine.same_jointly`); the layout is taken
jointly from then on only if every clipped mean, norm and loss was the same. A layer that
mixes samples fails that check too and stays per client. Clients at points of their own (rows
of one ``[C, d]`` tensor, a local step after the first) share a pass only for a ``Sequential``
of ``Linear`` layers and sample-wise modules, each ``Linear`` one batched GEMM over the
clients' weights (:meth:`~dpfl.models.tape.TapeEngine.record_stacked`), under the same check.

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

from collections.abc import Iterator, Sequence
from functools import partial

import torch
from torch import Tensor, nn

from dpfl.models.flat import FlatParameters
from dpfl.models.linear import ClosedFormLinear
from dpfl.models.losses import Loss
from dpfl.models.rows import (
    Dropped,
    aligned,
    aligned_rows,
    batch_shape,
    client_radii,
    difference_weights,
    non_finite_rows,
    stacked_view,
    value_like,
    zero_empty,
)
from dpfl.models.tape import TapeEngine
from dpfl.privacy.clipping import FLAT, ClippingFunction

#: the default byte budget of a group of clients' per-sample values (``group_bytes``): on the
#: MNIST MLP (2,136 bytes a sample) groups of 1,024–2,048 samples made a clipped mean up to 10%
#: faster than groups of 256 (10 × 64, 64 × 32, 256 × 16 clients × batch), 4,096 no faster; a
#: CNN's samples (165 KB for the Clip21 CNN) stay in groups of one chunk
GROUP_BYTES = 4 * 2 ** 20


class FlatModel:
    """A torch module seen as a function of its flat trainable parameter vector.

    It composes the module's flat parameters (:class:`~dpfl.models.flat.FlatParameters`:
    :attr:`flat`), the per-sample gradient engine on tapes
    (:class:`~dpfl.models.tape.TapeEngine`: :attr:`tapes`) and, for a linear model whose loss
    has a closed-form output gradient, the closed-form path
    (:class:`~dpfl.models.linear.ClosedFormLinear`: :attr:`linear`, else None).

    Parameters
    ----------
    module : nn.Module
        The model; copied, never modified. Each layer with trainable parameters is called once
        per forward pass (rules: :mod:`dpfl.models.grad_samplers`; a layer that mixes samples is
        refused); parameters with ``requires_grad=False`` stay fixed, out of the flat vector.
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
    joint_tapes : bool, default True
        Take a group's tapes from one pass where that was checked to change no bit (module
        docstring, "Joint tapes"); False computes every client's tape on its own.
    group_bytes : int, default 4 MiB (:data:`GROUP_BYTES`)
        Per-sample clipping's groups of consecutive clients' chunks hold this many bytes of
        per-sample values (as ``chunk_bytes`` counts them; at most ``chunk_bytes``, at least one
        chunk): fewer, larger passes (joint tapes), the same numbers, bounded memory.
    """

    def __init__(
        self, module: nn.Module, loss: str | Loss, nonconvex_reg: float = 0.0,
        chunk_size: int = 256,
        chunk_bytes: int | None = None,
        joint_tapes: bool = True,
        group_bytes: int = GROUP_BYTES,
    ):
        for name, value in (("chunk_size", chunk_size), ("group_bytes", group_bytes),
                            ("chunk_bytes", 1 if chunk_bytes is None else chunk_bytes)):
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        self.chunk_size = int(chunk_size)
        self.chunk_bytes = None if chunk_bytes is None else int(chunk_bytes)
        self.group_bytes = int(group_bytes)
        self.flat = FlatParameters(module, loss, nonconvex_reg)
        self.loss = self.flat.loss
        self.nonconvex_reg = self.flat.nonconvex_reg
        self.d = self.flat.d
        self.dropped = Dropped()  # records dropped for a non-finite gradient
        self.tapes = TapeEngine(self.flat, self.dropped, joint=joint_tapes)
        blocks = self.flat.linear_blocks()
        self.linear = (ClosedFormLinear(self.flat, blocks, self.dropped)
                       if blocks is not None and self.loss.output_grad is not None else None)
        self._sample_bytes: dict[tuple[torch.Size, torch.dtype, bool], int] = {}

    # ----------------------------------------------------------------------------- parameters

    def initial_params(self) -> Tensor:
        """The module's initial trainable parameters, flattened: ``[d]`` float32."""
        return self.flat.initial_params()

    def load_into(self, flat: Tensor) -> nn.Module:
        """A copy of the module holding ``flat`` (``[d]``) as its trainable parameters."""
        return self.flat.load_into(flat)

    # ----------------------------------------------------------------------------- evaluation

    def losses(self, flat: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """Per-sample losses, regulariser included, without gradients.

        ``flat [d]`` with ``x [B, ...]`` gives ``[B]``; ``flat [C, d]`` with ``x [C, B, ...]``
        gives ``[C, B]``.
        """
        with torch.no_grad():
            if flat.dim() == 1:
                return self.flat.point_losses(flat, x, y)
            return torch.stack([self.flat.point_losses(self.flat.point(flat, c), aligned(x[c]),
                                                       y[c]) for c in range(len(flat))])

    def evaluate(
        self, flat: Tensor, x: Tensor, y: Tensor, batch_size: int = 1024
    ) -> dict[str, float | None]:
        """Mean loss (regulariser included) and accuracy (``None`` for regression) of ``flat [d]``
        on the samples ``x [N, ...]``, ``y [N]``, in batches of ``batch_size``."""
        total, correct = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(x), batch_size):
                xs, ys = x[start : start + batch_size], y[start : start + batch_size]
                out = self.flat.forward(flat, xs)
                total += self.loss.per_sample(out, ys).double().sum().item()
                if self.loss.correct is not None:
                    correct += int(self.loss.correct(out, ys).sum())
            loss = total / len(x) + (self.flat.reg_value(flat).item() if self.nonconvex_reg
                                     else 0.0)
        accuracy = correct / len(x) if self.loss.correct is not None else None
        return {"loss": loss, "accuracy": accuracy}

    # ------------------------------------------------------------------------------ gradients

    def take_dropped(self) -> int:
        """The records dropped since the last call (a gradient or loss that is not finite: see
        the module docstring), and the count starts again from 0. Its caller (the client
        runtime, after each client step) logs it on the node; it never leaves the node."""
        return self.dropped.take()

    def batch_gradients(self, flat: Tensor, x: Tensor, y: Tensor, *,
                        losses: Tensor | None = None) -> Tensor:
        """``[C, d]``: the gradient of each client's mean loss over its ``b`` samples; the
        per-sample losses (without the regulariser) are written into ``losses [C, b]`` if given.
        A client's gradient that is not finite is the mean over its records whose loss and
        gradient are finite, or zero (:func:`finite_mean`; module docstring)."""
        n_clients = x.shape[0]
        out = aligned_rows(value_like(x, flat), n_clients, self.d)
        if self.linear is not None:
            for c in range(n_clients):
                self.linear.gradient(self.flat.point(flat, c), aligned(x[c]), y[c], out[c],
                                     None if losses is None else losses[c])
            return self._finite_means(flat, x, y, out)
        shared: list[Tensor] | None = None  # a shared point's leaves, made once
        for c in range(n_clients):
            if self.nonconvex_reg:  # the regulariser's gradient joins autograd's on the point
                point = self.flat.point(flat, c).detach().requires_grad_()
                params = self.flat.params(point)
            else:  # each parameter's gradient is written straight into its part of the row
                if shared is None or flat.dim() > 1:
                    shared = [p.requires_grad_()
                              for p in self.flat.params(self.flat.point(flat, c).detach())]
                params = shared
            with torch.enable_grad():
                per_sample = self.loss.per_sample(self.flat.forward_with(params, aligned(x[c])),
                                                  y[c])
                if losses is not None:
                    losses[c].copy_(per_sample.detach())
                loss = per_sample.mean()
                if self.nonconvex_reg:
                    out[c] = torch.autograd.grad(loss + self.flat.reg_value(point), point)[0]
                    continue
                grads = torch.autograd.grad(loss, params, materialize_grads=True)
            torch.cat([g.view(-1) for g in grads], out=out[c])
        return self._finite_means(flat, x, y, out)

    def _finite_means(self, flat: Tensor, x: Tensor, y: Tensor, out: Tensor) -> Tensor:
        """``out`` (:meth:`batch_gradients`), each of its rows that is not finite replaced by
        :func:`finite_mean` (one sum over ``out`` when all are finite)."""
        if (bad := non_finite_rows(out)) is not None:
            for c in bad.nonzero().flatten().tolist():
                out[c] = finite_mean(self, flat[None] if flat.dim() == 1 else flat[c:c + 1],
                                     x[c:c + 1], y[c:c + 1])
        return out

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
        out = value_like(x, flat).new_zeros(n_clients, b, self.d)
        for c, start, rows in self.per_sample_gradient_chunks(flat, x, y):
            out[c, start : start + len(rows)] = rows
        return out

    def per_sample_gradient_chunks(self, flat: Tensor, x: Tensor, y: Tensor
                                   ) -> Iterator[tuple[int, int, Tensor]]:
        """``(client, start, [n, d])``: every sample's gradient, client by client in fixed chunks
        of ``chunk_size`` samples from ``start`` (what :meth:`per_sample_gradients` stacks, in
        ``chunk_size × d`` memory at a time). A sample whose gradient is not finite gets a zero
        row: it is dropped (module docstring), and counted."""
        for c, start, rows in self.per_sample_rows(flat, x, y):
            if (bad := non_finite_rows(rows)) is not None:
                self.dropped.drop(bad, rows)
            yield c, start, rows

    def per_sample_rows(self, flat: Tensor, x: Tensor, y: Tensor, losses: Tensor | None = None
                        ) -> Iterator[tuple[int, int, Tensor]]:
        """:meth:`per_sample_gradient_chunks` as computed (a row may be inf or NaN), each in
        fresh memory; the per-sample losses (without the regulariser) go to ``losses [C, b]``
        if given."""
        size = self.chunk_length(flat, x, y, rows=True)
        engine = self.tapes if self.linear is None else self.linear
        return engine.rows(flat, x, y, size, losses)

    def clipped_mean(
        self, flat: Tensor, x: Tensor, y: Tensor, clip: float | Tensor, *,
        losses: Tensor | None = None, offset: Tensor | None = None, divisor: int | None = None,
        lengths: Sequence[int] | None = None, clipping: ClippingFunction = FLAT,
    ) -> tuple[Tensor, Tensor]:
        """Per-sample clipping: ``(1/b) Σ_j clip_C(g_ij)`` for each client, ``clip_C`` the
        function ``clipping`` (flat: ``min(1, C/‖g‖)·g``; :mod:`dpfl.privacy.clipping`).

        ``clip`` is one radius or one per client (``[C]``). Returns the ``[C, d]`` clipped means
        and the ``[C, b]`` norms of the unclipped per-sample gradients; if ``losses`` (``[C, b]``)
        is given, the per-sample losses of the forward pass are written into it (without the
        regulariser); ``offset`` (``[C, d]``) is added to each of client c's per-sample
        gradients before clipping (FedProx's proximal gradient μ(x − x_global)). Clients are
        processed in groups of at most one chunk's samples (:meth:`TapeEngine.groups`), so
        memory does not grow with ``C``: beyond the inputs and outputs it is one chunk's
        per-sample values (see ``chunk_bytes``; Linear layers on ``[n, in]`` inputs cost only
        their inputs and output gradients, ``‖g_j‖·‖a_j‖``). A sample whose gradient is not
        finite contributes zero and its norm is reported as 0 (module docstring). A ragged
        batch (``lengths``, module docstring) sums each client's records over ``divisor``
        (default b); norms ``[C, longest]``, 0 beyond a client's records; no records: zeros.
        """
        n_clients, b = batch_shape(x, lengths)
        radii = client_radii(clip, n_clients)
        like = value_like(x, flat)
        out = aligned_rows(like, n_clients, self.d)  # the first chunk's GEMMs overwrite it (β = 0)
        norms = like.new_empty(n_clients, b) if lengths is None else like.new_zeros(n_clients, b)
        if b == 0:
            return out.zero_(), norms
        sized = stacked_view(x, y, lengths)
        size = self.chunk_length(flat, *sized, rows=self.linear is not None)
        options = {"lengths": lengths, "divisor": divisor or b, "clipping": clipping}
        if self.linear is not None:
            self.linear.clipped_mean(flat, x, y, radii, size, out, norms, losses, offset,
                                     **options)
        else:
            self.tapes.clipped_mean(flat, x, y, radii, size, out, norms, losses, offset,
                                    group_size=self.group_length(flat, *sized, size), **options)
        return zero_empty(out, lengths), norms

    def per_sample_norms(self, flat: Tensor, x: Tensor, y: Tensor, *,
                         lengths: Sequence[int] | None = None) -> Tensor:
        """``[C, b]``: the per-sample gradients' norms :meth:`clipped_mean` reports (0 for a
        dropped sample, and beyond a client's records in a ragged batch), bit for bit, without
        its weighted sums (AdaptDP-FedAvg's radius statistic; a linear model's closed form
        computes the clipped mean)."""
        n_clients, b = batch_shape(x, lengths)
        if self.linear is not None or b == 0:
            return self.clipped_mean(flat, x, y, 1.0, lengths=lengths)[1]
        like = value_like(x, flat)
        norms = like.new_empty(n_clients, b) if lengths is None else like.new_zeros(n_clients, b)
        sized = stacked_view(x, y, lengths)
        size = self.chunk_length(flat, *sized, rows=False)
        self.tapes.norms(flat, x, y, size, norms, group_size=self.group_length(flat, *sized, size),
                         lengths=lengths)
        return norms

    def clipped_difference_mean(
        self, flat: Tensor, flat_before: Tensor, x: Tensor, y: Tensor, *, clip: float,
        clip_diff: float | None, gamma: float, lengths: Sequence[int] | None = None,
        divisor: int | None = None, clipping: ClippingFunction = FLAT,
    ) -> Tensor:
        """``[C, d]``: ``(1/b) Σ_j [γ·c_j + (1 − γ)·clip_C3(c_j − c̃_j)]`` for each client, with
        ``c_j``, ``c̃_j`` sample j's gradients at ``flat`` and ``flat_before`` (``[d]``, ``[C, d]``)
        clipped by ``clipping`` (:meth:`clipped_mean`); clip_C3 is flat (``clip_diff=None``: none).

        No per-sample gradient is materialised where a layer has ghost norms: with
        α_j = w_C(‖g_j‖), α̃_j likewise, ‖c_j − c̃_j‖² = α_j²‖g_j‖² + α̃_j²‖g̃_j‖² −
        2α_jα̃_j⟨g_j, g̃_j⟩ (the cross term per Linear layer is (δ_j·δ̃_j)(a_j·ã_j)), and with
        β_j = min(1, C3/‖c_j − c̃_j‖) the sum is two weighted GEMMs per layer:
        Σ_j (γ + (1 − γ)β_j)α_j g_j − Σ_j (1 − γ)β_j α̃_j g̃_j. Memory: two chunks' tapes.
        A sample whose gradient is not finite at either point contributes zero at both
        (module docstring). A ragged batch (``lengths``, ``divisor``): :meth:`clipped_mean`.
        """
        n_clients, b = batch_shape(x, lengths)
        out = aligned_rows(value_like(x, flat), n_clients, self.d)
        if b == 0:
            return out.zero_()
        sized = stacked_view(x, y, lengths)
        size = self.chunk_length(flat, *sized, rows=self.linear is not None)
        weights = partial(difference_weights, clip=clip, clip_diff=clip_diff, gamma=gamma,
                          b=divisor or b, clipping=clipping)
        if self.linear is not None:
            self.linear.clipped_difference_mean(flat, flat_before, x, y, size, out, weights,
                                                lengths=lengths)
            return zero_empty(out, lengths)
        if self.chunk_bytes is not None:  # two tapes at once
            size = max(1, size // 2)
        self.tapes.clipped_difference_mean(flat, flat_before, x, y, size, out, weights,
                                           group_size=self.group_length(flat, *sized, size,
                                                                        tapes=2),
                                           lengths=lengths)
        return zero_empty(out, lengths)

    def chunk_length(self, flat: Tensor, x: Tensor, y: Tensor, *, rows: bool) -> int:
        """Samples per chunk for inputs like ``x [C, b, ...]``: ``chunk_size`` (a linear model's
        closed form: ``b``), capped by ``chunk_bytes`` // :meth:`sample_bytes` when a budget is
        set; ``rows``: whole ``[n, d]`` per-sample gradient rows are materialised."""
        size = max(1, x.shape[1]) if self.linear is not None else self.chunk_size
        if self.chunk_bytes is None:
            return size
        per_sample = self.sample_bytes(flat, x, y, rows=rows)
        return max(1, min(size, self.chunk_bytes // per_sample))

    def group_length(self, flat: Tensor, x: Tensor, y: Tensor, chunk: int, *,
                     tapes: int = 1) -> int:
        """Samples per group of chunks (:meth:`~dpfl.models.tape.TapeEngine.groups`), ``tapes``
        tapes a sample: what ``group_bytes`` (at most ``chunk_bytes``) of per-sample values
        hold, at least one chunk. No result depends on it."""
        budget = min(self.group_bytes, self.chunk_bytes or self.group_bytes)
        return max(chunk, budget // (tapes * self.sample_bytes(flat, x, y, rows=False)))

    def sample_bytes(self, flat: Tensor, x: Tensor, y: Tensor, *, rows: bool) -> int:
        """Bytes of per-sample values one sample of ``x [C, b, ...]`` adds to a chunk, counted
        once per input shape and dtype (:meth:`TapeEngine.sample_bytes`; a linear model's
        closed form: :meth:`ClosedFormLinear.sample_bytes`)."""
        key = (x.shape[2:], x.dtype, rows)
        if key not in self._sample_bytes:
            self._sample_bytes[key] = (self.linear.sample_bytes(x) if self.linear is not None
                                       else self.tapes.sample_bytes(flat, x, y, rows=rows))
        return self._sample_bytes[key]


def finite_mean(model: FlatModel, flat: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """``[d]``: one client's (``x [1, b, ...]``) mean-loss gradient over its records whose
    per-sample loss and gradient are finite, the others contributing zero (still divided by b),
    or zero if even that is not finite; the records left out are counted in ``model.dropped``.
    The client's message is clipped after this (Clip21's τ, the quantile family's C), so any
    value of it is covered (:meth:`FlatModel.batch_gradients`' fallback for such a client)."""
    b = x.shape[1]
    total = flat.new_zeros(model.d)
    losses = flat.new_empty(1, b)
    kept = 0
    for _, start, rows in model.per_sample_rows(flat, x, y, losses):
        keep = (torch.isfinite(rows).all(dim=1)
                & torch.isfinite(losses[0, start:start + len(rows)]))
        total += rows[keep].sum(dim=0)
        kept += int(keep.sum())
    mean = total / b
    if non_finite_rows(mean[None]) is not None:
        mean.zero_()
        kept = 0
    model.dropped.count += b - kept
    return mean
