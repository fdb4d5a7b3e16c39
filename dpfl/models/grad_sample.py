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
groups), which oneDNN runs about as fast as the ordinary weight gradient, except for layers with
few input channels, where an explicit im2col + ``bmm`` is faster.
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
        if layer.groups == 1 and layer.in_channels < _UNFOLD_BELOW_CHANNELS:
            patches = _unfold(layer, a, g.shape[2:])
            grad = torch.bmm(g.reshape(n, g.shape[1], -1), patches.transpose(1, 2))
        else:
            grad = _grouped_weight_grad(layer, a, g)
        out.append(grad.reshape(n, -1))
    if trainable[1]:
        out.append(g.sum(dim=(2, 3)))
    return out


# Below this many input channels (per group) oneDNN's grouped weight gradient wastes most of its
# vector lanes, and an explicit im2col + bmm is faster (measured: 1 and 3 channels, 4-5× faster;
# at 8 and more channels, and in general for big unfolds, the grouped kernel wins).
_UNFOLD_BELOW_CHANNELS = 8


def _unfold(layer: nn.Conv2d, a: Tensor, out_hw: torch.Size) -> Tensor:
    """im2col of ``a`` as ``[n, c·kh·kw, L]`` (L output positions), via a strided view and one
    copy (``F.unfold`` is several times slower on CPU)."""
    ph, pw = layer.padding
    if ph or pw:
        a = F.pad(a, (pw, pw, ph, ph))
    n, c = a.shape[:2]
    kh, kw = layer.kernel_size
    (sh, sw), (dh, dw) = layer.stride, layer.dilation
    s = a.stride()
    patches = a.as_strided(
        (n, c, kh, kw, out_hw[0], out_hw[1]),
        (s[0], s[1], s[2] * dh, s[3] * dw, s[2] * sh, s[3] * sw),
    )
    return patches.reshape(n, c * kh * kw, out_hw[0] * out_hw[1])


def _grouped_weight_grad(layer: nn.Conv2d, a: Tensor, g: Tensor) -> Tensor:
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
        [0, 0],
        n * layer.groups,
        [False, True, False],
    )[1]


def _group_norm(
    layer: nn.Module, a: Tensor, g: Tensor, trainable: tuple[bool, bool]
) -> list[Tensor]:
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
        name = type(layer).__name__
        raise TypeError(f"per-sample gradients: no rule for {name} (supported: {allowed})")
    if isinstance(layer, nn.Conv2d) and (
        isinstance(layer.padding, str) or layer.padding_mode != "zeros"
    ):
        raise TypeError("per-sample gradients: Conv2d needs numeric zero padding")


def materialise(
    layer: nn.Module, a: Tensor, g: Tensor, trainable: tuple[bool, bool]
) -> list[Tensor]:
    """Per-sample gradients ``[n, numel]`` of the layer's trainable (weight, bias)."""
    return RULES[type(layer)](layer, a, g, trainable)


def has_ghost(layer: nn.Module, a: Tensor) -> bool:
    """Whether the norm and weighted-sum shortcuts apply (a ``Linear`` on ``[n, in]`` inputs)."""
    return type(layer) is nn.Linear and a.dim() == 2


def ghost_sq_norms(a: Tensor, g: Tensor, trainable: tuple[bool, bool],
                   a_sq: Tensor | None = None) -> Tensor:
    """Σ over the layer's trainable parameters of ‖per-sample gradient‖², shape ``[n]``;
    ``a_sq``: the inputs' ‖a_j‖², when already computed."""
    g_sq = g.square().sum(dim=1)
    if a_sq is None and trainable[0]:
        a_sq = a.square().sum(dim=1)
    sq = g_sq * a_sq if trainable[0] else torch.zeros_like(g_sq)
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


def ghost_add_weighted_sum(
    a: Tensor,
    g: Tensor,
    trainable: tuple[bool, bool],
    w: Tensor,
    targets: list[Tensor],
    beta: float,
) -> None:
    """targets ← β·targets + Σ_j w_j · (per-sample gradients of the layer's trainable
    parameters), in one weighted GEMM: ``(w∘g)ᵀ a`` for the weight, ``gᵀ w`` for the bias."""
    parts = iter(targets)
    if trainable[0]:
        next(parts).addmm_(g.mul(w.unsqueeze(1)).t(), a, beta=beta)
    if trainable[1]:
        next(parts).addmv_(g.t(), w, beta=beta)
