"""``Linear``: the per-sample gradient ``Σ_t g_t a_tᵀ`` (one term for ``[n, in]`` inputs, one
per position t of a sequence ``[n, T, in]``; Goodfellow 2015), and the "ghost" shortcuts that
give its norms, inner products and weighted sums without forming it (Li et al. 2022, arXiv
2110.05679, §4; Bu et al. 2023):

- ``[n, in]`` inputs: ‖g_j a_jᵀ‖² = ‖g_j‖²·‖a_j‖², and Σ_j w_j g_j a_jᵀ = (w∘G)ᵀA, one GEMM;
- sequences: ‖Σ_t g_t a_tᵀ‖² = Σ_{t,s} (g_t·g_s)(a_t·a_s), the Gram trick: ``n·T²·(in + out)``
  multiply-adds instead of ``n·T·in·out`` and no ``[n, out, in]`` tensor; taken where it is
  the cheaper (:func:`has_ghost`); the weighted sum is one GEMM over the ``n·T`` rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from dpfl.models.grad_samplers.registry import register

if TYPE_CHECKING:
    from dpfl.models.rows import Layer


@register(nn.Linear)
def linear(layer: Layer, a: Tensor, g: Tensor) -> list[Tensor]:
    return rows(a, g, layer.trainable)


def rows(a: Tensor, g: Tensor, trainable: tuple[bool, bool]) -> list[Tensor]:
    """The per-sample gradients ``[n, out·in]`` of a weight and ``[n, out]`` of a bias (those
    ``trainable``) of ``y = W a + b`` from its inputs ``a`` (``[n, in]`` or ``[n, ..., in]``)
    and output gradients ``g``: ``Σ_t g_t a_tᵀ`` and ``Σ_t g_t`` (also the recurrent layers'
    rule, :mod:`dpfl.models.grad_samplers.recurrent`, with a gate's pre-activation gradients
    as ``g``)."""
    n = a.shape[0]
    weight, bias = trainable
    out: list[Tensor] = []
    if weight:
        if a.dim() == 2:
            out.append(torch.bmm(g.unsqueeze(2), a.unsqueeze(1)).reshape(n, -1))
        else:
            out.append(torch.einsum("n...i,n...j->nij", g, a).reshape(n, -1))
    if bias:
        out.append(g.reshape(n, -1, g.shape[-1]).sum(dim=1))
    return out


def has_ghost(module: nn.Module, a: Tensor) -> bool:
    """Whether the ghost shortcuts apply: a ``Linear`` on ``[n, in]`` inputs, or on sequences
    ``[n, T, in]`` (any axes between the first and last flattened into T) where the Gram trick
    is cheaper than the gradient, T² < in·out / (in + out) (Li et al. 2022, §4.1)."""
    if type(module) is not nn.Linear:
        return False
    if a.dim() == 2:
        return True
    assert isinstance(module, nn.Linear)
    positions = a[0].numel() // a.shape[-1]
    d_in, d_out = module.in_features, module.out_features
    return positions * positions * (d_in + d_out) < d_in * d_out


def has_products(module: nn.Module, a: Tensor) -> bool:
    """Whether per-sample gradients of two sets of records have ghost inner products
    ``(Δ_1Δ_2ᵀ)∘(A_1A_2ᵀ)`` (:mod:`dpfl.models.span`): a ``Linear`` on ``[n, in]`` inputs."""
    return type(module) is nn.Linear and a.dim() == 2


def _sequences(a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``a``, ``g`` as ``[n, T, in]``, ``[n, T, out]``."""
    return a.reshape(len(a), -1, a.shape[-1]), g.reshape(len(g), -1, g.shape[-1])


def ghost_sq_norms(a: Tensor, g: Tensor, trainable: tuple[bool, bool],
                   a_sq: Tensor | None = None) -> Tensor:
    """Σ over the layer's trainable parameters of ‖per-sample gradient‖², shape ``[n]``;
    ``a_sq``: the inputs' ‖a_j‖² (``[n, in]`` inputs), when already computed."""
    if a.dim() > 2:
        return ghost_pair_dots(a, g, a, g, trainable)
    g_sq = g.square().sum(dim=1)
    if a_sq is None and trainable[0]:
        a_sq = a.square().sum(dim=1)
    sq = g_sq * a_sq if trainable[0] else torch.zeros_like(g_sq)
    return sq + g_sq if trainable[1] else sq


def ghost_pair_dots(a: Tensor, g: Tensor, a2: Tensor, g2: Tensor,
                    trainable: tuple[bool, bool]) -> Tensor:
    """``[n]``: ⟨Σ_t g_t a_tᵀ, Σ_s g̃_s ã_sᵀ⟩ = Σ_{t,s} (g_t·g̃_s)(a_t·ã_s) per sample (plus
    (Σ_t g_t)·(Σ_s g̃_s) for the bias) for two tapes of one sequence layer on the same
    samples."""
    a, g = _sequences(a, g)
    a2, g2 = _sequences(a2, g2)
    out = a.new_zeros(len(a))
    if trainable[0]:
        out = out + (torch.bmm(g, g2.transpose(1, 2)) * torch.bmm(a, a2.transpose(1, 2))
                     ).sum(dim=(1, 2))
    if trainable[1]:
        out = out + (g.sum(dim=1) * g2.sum(dim=1)).sum(dim=1)
    return out


def ghost_dots(a: Tensor, g: Tensor, trainable: tuple[bool, bool], r: list[Tensor]) -> Tensor:
    """⟨per-sample gradient_j, r⟩ for the layer, with ``r`` = [r_weight [out,in], r_bias [out]]
    for its trainable parameters: ``Σ_t g_tᵀ R a_t + Σ_t g_tᵀ r_b``, shape ``[n]``."""
    dots = torch.zeros(a.shape[0], dtype=a.dtype, device=a.device)
    parts = iter(r)
    if a.dim() > 2:
        a, g = _sequences(a, g)
        if trainable[0]:
            dots = dots + (torch.matmul(a, next(parts).t()) * g).sum(dim=(1, 2))
        if trainable[1]:
            dots = dots + torch.matmul(g.sum(dim=1), next(parts))
        return dots
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
    parameters), in one weighted GEMM: ``(w∘g)ᵀ a`` for the weight, ``gᵀ w`` for the bias (over
    the ``n·T`` rows of a sequence, each position weighted by its sample's w_j)."""
    if a.dim() > 2:  # the n·T positions as rows, each weighted by its sample's w_j
        a, g = _sequences(a, g)
        w = w.repeat_interleave(a.shape[1])
        a, g = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
    parts = iter(targets)
    if trainable[0]:
        next(parts).addmm_(g.mul(w.unsqueeze(1)).t(), a, beta=beta)
    if trainable[1]:
        next(parts).addmv_(g.t(), w, beta=beta)
