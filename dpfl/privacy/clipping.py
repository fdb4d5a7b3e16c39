"""Clipping operators over flattened vectors (whole-model ℓ2 norm).

``clip_C(g) = min(1, C/||g||)·g`` (PriSMA eq. 3; Clip21 eq. 4), applied to the
last axis; a zero vector is returned unchanged.
"""

from __future__ import annotations

import torch


def clip_factors(norms: torch.Tensor, clip: torch.Tensor | float) -> torch.Tensor:
    """``min(1, C/||g||)`` for the given norms, 1 where the norm is zero. A factor below the
    normal range (a norm above C·2^126) keeps few bits: it is rounded toward zero, so that it
    never lifts a clipped norm above C."""
    clip = torch.as_tensor(clip, dtype=norms.dtype, device=norms.device)
    tiny = torch.finfo(norms.dtype).tiny
    factors = torch.where(norms > clip, clip / norms.clamp_min(tiny), torch.ones_like(norms))
    return torch.where(factors < tiny, torch.nextafter(factors, torch.zeros_like(factors)),
                       factors)


def l2_norms(vectors: torch.Tensor) -> torch.Tensor:
    """ℓ2 norms along the last axis, also where the sum of squares underflows to 0 or
    overflows to inf while the norm itself does not (those rows are recomputed scaled by their
    largest entry; the others are ``vector_norm``'s, bit for bit)."""
    norms = torch.linalg.vector_norm(vectors, dim=-1)
    odd = (norms == 0) | torch.isinf(norms)
    if not bool(odd.any()):
        return norms
    scale = vectors.abs().amax(dim=-1, keepdim=True)
    scale = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
    scaled = torch.linalg.vector_norm(vectors / scale, dim=-1) * scale.squeeze(-1)
    return torch.where(odd, scaled, norms)


def clip_by_norm(vectors: torch.Tensor, clip: torch.Tensor | float) -> torch.Tensor:
    """Clip each vector along the last axis to ℓ2 norm at most ``clip``.

    ``clip`` is a scalar or broadcasts against ``vectors.shape[:-1]``.
    """
    return vectors * clip_factors(l2_norms(vectors), clip).unsqueeze(-1)
