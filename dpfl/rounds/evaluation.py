"""The server's evaluation of the global model on its own data."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from dpfl.problem import Problem

QUANTILES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # of τ_q (eval-norm-quantiles)
EVAL_BATCH = 4096  # records per per-sample-gradient pass of an evaluation


class Evaluator:
    """Test loss and accuracy of a model on the problem's test set, and, with ``eval-train``
    or ``eval-norm-quantiles`` (non-private diagnostics: the server reads the training data),
    the training objective, ‖∇F‖ and τ_q."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem

    @functools.cached_property
    def test_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        ds, device = self.problem.dataset, self.problem.device
        return ds.test_x.to(device), ds.test_y.to(device)

    @functools.cached_property
    def train_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        ds, device = self.problem.dataset, self.problem.device
        return ds.train_x.to(device), ds.train_y.to(device)

    def test_loss(self, params: torch.Tensor) -> float:
        """The test loss of ``params`` (the start of the divergence check)."""
        with torch.no_grad():
            return float(self.problem.model.evaluate(params, *self.test_set)["loss"])

    def __call__(self, params: torch.Tensor) -> dict[str, Any]:
        """Test loss/accuracy of ``params`` (and, with eval-train, the full training objective
        and ‖∇F‖; with eval-norm-quantiles, τ_q)."""
        model, config = self.problem.model, self.problem.config
        with torch.no_grad():
            res = model.evaluate(params, *self.test_set)
        out = {"test_loss": float(res["loss"]),
               "test_accuracy": None if res.get("accuracy") is None else float(res["accuracy"])}
        if config["eval-train"]:
            x, y = self.train_set
            with torch.no_grad():
                out["train_loss_full"] = float(model.evaluate(params, x, y)["loss"])
            grad = model.full_gradient(params, x, y)
            out["grad_norm"] = float(torch.linalg.vector_norm(grad.double()))
        if config["eval-norm-quantiles"]:
            out["tau_q_nonprivate"] = self.norm_quantile_ratios(params)
        return out

    def norm_quantile_ratios(self, params: torch.Tensor) -> dict[str, float]:
        """τ_q(x) = Q_q({‖∇ℓ_z(x)‖²}_z)/mean_z ‖∇ℓ_z(x)‖² over the whole training set, for
        q ∈ QUANTILES."""
        x, y = self.train_set
        squares = torch.cat([
            torch.linalg.vector_norm(rows.double(), dim=1).square()
            for start in range(0, len(x), EVAL_BATCH)
            for _, _, rows in self.problem.model.per_sample_gradient_chunks(
                params, x[start:start + EVAL_BATCH].unsqueeze(0),
                y[start:start + EVAL_BATCH].unsqueeze(0))])
        mean = squares.mean()
        levels = torch.tensor(QUANTILES, dtype=squares.dtype, device=squares.device)
        return {f"{q:g}": float(v / mean) if mean > 0 else math.nan
                for q, v in zip(QUANTILES, torch.quantile(squares, levels).tolist())}
