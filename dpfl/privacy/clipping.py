"""Clipping operators over flattened vectors (whole-model ℓ2 norm).

``clip_C(g) = min(1, C/||g||)·g`` (PriSMA eq. 3; Clip21 eq. 4), applied to the
last axis; a zero vector is returned unchanged.
"""

from __future__ import annotations

import torch


def clip_factors(norms: torch.Tensor, clip: torch.Tensor | float) -> torch.Tensor:
    """``min(1, C/||g||)`` for the given norms, 1 where the norm is zero."""
    clip = torch.as_tensor(clip, dtype=norms.dtype, device=norms.device)
    return torch.where(norms > clip, clip / norms.clamp_min(torch.finfo(norms.dtype).tiny),
                       torch.ones_like(norms))


def clip_by_norm(vectors: torch.Tensor, clip: torch.Tensor | float) -> torch.Tensor:
    """Clip each vector along the last axis to ℓ2 norm at most ``clip``.

    ``clip`` is a scalar or broadcasts against ``vectors.shape[:-1]``.
    """
    norms = torch.linalg.vector_norm(vectors, dim=-1)
    return vectors * clip_factors(norms, clip).unsqueeze(-1)
