"""Distributed DPSGD-GC (specs/prisma.md §3.1; Abadi et al. 2016; Li et al. 2024).

Per round t and client i, with a fresh batch B_i^t of b records drawn uniformly
without replacement::

    v_i^t   = (1/b) Σ_{j∈B_i^t} clip_C(∇f_ij(x^t)) + ξ_i^t,   ξ_i^t ~ N(0, σ² I_d)
    x^{t+1} = x^t − η · (1/M) Σ_i v_i^t                       (no server clip, no momentum)

Clipping is per sample on the flattened gradient (eq. 3). The averaged query has
replace-one sensitivity 2C/b (§2.6), so σ = z·2C/b with z the replace-one noise
multiplier; in the Opacus convention of the ``noise-multiplier`` key (std on the
*sum* over C) that is ``noise-multiplier = 2z``. Calibration (§4.4, §8 item 1):
``paper`` uses σ̂ of Theorem 3 / Corollary 1; ``accountant`` the smallest z whose
Opacus ε over T rounds at sampling rate b/N meets the target.
"""

from __future__ import annotations

import torch

from dpfl.algorithms.base import Algorithm, Cohort, Release, State, StepContext
from dpfl.algorithms.registry import ALGORITHMS
from dpfl.privacy import accountant_noise_multiplier, prisma_paper_calibration


@ALGORITHMS.register_class
class DPSGDGC(Algorithm):
    """Per-sample clipped, client-noised SGD with plain averaging, one step per round."""

    name = "dpsgd-gc"
    calibrations = ("accountant", "paper")
    protection = "record-level local DP per client (replace-one neighbours), client-side noise"

    def releases(self, num_samples: int) -> list[Release]:
        cfg = self.config
        b, rounds = int(cfg["batch-size"]), int(cfg["num-server-rounds"])
        q = b / num_samples
        if cfg["noise-multiplier"] >= 0:
            z = float(cfg["noise-multiplier"]) / 2  # Opacus convention -> replace-one
        elif cfg["calibration"] == "paper":
            z = prisma_paper_calibration(epsilon=cfg["epsilon"], delta=cfg["delta"],
                                         batch_size=b, num_samples=num_samples,
                                         rounds=rounds).noise_multiplier
        else:
            z = accountant_noise_multiplier(epsilon=cfg["epsilon"], delta=cfg["delta"],
                                            sample_rate=q, steps=rounds,
                                            accountant=cfg["accountant"])
        return [Release("train", noise_multiplier=z, sample_rate=q, steps=1)]

    def server_step(self, exchange: str, state: State, uploads: State,
                    participants: list[int], round: int) -> State:
        step = uploads["v"].mean(dim=0)
        return {"x": state["x"] - float(self.config["learning-rate"]) * step}

    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: StepContext) -> tuple[State, State, dict[str, torch.Tensor]]:
        b, clip = int(self.config["batch-size"]), float(self.config["clip"])
        x, y = cohort.sample(ctx.rng, ctx.round, "batch", b)
        x, y = x.to(ctx.device), y.to(ctx.device)
        params = broadcast["x"].to(ctx.device)
        losses = torch.empty(len(cohort), b, device=ctx.device)
        mean, norms = self.model.clipped_mean(params, x, y, clip, losses=losses)
        std = ctx.noise_multiplier(exchange) * (2 * clip / b)
        v = ctx.add_noise(mean, cohort, std, poolable=True)  # the server only averages v_i
        metrics = {"train-loss": losses.mean(dim=1).cpu(),
                   "clipped-fraction": (norms > clip).float().mean(dim=1).cpu()}
        return {"v": v.cpu()}, states, metrics
