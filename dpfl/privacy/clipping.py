"""Clipping operators over flattened vectors (whole-model ℓ2 norm), and the per-sample clipping
functions.

``clip_C(g) = min(1, C/||g||)·g`` (PriSMA eq. 3; Clip21 eq. 4), applied to the
last axis; a zero vector is returned unchanged.

A per-sample clipping function (run-config key ``clipping-function``: :data:`CLIPPING_FUNCTIONS`)
maps each per-sample gradient g to ``φ_C(g) = w_C(‖g‖)·g``, a scale factor of its norm times g:

* ``flat``: ``w = min(1, C/‖g‖)``, the clip above (Abadi et al. 2016);
* ``auto-s``: ``w = C/(‖g‖ + r)``, automatic clipping (AUTO-S; Bu, Wang, Zha, Karypis,
  "Automatic Clipping: Differentially Private Deep Learning Made Easier and Stronger",
  NeurIPS 2023, arXiv:2206.07136: their eq. (1.1) with Clip_AUTO-S(‖g‖; R) = R/(‖g‖ + γ),
  R = C, the stability constant γ = r = 0.01);
* ``nsgd``: the same function, normalised SGD with a regularising factor (DP-NSGD; Yang, Zhang,
  Chen, Liu, "Normalized/Clipped SGD with Perturbation for Differentially Private Non-Convex
  Optimization", arXiv:2206.13033: g/(‖g‖ + r), with C in front), r = 0.01;
* ``psac``: ``w = C/(‖g‖ + r/(‖g‖ + r))``, per-sample adaptive clipping (DP-PSAC; Xia, Shen,
  Yao, Fu, Xu, Xu, Fu, "Differentially Private Learning with Per-Sample Adaptive Clipping",
  AAAI 2023, arXiv:2212.00328), a weight that is not monotone in ‖g‖, r = 1e-4.

The defaults of r are those of the PCDP-SGD paper's comparison (arXiv:2312.03792, Fig. 3).

Every one bounds a record's share: ``‖φ_C(g)‖ ≤ C`` for flat and ``< C`` for the others
(``C‖g‖/(‖g‖ + r) < C`` and ``C‖g‖/(‖g‖ + r/(‖g‖ + r)) < C``, since r > 0 and ‖g‖ ≥ 0), so the
sensitivity of a sum of clipped per-sample gradients, its noise σC and its accounting are those
of flat clipping at the same C (docs/privacy.md, "Clipping functions").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dpfl.errors import ConfigError
from dpfl.registry import Registry


def clip_factors(norms: torch.Tensor, clip: torch.Tensor | float) -> torch.Tensor:
    """``min(1, C/||g||)`` for the given norms, 1 where the norm is zero. A factor below the
    normal range (a norm above C·2^126) keeps few bits: it is rounded toward zero, so that it
    never lifts a clipped norm above C."""
    clip = torch.as_tensor(clip, dtype=norms.dtype, device=norms.device)
    tiny = torch.finfo(norms.dtype).tiny
    factors = torch.where(norms > clip, clip / norms.clamp_min(tiny), torch.ones_like(norms))
    return toward_zero_below_normal(factors)


def toward_zero_below_normal(factors: torch.Tensor) -> torch.Tensor:
    """``factors``, each below the normal range one step toward zero: a subnormal quotient is
    rounded to an absolute, not a relative, half step, which the step down more than covers, so
    a factor never lifts a clipped norm above its bound (:func:`clip_factors`)."""
    tiny = torch.finfo(factors.dtype).tiny
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


# ---- per-sample clipping functions -------------------------------------------------------------

#: ``weight(norms, C, r)``: the scale factor of each per-sample gradient, from its norm
Weight = Callable[[torch.Tensor, torch.Tensor | float, float], torch.Tensor]


@dataclass(frozen=True)
class ClippingFunction:
    """A per-sample clipping function ``φ_C(g) = weight(‖g‖, C, r)·g`` with ``‖φ_C(g)‖ ≤ C``
    (module docstring), and its stability constant r (``stability``; 0 for flat, which has
    none). ``reference`` names the paper."""

    name: str
    weight: Weight
    stability: float
    reference: str

    def factors(self, norms: torch.Tensor, clip: torch.Tensor | float) -> torch.Tensor:
        """The factor of each per-sample gradient of norm ``norms`` at clip ``clip`` (one
        radius, or one per norm), in ``norms``' dtype. A norm that is not finite gives a factor
        the callers discard: they drop that record (:mod:`dpfl.models.functional`, "Non-finite
        values")."""
        return self.weight(norms, clip, self.stability)

    def at(self, stability: float) -> ClippingFunction:
        """This function with stability constant ``stability`` (0: its own); flat has none."""
        if stability == 0 or stability == self.stability:
            return self
        if self.name == FLAT.name:
            raise ConfigError("clipping-stability", f"clipping-function {self.name!r} has no "
                              f"stability constant r", allowed="0 (the default), or "
                              "clipping-function auto-s, nsgd or psac")
        return dataclasses.replace(self, stability=stability)


def flat_weight(norms: torch.Tensor, clip: torch.Tensor | float, r: float) -> torch.Tensor:
    """``min(1, C/‖g‖)``: :func:`clip_factors` (r unused)."""
    return clip_factors(norms, clip)


def normalised_weight(norms: torch.Tensor, clip: torch.Tensor | float, r: float) -> torch.Tensor:
    """``C/(‖g‖ + r)`` (AUTO-S, DP-NSGD): C/r at ‖g‖ = 0, below C/‖g‖ everywhere."""
    clip = torch.as_tensor(clip, dtype=norms.dtype, device=norms.device)
    return finite_factors(clip / (norms + r))


def psac_weight(norms: torch.Tensor, clip: torch.Tensor | float, r: float) -> torch.Tensor:
    """``C/(‖g‖ + r/(‖g‖ + r))`` (DP-PSAC): C at ‖g‖ = 0, below C/‖g‖ everywhere, and not
    monotone in ‖g‖ (largest, C/(2√r − r), at ‖g‖ = √r − r)."""
    clip = torch.as_tensor(clip, dtype=norms.dtype, device=norms.device)
    shift = torch.as_tensor(r, dtype=norms.dtype, device=norms.device)  # r / t is r·(1/t)
    return finite_factors(clip / (norms + shift / (norms + r)))


def finite_factors(factors: torch.Tensor) -> torch.Tensor:
    """Quotients as factors: one that overflows (a clip near the float range over a small
    denominator) is the largest finite value, so that a zero gradient times it stays zero (an
    inf factor would make it NaN); rounded down only, so no norm bound is lifted. Below the
    normal range: :func:`toward_zero_below_normal`. NaN stays NaN."""
    return toward_zero_below_normal(factors.clamp(max=torch.finfo(factors.dtype).max))


FLAT = ClippingFunction("flat", flat_weight, 0.0,
                        "Abadi et al., Deep Learning with Differential Privacy, arXiv:1607.00133")
AUTO_S = ClippingFunction("auto-s", normalised_weight, 1e-2,
                          "Bu, Wang, Zha, Karypis, Automatic Clipping: Differentially Private "
                          "Deep Learning Made Easier and Stronger, arXiv:2206.07136")
NSGD = ClippingFunction("nsgd", normalised_weight, 1e-2,
                        "Yang, Zhang, Chen, Liu, Normalized/Clipped SGD with Perturbation for "
                        "Differentially Private Non-Convex Optimization, arXiv:2206.13033")
PSAC = ClippingFunction("psac", psac_weight, 1e-4,
                        "Xia, Shen, Yao, Fu, Xu, Xu, Fu, Differentially Private Learning with "
                        "Per-Sample Adaptive Clipping, arXiv:2212.00328")

#: the run-config key ``clipping-function``'s values
CLIPPING_FUNCTIONS: Registry[ClippingFunction] = Registry("clipping-function")
CLIPPING_FUNCTIONS.add(FLAT.name, FLAT)
CLIPPING_FUNCTIONS.add(AUTO_S.name, AUTO_S)
CLIPPING_FUNCTIONS.add(NSGD.name, NSGD)
CLIPPING_FUNCTIONS.add(PSAC.name, PSAC)


def clipping_function(name: str, stability: float = 0.0) -> ClippingFunction:
    """The clipping function ``name`` at stability constant ``stability`` (0: its own)."""
    return CLIPPING_FUNCTIONS.get(name).at(stability)


class PerSampleClipping:
    """What a hyperparameter dataclass that clips per sample reads: the clipping function
    (``clipping_function``, run-config ``clipping-function``) and its r (``clipping_stability``;
    0 = the function's own). The dataclass declares both fields itself, beside the clip they
    go with; :attr:`per_sample_clipping` is the function, checked when the dataclass is
    made."""

    clipping_function: str
    clipping_stability: float

    def __post_init__(self) -> None:
        self.per_sample_clipping  # noqa: B018  (refuses a bad combination: ConfigError)

    @property
    def per_sample_clipping(self) -> ClippingFunction:
        return clipping_function(self.clipping_function, self.clipping_stability)
