"""Normalisation layers that normalise each sample alone — ``GroupNorm``, ``LayerNorm`` and
affine ``InstanceNorm1d/2d/3d`` — so that with ``x̂`` the sample's input normalised without
the affine map (the layer's own statistics, recomputed from its input), the per-sample gradient
of the scale γ is ``Σ x̂ ∘ g`` and of the shift β ``Σ g``, summed over every axis the
parameter is shared along (Opacus' ``group_norm``, ``layer_norm``, ``instance_norm``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor, nn

from dpfl.models.grad_samplers.registry import register

if TYPE_CHECKING:
    from dpfl.models.rows import Layer


def _affine(layer: Layer, normalised: Tensor, g: Tensor, per_channel: bool) -> list[Tensor]:
    """The scale's and shift's per-sample gradients: summed over the positions (``[n, C,
    ...]`` per channel), or over the leading axes of ``[n, ..., *normalized_shape]``."""
    n = g.shape[0]
    if per_channel:
        def total(t: Tensor) -> Tensor:
            return t.reshape(n, g.shape[1], -1).sum(dim=2)
    else:
        numel = layer.shapes[0].numel()

        def total(t: Tensor) -> Tensor:
            return t.reshape(n, -1, numel).sum(dim=1)
    weight, bias = layer.trainable
    out: list[Tensor] = []
    if weight:
        out.append(total(normalised * g))
    if bias:
        out.append(total(g))
    return out


@register(nn.GroupNorm)
def group_norm(layer: Layer, a: Tensor, g: Tensor) -> list[Tensor]:
    module = layer.module
    assert isinstance(module, nn.GroupNorm)
    weight = layer.trainable[0]
    normalised = F.group_norm(a, module.num_groups, eps=module.eps) if weight else a
    return _affine(layer, normalised, g, per_channel=True)


@register(nn.LayerNorm)
def layer_norm(layer: Layer, a: Tensor, g: Tensor) -> list[Tensor]:
    module = layer.module
    assert isinstance(module, nn.LayerNorm)
    weight = layer.trainable[0]
    normalised = F.layer_norm(a, module.normalized_shape, eps=module.eps) if weight else a
    return _affine(layer, normalised, g, per_channel=False)


@register(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
def instance_norm(layer: Layer, a: Tensor, g: Tensor) -> list[Tensor]:
    module = layer.module
    assert isinstance(module, nn.InstanceNorm1d | nn.InstanceNorm2d | nn.InstanceNorm3d)
    weight = layer.trainable[0]
    normalised = F.instance_norm(a, eps=module.eps) if weight else a
    return _affine(layer, normalised, g, per_channel=True)
