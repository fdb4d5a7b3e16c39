"""A layer's call as the tape keeps it for a whole-module rule
(:mod:`dpfl.models.grad_samplers.fallback`): its arguments, or its output gradients, with every
tensor that holds one entry per sample moved so that the samples lead, and how to put each one
back for a call on one sample."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dpfl.models.rows import zero_rows

#: a nested structure of tuples, lists and dicts with tensors and other values at its leaves
Tree = Any
#: the batch axis of every leaf of a tree (None: shared by every sample, or not a tensor)
Dims = Any


def flatten(tree: Tree) -> tuple[list[Any], Callable[[list[Any]], Tree]]:
    """The leaves of ``tree`` (tuples, lists and dicts are walked, anything else is a leaf), in
    order, and the function that builds a tree of the same shape from other leaves."""
    if isinstance(tree, (tuple, list)):
        parts = [flatten(item) for item in tree]
        sizes = [len(leaves) for leaves, _ in parts]

        def rebuild(leaves: list[Any]) -> Tree:
            items, start = [], 0
            for (_, build), size in zip(parts, sizes):
                items.append(build(leaves[start:start + size]))
                start += size
            return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)

        return [leaf for leaves, _ in parts for leaf in leaves], rebuild
    if isinstance(tree, dict):
        keys = list(tree)
        leaves, build = flatten([tree[k] for k in keys])
        return leaves, lambda new: dict(zip(keys, build(new)))
    return [tree], lambda new: new[0]


@dataclass(frozen=True)
class Batched:
    """A tree whose tensors with a batch axis were moved to lead with the samples (each
    ``leaves[i]`` was batched along ``dims[i]``; None: a leaf every sample shares)."""

    leaves: tuple[Any, ...]
    dims: tuple[int | None, ...]
    rebuild: Callable[[list[Any]], Tree]

    @classmethod
    def of(cls, tree: Tree, dims: Dims, n: int, what: str) -> Batched:
        """``tree`` detached, its leaves with a batch axis in ``dims`` (a tree of the same
        shape, or one value for every leaf) moved to the front; ``ValueError`` (naming
        ``what``) where such a leaf does not hold ``n`` samples."""
        leaves, rebuild = flatten(tree)
        axes = flatten(dims)[0] if isinstance(dims, (tuple, list, dict)) else [dims] * len(leaves)
        moved, kept = [], []
        for leaf, dim in zip(leaves, axes, strict=True):
            if not isinstance(leaf, Tensor) or dim is None:
                moved.append(leaf.detach() if isinstance(leaf, Tensor) else leaf)
                kept.append(None)
                continue
            if leaf.dim() <= dim or leaf.shape[dim] != n:
                raise ValueError(f"per-sample gradients: {what} is called on a tensor of shape "
                                 f"{tuple(leaf.shape)} without the batch's {n} samples on "
                                 f"axis {dim}")
            moved.append(leaf.detach().movedim(dim, 0))
            kept.append(dim)
        return cls(tuple(moved), tuple(kept), rebuild)

    def rows(self, start: int, stop: int) -> Batched:
        """The samples ``start:stop``."""
        return self.map(lambda t: t[start:stop])

    def zeroed(self, bad: Tensor) -> Batched:
        """The samples ``bad [n]`` zeroed, out of place."""
        return self.map(lambda t: t.masked_fill(bad.view(-1, *(1,) * (t.dim() - 1)), 0))

    def map(self, f: Callable[[Tensor], Tensor]) -> Batched:
        return Batched(tuple(leaf if dim is None else f(leaf)
                             for leaf, dim in zip(self.leaves, self.dims)),
                       self.dims, self.rebuild)

    @property
    def batched(self) -> list[Tensor]:
        """The leaves with a batch axis (samples leading), in order."""
        return [leaf for leaf, dim in zip(self.leaves, self.dims) if dim is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.batched)

    def one_sample(self, batched: list[Tensor]) -> Tree:
        """The tree for one sample, from its entries ``batched`` of :attr:`batched` (each
        without the sample axis, as ``torch.func.vmap`` hands them): each put back on its own
        batch axis as a batch of one, the shared leaves as they are."""
        parts = iter(batched)
        return self.rebuild([leaf if dim is None else next(parts).unsqueeze(dim)
                             for leaf, dim in zip(self.leaves, self.dims)])


def rows_of(value: Tensor | Batched, start: int, stop: int) -> Tensor | Batched:
    """The samples ``start:stop`` of a tape's input or output gradient."""
    return value.rows(start, stop) if isinstance(value, Batched) else value[start:stop]


def floats(tree: Tree) -> list[Tensor]:
    """The floating-point tensors of ``tree``, in order: the outputs a gradient flows to."""
    return [leaf for leaf in flatten(tree)[0]
            if isinstance(leaf, Tensor) and torch.is_floating_point(leaf)]


@dataclass(frozen=True)
class Outputs:
    """The outputs of a call the tape tracks (its floating-point ones, in order), each with the
    axis that holds its ``n`` samples; ``what`` names the layer."""

    tensors: tuple[Tensor, ...]
    dims: tuple[int | None, ...]
    n: int
    what: str

    def gradients(self, grads: Sequence[Tensor | None]) -> Batched:
        """The outputs' gradients (None: an output the loss does not use, zero), samples
        leading."""
        full = tuple(torch.zeros_like(t) if g is None else g
                     for t, g in zip(self.tensors, grads, strict=True))
        return Batched.of(full, self.dims, self.n, self.what)


def zeroed(value: Tensor | Batched, bad: Tensor) -> Tensor | Batched:
    """A tape's input or output gradient with the samples ``bad [n]`` zeroed, out of place."""
    return value.zeroed(bad) if isinstance(value, Batched) else zero_rows(value, bad)
