"""Per-sample gradients of one layer, from its input ``a`` and its output gradient ``g``.

For a loss that is a sum of per-sample losses and a model in which samples do not interact
(no BatchNorm), ``g[j]`` is sample j's gradient with respect to the layer output, so every
per-sample parameter gradient is a function of ``(a[j], g[j])`` alone (Goodfellow 2015; Opacus'
``grad_sample``). Two kinds of layer rule:

- ``materialise(layer, a, g)``: the per-sample gradients, one ``[n, numel]`` tensor per trainable
  parameter of the layer, in ``named_parameters`` order.
- for a ``Linear`` layer on ``[n, in]`` inputs, the "ghost" shortcuts (Li et al. 2022, Bu et al.
  2023): ``‖g_j a_jᵀ‖ = ‖g_j‖·‖a_j‖`` gives the norms without forming ``g_j a_jᵀ``, and
  ``Σ_j w_j g_j a_jᵀ = (w∘g)ᵀa`` gives the clipped sum in one GEMM.

Conv2d per-sample gradients use one grouped ``convolution_backward`` (the batch folded into the
groups), which oneDNN runs about as fast as the ordinary weight gradient; ``F.unfold`` + ``bmm``
is an order of magnitude slower on CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Rule = Callable[[nn.Module, Tensor, Tensor, tuple[bool, bool]], list[Tensor]]


def _linear(layer: nn.Module, a: Tensor, g: Tensor, trainable: tuple[bool, bool]) -> list[Tensor]:
    n = a.shape[0]
    out: list[Tensor] = []
    if trainable[0]:
        if a.dim() == 2:
            out.append(torch.bmm(g.unsqueeze(2), a.unsqueeze(1)).reshape(n, -1))
        else:
            out.append(torch.einsum("n...i,n...j->nij", g, a).reshape(n, -1))
    if trainable[1]:
        out.append(g.reshape(n, -1, g.shape[-1]).sum(dim=1))
    return out


def _conv2d(layer: nn.Module, a: Tensor, g: Tensor, trainable: tuple[bool, bool]) -> list[Tensor]:
    assert isinstance(layer, nn.Conv2d)
    n = a.shape[0]
    out: list[Tensor] = []
    if trainable[0]:
        shape = layer.weight.shape
        weight = layer.weight.detach().expand(n, *shape).reshape(n * shape[0], *shape[1:])
        grad = torch.ops.aten.convolution_backward(
            g.reshape(1, n * g.shape[1], *g.shape[2:]),
            a.reshape(1, n * a.shape[1], *a.shape[2:]),
            weight,
            None,
            list(layer.stride),
            list(layer.padding),
            list(layer.dilation),
            False,
            [0, 0],
            n * layer.groups,
            [False, True, False],
        )[1]
        out.append(grad.reshape(n, -1))
    if trainable[1]:
        out.append(g.sum(dim=(2, 3)))
    return out


def _group_norm(layer: nn.Module, a: Tensor, g: Tensor, trainable: tuple[bool, bool]) -> list[Tensor]:
    assert isinstance(layer, nn.GroupNorm)
    n, c = g.shape[:2]
    out: list[Tensor] = []
    if trainable[0]:
        normalised = F.group_norm(a, layer.num_groups, eps=layer.eps)
        out.append((normalised * g).reshape(n, c, -1).sum(dim=2))
    if trainable[1]:
        out.append(g.reshape(n, c, -1).sum(dim=2))
    return out


RULES: dict[type[nn.Module], Rule] = {
    nn.Linear: _linear,
    nn.Conv2d: _conv2d,
    nn.GroupNorm: _group_norm,
}


def check_supported(layer: nn.Module) -> None:
    """Raise ``TypeError`` unless ``materialise`` can handle this layer's trainable parameters."""
    rule = RULES.get(type(layer))
    if rule is None:
        allowed = ", ".join(t.__name__ for t in RULES)
        raise TypeError(f"per-sample gradients: no rule for {type(layer).__name__} (supported: {allowed})")
    if isinstance(layer, nn.Conv2d) and (isinstance(layer.padding, str) or layer.padding_mode != "zeros"):
        raise TypeError("per-sample gradients: Conv2d needs numeric zero padding")


def materialise(layer: nn.Module, a: Tensor, g: Tensor, trainable: tuple[bool, bool]) -> list[Tensor]:
    """Per-sample gradients ``[n, numel]`` of the layer's trainable (weight, bias)."""
    return RULES[type(layer)](layer, a, g, trainable)


def has_ghost(layer: nn.Module, a: Tensor) -> bool:
    """Whether the norm and weighted-sum shortcuts apply (a ``Linear`` on ``[n, in]`` inputs)."""
    return type(layer) is nn.Linear and a.dim() == 2


def ghost_sq_norms(a: Tensor, g: Tensor, trainable: tuple[bool, bool]) -> Tensor:
    """Σ over the layer's trainable parameters of ‖per-sample gradient‖², shape ``[n]``."""
    g_sq = g.square().sum(dim=1)
    sq = g_sq * a.square().sum(dim=1) if trainable[0] else torch.zeros_like(g_sq)
    return sq + g_sq if trainable[1] else sq


def ghost_dots(a: Tensor, g: Tensor, trainable: tuple[bool, bool], r: list[Tensor]) -> Tensor:
    """⟨per-sample gradient_j, r⟩ for the layer, with ``r`` = [r_weight [out,in], r_bias [out]]
    for its trainable parameters: ``g_jᵀ R a_j + g_jᵀ r_b``, shape ``[n]``."""
    dots = torch.zeros(a.shape[0], dtype=a.dtype, device=a.device)
    parts = iter(r)
    if trainable[0]:
        dots = dots + (torch.mm(a, next(parts).t()) * g).sum(dim=1)
    if trainable[1]:
        dots = dots + torch.mv(g, next(parts))
    return dots


def ghost_weighted_sum(a: Tensor, g: Tensor, trainable: tuple[bool, bool], w: Tensor) -> list[Tensor]:
    """Σ_j w_j · (per-sample gradients of the layer's trainable parameters), flattened."""
    out: list[Tensor] = []
    if trainable[0]:
        out.append(torch.mm((g * w.unsqueeze(1)).t(), a).reshape(-1))
    if trainable[1]:
        out.append(torch.mv(g.t(), w))
    return out
