"""The server's evaluation of the global model on its own data."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from dpfl.problem import Problem

QUANTILES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # of τ_q (eval-norm-quantiles)
EVAL_BATCH = 4096  # records per per-sample-gradient pass of an evaluation
#: the server's evaluation sets, in the order a record lists them: the test set, and the
#: validation split a dataset may hold out of its training rows (``num_validation``)
SERVER_SETS = ("test", "validation")
#: the keys an evaluation writes for them (those of a set the dataset lacks are left out)
SET_METRICS = tuple(f"{name}_{metric}" for name in SERVER_SETS for metric in ("loss", "accuracy"))


class Evaluator:
    """Loss and accuracy of a model on the server's own data: the problem's test set and, where
    the dataset holds one out (dataset option ``num_validation``), its validation split; no
    client's data. With ``eval-train`` or ``eval-norm-quantiles`` (non-private diagnostics: the
    server reads the training data), also the training objective, ‖∇F‖ and τ_q."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem

    @functools.cached_property
    def server_sets(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The :data:`SERVER_SETS` the dataset has, on the device, by name."""
        ds, device = self.problem.dataset, self.problem.device
        sets = {name: (getattr(ds, f"{name}_x"), getattr(ds, f"{name}_y")) for name in SERVER_SETS}
        return {name: (x.to(device), y.to(device)) for name, (x, y) in sets.items()
                if y is not None}

    @functools.cached_property
    def train_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        ds, device = self.problem.dataset, self.problem.device
        return ds.train_x.to(device), ds.train_y.to(device)

    def test_loss(self, params: torch.Tensor) -> float:
        """The test loss of ``params`` (the start of the divergence check)."""
        with torch.no_grad():
            return float(self.problem.model.evaluate(params, *self.server_sets["test"])["loss"])

    def __call__(self, params: torch.Tensor) -> dict[str, Any]:
        """``<set>_loss``/``<set>_accuracy`` of ``params`` on each of :attr:`server_sets`
        (``test_loss``, ``test_accuracy``, then ``validation_loss``, ``validation_accuracy``
        where there is a validation split); with eval-train, also the full training objective
        and ‖∇F‖; with eval-norm-quantiles, τ_q."""
        model, config = self.problem.model, self.problem.config
        out: dict[str, Any] = {}
        for name, data in self.server_sets.items():
            with torch.no_grad():
                res = model.evaluate(params, *data)
            accuracy = res.get("accuracy")
            out[f"{name}_loss"] = float(res["loss"])
            out[f"{name}_accuracy"] = None if accuracy is None else float(accuracy)
        if config.evaluation.eval_train:
            x, y = self.train_set
            with torch.no_grad():
                out["train_loss_full"] = float(model.evaluate(params, x, y)["loss"])
            grad = model.full_gradient(params, x, y)
            out["grad_norm"] = float(torch.linalg.vector_norm(grad.double()))
        if config.evaluation.eval_norm_quantiles:
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
