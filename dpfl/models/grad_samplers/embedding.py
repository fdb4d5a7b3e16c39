"""``Embedding``: sample j's gradient of the table is its output gradients added into the rows
of the tokens it looked up, ``Σ_t e_{x_t} g_tᵀ`` (Opacus' ``embedding``); the row of
``padding_idx`` gets none, as the layer's own backward gives it none. The tape keeps the
token ids as they are: integers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from dpfl.models.grad_samplers.registry import register

if TYPE_CHECKING:
    from dpfl.models.rows import Layer


@register(nn.Embedding)
def embedding(layer: Layer, a: Tensor, g: Tensor) -> list[Tensor]:
    module = layer.module
    assert isinstance(module, nn.Embedding)
    n, width = a.shape[0], module.embedding_dim
    grads = g.new_zeros(n, module.num_embeddings, width)
    index = a.reshape(n, -1, 1).expand(-1, -1, width)
    grads.scatter_add_(1, index, g.reshape(n, -1, width))
    if module.padding_idx is not None:
        grads[:, module.padding_idx] = 0
    return [grads.reshape(n, -1)]
