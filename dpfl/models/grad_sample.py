"""Per-sample gradients of one layer, from its input ``a`` and its output gradient ``g``: the
entry the tape engine calls.

For a loss that is a sum of per-sample losses and a model in which samples do not interact
(no BatchNorm), ``g[j]`` is sample j's gradient with respect to the layer output, so every
per-sample parameter gradient is a function of ``(a[j], g[j])`` alone (Goodfellow 2015; Opacus'
``grad_sample``). Two kinds of layer rule:

- :func:`materialise`: the per-sample gradients, one ``[n, numel]`` tensor per trainable
  parameter of the layer, in the layer's ``names`` order, by the layer type's rule in
  :mod:`dpfl.models.grad_samplers` (or the generic one);
- for a ``Linear`` layer, the "ghost" shortcuts (Li et al. 2022, Bu et al. 2023;
  :mod:`dpfl.models.grad_samplers.linear`): norms, inner products and weighted sums without
  forming ``Σ_t g_t a_tᵀ``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from dpfl.models.grad_samplers.linear import (
    ghost_add_weighted_sum,
    ghost_dots,
    ghost_pair_dots,
    ghost_sq_norms,
    has_ghost,
    has_products,
)
from dpfl.models.rows import Layer


def materialise(layer: Layer, a: Any, g: Any) -> list[Tensor]:
    """Per-sample gradients ``[n, numel]`` of the layer's trainable parameters, from the
    tape's input ``a`` and output gradient ``g``."""
    return layer.rule.per_sample(layer, a, g)


__all__ = ["ghost_add_weighted_sum", "ghost_dots", "ghost_pair_dots", "ghost_sq_norms",
           "has_ghost", "has_products", "materialise"]
