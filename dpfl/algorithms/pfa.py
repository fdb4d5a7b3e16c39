"""Simplified PFA: plain local DP-SGD, the update projected onto the public subspace to upload.

Liu, Lou, Xiong, Liu, Meng, "Projected Federated Averaging with Heterogeneous Differential
Privacy", VLDB 2021, in the simplified form the PCDP-SGD paper compares against (Sha et al.,
arXiv:2312.03792 v1, §3.2, footnote 2: "projection only when communication"). The full PFA
splits the clients by privacy level and projects the private clients' updates onto the top
subspace of the public clients' updates; the simplified one projects onto the same public
subspace FedPCDP uses, and takes no step in it.

Each round the server computes V_k^r, the top-k eigenspace of the public records' gradients at
the global model w_g (recomputed every β rounds; :class:`~dpfl.algorithms.projected.
RoundSubspace`, FedPCDP's Algorithm 3), and broadcasts it with the model. Each sampled client
(``fraction-train``) takes K plain local DP-SGD steps from w_g on Poisson batches (no
projection: :class:`~dpfl.algorithms.local_dpsgd.LocalDPSGD`) and uploads the k coordinates of
its update, u_i = V_k^{rT}Δ_i, Δ_i = w_g − w_K^i; the server steps as FedPCDP's Algorithm 2
line 16::

    w_g ← w_g − γ_g·V_k^r·mean_i u_i

Unlike FedPCDP's, the upload loses the part of Δ_i outside span V (its noise too).

Privacy: DP-SGD's (add/remove neighbours, Opacus' analysis), as FedPCDP's: V depends only on
public records and on the global model (already a DP output), so projecting the noisy update
through it is post-processing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dpfl.algorithms.base import ClientContext, Cohort, Exchange, ServerContext, State, Upload
from dpfl.algorithms.local_dpsgd import FederatedDPSGD
from dpfl.algorithms.projected import (
    PUBLIC_RECORDS,
    ROUND_SUBSPACE,
    PublicEigenspace,
    PublicProjectionHyperparameters,
    RoundSubspace,
)
from dpfl.algorithms.registry import ALGORITHMS
from dpfl.algorithms.subspace import GradientBasis

if TYPE_CHECKING:
    from dpfl.models import FlatModel


@ALGORITHMS.register_class
class SimplifiedPFA(FederatedDPSGD[PublicProjectionHyperparameters]):
    """Simplified PFA: K plain local DP-SGD steps, the update's coordinates in the round's public
    subspace uploaded; see the module docstring."""

    name = "pfa-simplified"
    defaults = PUBLIC_RECORDS
    Hyperparameters = PublicProjectionHyperparameters
    protection = ("record-level local DP per client (add/remove neighbours): K local DP-SGD "
                  "steps per round on Poisson batches, noised on the client; the upload is the "
                  "noisy update projected onto a public subspace (post-processing)")
    exchanges = (Exchange("train", ("x", "radius", *ROUND_SUBSPACE),
                          {"u": Upload("train", post_processing=True)}),)

    def __init__(self, hp: PublicProjectionHyperparameters, model: FlatModel, num_clients: int,
                 *, public: tuple[Tensor, Tensor] | None = None) -> None:
        super().__init__(hp, model, num_clients, public=public)
        self.source = PublicEigenspace(self)
        self.round_space = RoundSubspace(self.source, hp.projection_interval)

    def check_run(self, num_rounds: int) -> None:
        """Refuse a run the public records cannot serve (:meth:`PublicEigenspace.check_run`)."""
        self.source.check_run(num_rounds)

    def subspaces_per_run(self, num_rounds: int) -> int:
        """The server's subspaces in ``num_rounds`` rounds: one every β rounds."""
        return math.ceil(num_rounds / self.hp.projection_interval)

    # ---- server --------------------------------------------------------------------------
    def begin_round(self, state: State, ctx: ServerContext) -> State:
        """V_k^r at the global model every β rounds (:class:`RoundSubspace`)."""
        return self.round_space.begin_round(state, ctx)

    def broadcast(self, exchange: str, state: State, server_round: int) -> State:
        return {key: state[key] for key in self.exchanges[0].broadcast}

    def upload_space(self, broadcast: State, device: torch.device) -> GradientBasis:
        """The round's V_k^r, whose coordinates the uploads are written in."""
        return self.round_space.at(broadcast, device)

    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        """w_g ← w_g − γ_g·V·mean_i u_i."""
        x = state["x"]
        update = self.upload_space(state, x.device).lift(
            sums["u"].to(x.device) / len(ctx.participants))
        return {**state, "x": x - self.hp.server_learning_rate * update}

    # ---- client --------------------------------------------------------------------------
    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: ClientContext) -> tuple[State, State]:
        """K plain local DP-SGD steps, then u_i = Vᵀ(w_g − w_K)."""
        x = broadcast["x"].to(ctx.device)
        params, states = self.local_steps(x, cohort, states, broadcast, ctx)
        space = self.upload_space(broadcast, ctx.device)
        # client by client: a client's coordinates do not depend on who shares its call
        u = torch.stack([space.coords(update) for update in x - params])
        return {"u": u.cpu()}, states


__all__ = ["SimplifiedPFA"]
