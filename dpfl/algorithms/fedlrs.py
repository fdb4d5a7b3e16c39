"""FedLRS: local DP-SGD with bounded local update regularisation and local update sparsification.

Cheng, Wang, Zhang, Cheng, "Differentially Private Federated Learning with Local Regularization
and Sparsification", CVPR 2022 (arXiv:2203.03106), run as the PCDP-SGD paper's federated
baseline (Sha et al., arXiv:2312.03792 v1, §3.2: every baseline runs record-level DP-SGD inside
its clients, although FedLRS was designed for client-level DP). Neither paper gives the
coefficients, and the PCDP paper's description does not fix the exact form of either
technique; the forms below are dpfl's reading (docs/algorithms.md).

**BLUR** (bounded local update regularisation). The local loss of client i gets the penalty
λ·max(0, ‖w − w_g‖ − C_u) on the local update's norm above a bound C_u, whose gradient
λ(w − w_g)/‖w − w_g‖ (0 inside the bound) is added to each per-sample gradient before clipping,
as FedProx's μ(w − w_g) (:meth:`~dpfl.algorithms.local_dpsgd.LocalDPSGD.noisy_gradient`)::

    g̃_k = (1/b) (Σ_j clip_C(∇ℓ_j(w_k) + ∇R(w_k)) + N(0, σ²C² I)),   w_{k+1} = w_k − η g̃_k
    ∇R(w) = λ(w − w_g)/‖w − w_g‖ if ‖w − w_g‖ > C_u, else 0

**LUS** (local update sparsification). After K such steps the client keeps the round(p·d) (at
least one) entries of its update Δ_i = w_g − w_K of largest magnitude, ties to the earlier
position, zeroes the others and uploads the sparse Δ̃_i; the server steps as FedAvg,
w_g ← w_g − γ_g·mean_i Δ̃_i.

Privacy: DP-FedAvg's (:class:`~dpfl.algorithms.adaptive.DPFedAvg`). The regulariser's gradient
is a function of the client's current iterate and the broadcast model only, so each per-sample
vector is still clipped to norm C; the upload is a function of the noisy steps (post-processing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dpfl.algorithms.base import ClientContext, Cohort, Exchange, ServerContext, State, Upload
from dpfl.algorithms.local_dpsgd import FederatedDPSGD, FederatedHyperparameters, NoisyStep
from dpfl.algorithms.registry import ALGORITHMS
from dpfl.config import Param, at_least, hyperparameter, positive

BLUR_WEIGHT = Param("blur-weight", 1.0, "FedLRS: BLUR's weight λ: the local loss gets "
                    "λ·max(0, ‖w − w_g‖ − C_u), whose gradient λ(w − w_g)/‖w − w_g‖ above the "
                    "bound is added to each per-sample gradient before clipping; 0 = no BLUR.",
                    check=at_least(0.0), symbol="λ")
BLUR_BOUND = Param("blur-bound", 20.0, "FedLRS: BLUR's bound C_u on the local update's norm "
                   "‖w − w_g‖, above which the penalty acts (default: the median update norm of "
                   "FedLRS without BLUR on digits at the defaults, 19.6; docs/defaults.md).",
                   check=positive, symbol="C_u")
LUS_FRACTION = Param("lus-fraction", 0.5, "FedLRS: the fraction p of the update's d entries LUS "
                     "uploads, the round(p·d) (at least one) of largest magnitude, the others "
                     "zeroed; 1 = no sparsification.",
                     check=lambda v: None if 0 < v <= 1 else f"must be in (0, 1], got {v}",
                     symbol="p")


@dataclass(frozen=True)
class FedLRSHyperparameters(FederatedHyperparameters):
    blur_weight: float = hyperparameter(BLUR_WEIGHT)  # λ
    blur_bound: float = hyperparameter(BLUR_BOUND)  # C_u
    lus_fraction: float = hyperparameter(LUS_FRACTION)  # p


def blur_gradient(params: Tensor, x: Tensor, weight: float, bound: float) -> Tensor:
    """``[C, d]``: the gradient of λ·max(0, ‖w − w_g‖ − C_u) at each client's iterate
    (``params``, from the broadcast ``x``): λ(w − w_g)/‖w − w_g‖ above the bound, 0 within."""
    update = params - x
    norms = torch.linalg.vector_norm(update, dim=1, keepdim=True)
    scale = torch.where(norms > bound, weight / norms.clamp(min=bound), norms.new_zeros(()))
    return update * scale


def kept_entries(d: int, fraction: float) -> int:
    """How many of d entries LUS keeps: round(p·d), at least one."""
    return max(1, math.floor(fraction * d + 0.5))


def sparsify(update: Tensor, fraction: float) -> Tensor:
    """``[C, d]``: each row's :func:`kept_entries` entries of largest magnitude, the others
    zeroed; among equal magnitudes the earlier position is kept (a stable sort), so a row's
    result does not depend on the other rows."""
    keep = kept_entries(update.shape[-1], fraction)
    if keep >= update.shape[-1]:
        return update
    order = torch.sort(update.abs(), dim=-1, descending=True, stable=True).indices[..., :keep]
    return torch.zeros_like(update).scatter_(-1, order, update.gather(-1, order))


@ALGORITHMS.register_class
class FedLRS(FederatedDPSGD[FedLRSHyperparameters]):
    """FedLRS (BLUR + LUS) around K local DP-SGD steps; see the module docstring."""

    name = "fedlrs"
    Hyperparameters = FedLRSHyperparameters
    protection = ("record-level local DP per client: K local DP-SGD steps per round at a fixed "
                  "clip, noised on the client (BLUR's gradient is added before clipping); the "
                  "sparsified update is post-processing of the noisy steps")
    exchanges = (Exchange("train", ("x", "radius"),
                          {"delta": Upload("train", post_processing=True)}),)

    def step_gradient(self, x: Tensor, cohort: Cohort, radius: float, broadcast: State,
                      ctx: ClientContext) -> NoisyStep:
        """DP-SGD's noisy gradient with BLUR's gradient added to each per-sample gradient
        (λ = 0: DP-SGD's own)."""
        hp = self.hp

        def gradient(params: Tensor, k: int) -> tuple[Tensor, Tensor]:
            offset = (blur_gradient(params, x, hp.blur_weight, hp.blur_bound)
                      if hp.blur_weight else None)
            return self.local.noisy_gradient(params, x, self.local.batches(cohort, k, ctx),
                                             radius, k, ctx, offset=offset)
        return gradient

    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: ClientContext) -> tuple[State, State]:
        """K local steps, then LUS: the sparsified update Δ̃_i of Δ_i = w_g − w_K (its norm
        before sparsification diagnosed as ``update-norm``)."""
        x = broadcast["x"].to(ctx.device)
        params, states = self.local_steps(x, cohort, states, broadcast, ctx)
        update = x - params
        ctx.diagnose("update-norm", torch.linalg.vector_norm(update, dim=1))
        return {"delta": sparsify(update, self.hp.lus_fraction).cpu()}, states

    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        """w_g ← w_g − γ_g·mean_i Δ̃_i."""
        update = sums["delta"] / len(ctx.participants)
        return {"x": state["x"] - self.hp.server_learning_rate * update,
                "radius": state["radius"]}


__all__ = ["FedLRS", "FedLRSHyperparameters", "blur_gradient", "sparsify"]
