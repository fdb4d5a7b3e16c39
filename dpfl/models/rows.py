"""The row helpers every per-sample gradient path shares: 64-byte-aligned memory (what makes a
client's result independent of the others in its call), non-finite rows found and dropped, the
chunks and groups samples are processed in, and the clip weights computed from norms."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from dpfl.privacy.clipping import FLAT, ClippingFunction, clip_factors



class LayerRule(Protocol):
    """What a layer holds of its per-sample rule (:class:`dpfl.models.grad_samplers.Rule`, which
    the rules' registry makes): the gradients from the tape's (a, g), and whether the tape keeps
    the layer's whole call."""

    @property
    def per_sample(self) -> Callable[[Layer, Any, Any], list[Tensor]]: ...

    @property
    def whole(self) -> bool: ...

ALIGNMENT = 64  # bytes; PyTorch's CPU allocator aligns every fresh tensor to this


@dataclass(frozen=True, eq=False)  # compared and hashed by identity
class Layer:
    """A layer with trainable parameters, the rule that forms their per-sample gradients
    (:mod:`dpfl.models.grad_samplers`), and where they sit in the flat vector."""

    module: nn.Module
    rule: LayerRule
    names: tuple[str, ...]  # its trainable parameters, as module.named_parameters() names them
    slices: tuple[slice, ...]  # flat positions of the trainable ones, in that order
    shapes: tuple[torch.Size, ...]

    @property
    def trainable(self) -> tuple[bool, bool]:
        """Whether its ``weight`` and its ``bias`` are trainable (the rules of layers made of
        those two)."""
        return "weight" in self.names, "bias" in self.names

    def parts(self, vector: Tensor) -> list[Tensor]:
        """``vector [d]``'s pieces for the layer's trainable parameters, in their shapes."""
        return [vector[s].view(shape) for s, shape in zip(self.slices, self.shapes)]


def value_like(x: Tensor, point: Tensor) -> Tensor:
    """What per-sample values take their dtype and device from: the inputs ``x``, or the point
    where the inputs are not floating-point (token ids)."""
    return x if x.is_floating_point() else point


def aligned(t: Tensor) -> Tensor:
    """``t`` itself if contiguous and 64-byte aligned, else an aligned copy (same values)."""
    if t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def aligned_rows(like: Tensor, n: int, d: int) -> Tensor:
    """An uninitialised ``[n, d]`` tensor whose every row starts on a 64-byte boundary: the
    first ``d`` columns of ``[n, d']``, ``d'`` rounded up to a whole number of boundaries.

    MKL's result depends on where its output sits (measured on an AVX-512 CPU: a client's clipped
    mean written into row 1 of a ``[4, d]`` tensor, 40 bytes past a 64-byte boundary, differs in
    the last bit from the same mean written at offset 0); on aligned rows every client's kernels
    see the same alignment whatever ``C`` is, with no copy."""
    per = max(1, ALIGNMENT // like.element_size())
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


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether two points hold the same bits (not only equal values: −0.0 and 0.0, and NaNs,
    are told apart), so that every number computed at one is the number computed at the
    other."""
    word = _WORDS.get(a.dtype.itemsize)
    if word is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():  # the same memory
        return True
    a, b = a.reshape(-1).view(word), b.reshape(-1).view(word)
    # points apart (a local step later) differ at once: a look at the first entries settles it
    return torch.equal(a[:_FIRST], b[:_FIRST]) and torch.equal(a, b)


_FIRST = 64  # entries same_bits compares before the whole points


_WORDS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # an integer of each float's width


def zero_rows(t: Tensor, rows: Tensor) -> Tensor:
    """``t`` with the rows (first axis) set in ``rows`` ``[n]`` replaced by zeros, out of place:
    masked, not multiplied (0 × NaN is NaN)."""
    return t.masked_fill(rows_mask(rows, t), 0)


def rows_mask(rows: Tensor, t: Tensor) -> Tensor:
    """``rows [n]`` as a mask that broadcasts over ``t [n, ...]``'s rows."""
    return rows.view(-1, *(1,) * (t.dim() - 1))


class Dropped:
    """The records dropped for a non-finite gradient (:mod:`dpfl.models.functional`), counted
    until :meth:`take`."""

    def __init__(self) -> None:
        self.count = 0

    def drop(self, bad: Tensor, *values: Tensor) -> None:
        """Zero the samples ``bad`` ``[n]`` in the rows of each of ``values`` (``[n, ...]``, the
        caller's own memory), in place, and count them."""
        for v in values:
            v.masked_fill_(rows_mask(bad, v), 0)
        self.count += int(bad.sum())

    def take(self) -> int:
        """The count since the last call; it starts again from 0."""
        count, self.count = self.count, 0
        return count


class InputSquares:
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
class Chunk:
    """One chunk of one client's samples (:meth:`~dpfl.models.tape.TapeEngine.groups`), at
    ``pos`` in its group: its data, the parameters it is taken at (and at a second point, for a
    difference), and the regulariser's (or an offset's) gradient added to each of its
    per-sample gradients."""

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

    @property
    def values(self) -> Tensor:
        """What its per-sample values take their dtype and device from (:func:`value_like`)."""
        return value_like(self.x, self.params[0])


def chunks(x: Tensor, y: Tensor, size: int):
    """(start, x, y) for one client's records ``x [n, ...]``, ``y [n]`` in fixed-size chunks of
    ``size`` samples, each on aligned memory."""
    for start in range(0, len(x), size):
        yield start, aligned(x[start:start + size]), aligned(y[start:start + size])


def client_records(x: Tensor, y: Tensor, lengths: Sequence[int] | None = None
                   ) -> Iterator[tuple[Tensor, Tensor]]:
    """Each client's records, in order: the rows of ``x [C, b, ...]``, ``y [C, b]``, or with
    ``lengths`` (a ragged batch, as Poisson sampling draws it) the clients' records packed one
    after another, ``x [Σ lengths, ...]``, ``y [Σ lengths]``."""
    if lengths is None:
        yield from zip(x, y)
        return
    start = 0
    for n in lengths:
        yield x[start:start + n], y[start:start + n]
        start += n


def batch_shape(x: Tensor, lengths: Sequence[int] | None) -> tuple[int, int]:
    """``(C, b)``: the clients and the longest batch of ``x`` (:func:`client_records`)."""
    return (x.shape[0], x.shape[1]) if lengths is None else (len(lengths), max(lengths, default=0))


def stacked_view(x: Tensor, y: Tensor, lengths: Sequence[int] | None) -> tuple[Tensor, Tensor]:
    """``x [C, n, ...]``, ``y [C, n]`` as given, or a ragged batch's records as one row
    ``[1, Σ lengths, ...]``: what sizes a batch's chunks (the record shape, and n at least any
    client's length, which is all a chunk's length reads)."""
    return (x, y) if lengths is None else (x[None], y[None])


def zero_empty(out: Tensor, lengths: Sequence[int] | None) -> Tensor:
    """``out [C, ...]`` with the rows of the clients without records (``lengths[c] == 0``,
    which no chunk writes) zeroed."""
    for c, n in enumerate(lengths or ()):
        if n == 0:
            out[c].zero_()
    return out


def record_means(values: Tensor, lengths: Sequence[int] | None, divisor: int | None = None
                 ) -> Tensor:
    """``[C]``: each client's sum of ``values [C, n]`` over its records (its first
    ``lengths[c]``; all n without ``lengths``) divided by ``divisor`` (default: its number of
    records), 0 for a client without records. Client by client on its own records, so that
    a client's value does not depend on the others' lengths."""
    if lengths is None:
        n = values.shape[1]
        return values.mean(dim=1) if divisor in (None, n) else values.sum(dim=1) / divisor
    return torch.stack([values[c, :n].sum() / (divisor or n) if n else values.new_zeros(())
                        for c, n in enumerate(lengths)])


def client_radii(clip: float | Tensor, n_clients: int) -> list[float]:
    """One float32-representable radius per client, so that a radius given as a Python float
    and the same radius in a float32 tensor clip identically."""
    radii = torch.as_tensor(clip, dtype=torch.float32).reshape(-1).expand(n_clients).tolist()
    if not all(0 < r < float("inf") for r in radii):
        raise ValueError(f"clip radii must be positive and finite, got {clip}")
    return radii


def sample_radii(radii: list[float], group: list[Chunk]) -> float | Tensor:
    """The clip radius of every sample of ``group``, from each chunk's (``radii``, in the
    group's order): one float when they are one."""
    if len(set(radii)) == 1:
        return radii[0]
    return torch.cat([torch.full((chunk.n,), r) for chunk, r in zip(group, radii, strict=True)])


def difference_weights(sq: Tensor, sq_before: Tensor, dots: Tensor, *, clip: float,
                       clip_diff: float | None, gamma: float, b: int,
                       clipping: ClippingFunction = FLAT) -> tuple[Tensor, Tensor]:
    """The weights ``(w, w̃)`` of ``Σ_j w_j g_j + Σ_j w̃_j g̃_j`` in
    :meth:`~dpfl.models.FlatModel.clipped_difference_mean`, from ‖g_j‖², ‖g̃_j‖² and
    ⟨g_j, g̃_j⟩: α_j, α̃_j are ``clipping``'s factors at C, β_j the flat clip's at C3."""
    alpha = clipping.factors(sq.clamp_min(0).sqrt(), clip)
    alpha_before = clipping.factors(sq_before.clamp_min(0).sqrt(), clip)
    diff_sq = (alpha.square() * sq + alpha_before.square() * sq_before
               - 2 * alpha * alpha_before * dots)
    beta = (torch.ones_like(alpha) if clip_diff is None
            else clip_factors(diff_sq.clamp_min(0).sqrt(), clip_diff))
    return (gamma + (1 - gamma) * beta) * alpha / b, -(1 - gamma) * beta * alpha_before / b
