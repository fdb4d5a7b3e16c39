"""Per-sample losses, by the name a run config gives them.

Every loss maps model outputs ``[n, ...]`` and targets ``[n, ...]`` to the ``n`` per-sample
losses (no reduction), which is what per-sample clipping needs. A loss also says how to score a
prediction: ``correct`` gives a boolean per sample, or is ``None`` for regression.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dpfl.registry import Registry


@dataclass(frozen=True)
class Loss:
    """A per-sample loss, for classification tasks its correctness test, and the derivative
    of each sample's loss with respect to that sample's outputs (``[n, ...]``, the outputs'
    shape), which gives linear models their gradients without autograd."""

    per_sample: Callable[[Tensor, Tensor], Tensor]
    correct: Callable[[Tensor, Tensor], Tensor] | None = None
    output_grad: Callable[[Tensor, Tensor], Tensor] | None = None


LOSSES: Registry[Loss] = Registry("loss")


def _scores(outputs: Tensor) -> Tensor:
    """The one real output per sample of a binary or scalar-regression model, as ``[n]``."""
    if outputs[0].numel() != 1:
        raise ValueError(f"expected one output per sample, got shape {tuple(outputs.shape)}")
    return outputs.reshape(-1)


def _cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(outputs, targets.long(), reduction="none")


def _cross_entropy_grad(outputs: Tensor, targets: Tensor) -> Tensor:
    grad = torch.softmax(outputs, dim=1)
    grad[torch.arange(len(grad)), targets.long()] -= 1  # softmax − one-hot
    return grad


def _argmax_correct(outputs: Tensor, targets: Tensor) -> Tensor:
    return outputs.argmax(dim=1) == targets


def _logistic(outputs: Tensor, targets: Tensor) -> Tensor:
    # log(1 + exp(-y f)) = softplus(-y f), stable for large |f|.
    f = _scores(outputs)
    return F.softplus(-targets.reshape(-1).to(f.dtype) * f)


def _logistic_grad(outputs: Tensor, targets: Tensor) -> Tensor:
    # d/df softplus(-y f) = -y·sigmoid(-y f)
    y = targets.reshape(-1).to(outputs.dtype)
    return (-y * torch.sigmoid(-y * _scores(outputs))).reshape(outputs.shape)


def _sign_correct(outputs: Tensor, targets: Tensor) -> Tensor:
    f = _scores(outputs)
    return torch.where(f >= 0, 1.0, -1.0) == targets.reshape(-1).to(f.dtype)


def _squared(outputs: Tensor, targets: Tensor) -> Tensor:
    n = outputs.shape[0]
    residual = outputs.reshape(n, -1) - targets.reshape(n, -1).to(outputs.dtype)
    return 0.5 * residual.square().sum(dim=1)


def _squared_grad(outputs: Tensor, targets: Tensor) -> Tensor:
    return outputs - targets.reshape(outputs.shape).to(outputs.dtype)


LOSSES.add("cross-entropy", Loss(_cross_entropy, _argmax_correct, _cross_entropy_grad))
LOSSES.add("logistic", Loss(_logistic, _sign_correct, _logistic_grad))  # labels in {-1, +1}
LOSSES.add("squared", Loss(_squared, None, _squared_grad))  # ½ (f - y)², regression
