"""DP-SCAFFOLD: SCAFFOLD's control variates around record-level local DP-SGD.

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", ICML 2020, Algorithm 1 with option II, run with local DP-SGD steps as the
PCDP-SGD paper's extreme non-IID comparison does (its Fig. 4; Sha et al., arXiv:2312.03792 v1).

Each sampled client i starts from the global model x with its control variate c_i and the
server's c, and takes K local steps on the noisy DP-SGD gradient g̃ (per-sample clipping at c,
Gaussian noise, Poisson or fixed-size batches as :mod:`~dpfl.algorithms.local_dpsgd`)::

    y ← y − η(g̃(y) − c_i + c)
    c_i⁺ = c_i − c + (x − y_K)/(Kη)                        (option II)

and uploads Δy_i = y_K − x and Δc_i = c_i⁺ − c_i; the server sets x ← x + γ_g·mean_i Δy_i and
c ← c + (1/N)·Σ_i Δc_i. Both uploads and the client's c_i are functions of the noisy steps and of
public broadcasts only (post-processing): the privacy is DP-FedAvg's, and the correction signals
carry the DP noise, which the PCDP paper gives as the reason SCAFFOLD fails under DP.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dpfl.algorithms.base import ClientContext, Cohort, Exchange, ServerContext, State, Upload
from dpfl.algorithms.local_dpsgd import FederatedDPSGD, FederatedHyperparameters
from dpfl.algorithms.registry import ALGORITHMS


@ALGORITHMS.register_class
class DPSCAFFOLD(FederatedDPSGD[FederatedHyperparameters]):
    """SCAFFOLD (option II) with K local DP-SGD steps; see the module docstring."""

    name = "dp-scaffold"
    Hyperparameters = FederatedHyperparameters
    protection = ("record-level local DP per client: K local DP-SGD steps per round, noised on "
                  "the client; the control variates are post-processing of the noisy steps")
    exchanges = (Exchange("train", ("x", "radius", "c"),
                          {"dy": Upload("train", post_processing=True),
                           "dc": Upload("train", post_processing=True)}),)

    def init_server_state(self, x0: Tensor) -> State:
        return {**super().init_server_state(x0), "c": torch.zeros_like(x0)}

    def broadcast(self, exchange: str, state: State, server_round: int) -> State:
        return {"x": state["x"], "radius": state["radius"], "c": state["c"]}

    def init_client_state(self, num_clients: int) -> State:
        return {"c": torch.zeros(num_clients, self.model.d)}

    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: ClientContext) -> tuple[State, State]:
        hp = self.hp
        x, c = broadcast["x"].to(ctx.device), broadcast["c"].to(ctx.device)
        own = states["c"].to(ctx.device)
        correction = c - own  # the same for every step
        params, _ = self.local_steps(x, cohort, {}, broadcast, ctx, correction=correction)
        dy = params - x
        # c_i − c + (x − y_K)/(Kη) as Δy_i/(−Kη) − (c − c_i): the same bits (negating a
        # difference, a quotient or a divisor is exact), two passes and three [C, d] tensors
        # fewer than the formula's order
        updated = torch.div(dy, -(hp.local_steps * hp.learning_rate)).sub_(correction)
        return {"dy": dy.cpu(), "dc": (updated - own).cpu()}, {"c": updated.cpu()}

    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        x = state["x"] + self.hp.server_learning_rate * sums["dy"] / len(ctx.participants)
        c = state["c"] + sums["dc"] / ctx.num_clients
        return {"x": x, "radius": state["radius"], "c": c}


__all__ = ["DPSCAFFOLD"]
