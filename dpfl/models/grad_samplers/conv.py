"""``Conv1d``, ``Conv2d``, ``Conv3d`` with numeric zero padding: the per-sample weight gradient
is the correlation of sample j's input with its output gradient (Goodfellow 2015; Opacus'
``conv``), from one grouped ``convolution_backward`` in which the batch is folded into the
groups — which oneDNN runs about as fast as the ordinary weight gradient — except for layers
with few input channels, where an explicit im2col + ``bmm`` is faster. The bias's is the output
gradient summed over the positions. Other padding (``"same"``, a ``padding_mode`` other than
zeros) gets the generic rule."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpfl.models.grad_samplers.registry import register

if TYPE_CHECKING:
    from dpfl.models.rows import Layer

Conv = nn.Conv1d | nn.Conv2d | nn.Conv3d

# Below this many input channels (per group) oneDNN's grouped weight gradient wastes most of its
# vector lanes, and an explicit im2col + bmm is faster (measured on Conv2d: 1 and 3 channels,
# 4-5× faster; at 8 and more channels, and in general for big unfolds, the grouped kernel wins).
_UNFOLD_BELOW_CHANNELS = 8


def _numeric_zero_padding(module: nn.Module) -> bool:
    return not isinstance(module.padding, str) and module.padding_mode == "zeros"


@register(nn.Conv1d, nn.Conv2d, nn.Conv3d, applies=_numeric_zero_padding)
def conv(layer: Layer, a: Tensor, g: Tensor) -> list[Tensor]:
    module = layer.module
    assert isinstance(module, Conv)
    n = a.shape[0]
    weight, bias = layer.trainable
    out: list[Tensor] = []
    if weight:
        if module.groups == 1 and module.in_channels < _UNFOLD_BELOW_CHANNELS:
            patches = _unfold(module, a, g.shape[2:])
            grad = torch.bmm(g.reshape(n, g.shape[1], -1), patches.transpose(1, 2))
        else:
            grad = _grouped_weight_grad(module, a, g)
        out.append(grad.reshape(n, -1))
    if bias:
        out.append(g.sum(dim=tuple(range(2, g.dim()))))
    return out


def _unfold(layer: Conv, a: Tensor, out_size: torch.Size) -> Tensor:
    """im2col of ``a`` as ``[n, c·∏k, L]`` (L output positions), via a strided view and one
    copy (``F.unfold`` is several times slower on CPU, and 2-D only)."""
    padding = layer.padding
    if any(padding):
        a = F.pad(a, [p for p in reversed(padding) for _ in range(2)])
    n, c = a.shape[:2]
    s = a.stride()
    spatial = s[2:]
    patches = a.as_strided(
        (n, c, *layer.kernel_size, *out_size),
        (s[0], s[1], *(st * d for st, d in zip(spatial, layer.dilation)),
         *(st * k for st, k in zip(spatial, layer.stride))),
    )
    return patches.reshape(n, c * math.prod(layer.kernel_size), math.prod(out_size))


def _grouped_weight_grad(layer: Conv, a: Tensor, g: Tensor) -> Tensor:
    """Per-sample weight gradients from one weight-gradient convolution in which the batch is
    folded into the groups: sample j is group j (times the layer's own groups)."""
    n = a.shape[0]
    shape = layer.weight.shape
    # only the weight's shape is read: a stride-0 stand-in on a's device (the layer's own weight
    # may sit elsewhere), not n copies of it
    weight = a.new_empty(()).expand(n * shape[0], *shape[1:])
    return torch.ops.aten.convolution_backward(
        g.reshape(1, n * g.shape[1], *g.shape[2:]),
        a.reshape(1, n * a.shape[1], *a.shape[2:]),
        weight,
        None,
        list(layer.stride),
        list(layer.padding),
        list(layer.dilation),
        False,
        [0] * len(layer.stride),
        n * layer.groups,
        [False, True, False],
    )[1]
