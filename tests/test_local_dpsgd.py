"""The local-SGD loop every local-DP-SGD algorithm (and quantile DP-FedAvg) runs, against
PyTorch's own SGD on a loss whose gradient is the step's."""

from __future__ import annotations

import pytest
import torch

from dpfl.algorithms import ALGORITHMS
from dpfl.algorithms.local_dpsgd import FederatedDPSGD, local_sgd


def _torch_sgd(x: torch.Tensor, steps: int, lr: float, momentum: float,
               shift: torch.Tensor) -> torch.Tensor:
    """``steps`` steps of ``torch.optim.SGD`` on ½‖w‖²·s + shift·w per row (s = 1 + row), the
    gradient s·w + shift."""
    w = x.clone().requires_grad_(True)
    scale = torch.arange(1, len(x) + 1, dtype=x.dtype).unsqueeze(1)
    optimizer = torch.optim.SGD([w], lr=lr, momentum=momentum)
    for _ in range(steps):
        optimizer.zero_grad()
        (0.5 * (scale * w * w).sum() + (shift * w).sum()).backward()
        optimizer.step()
    return w.detach()


@pytest.mark.parametrize("momentum", [0.0, 0.6])
@pytest.mark.parametrize("corrected", [False, True])
def test_local_sgd_is_pytorchs_sgd_with_heavy_ball_momentum(momentum, corrected):
    """Each step takes the gradient at the client's current iterate, adds the correction
    (SCAFFOLD's c − c_i: a linear term of the loss) and goes through PyTorch's heavy-ball
    buffers: the same iterates as ``torch.optim.SGD`` on that loss."""
    torch.manual_seed(0)
    x = torch.randn(5, dtype=torch.float64)
    correction = torch.randn(3, 5, dtype=torch.float64) if corrected else None
    scale = torch.arange(1, 4, dtype=torch.float64).unsqueeze(1)
    seen: list[int] = []

    def step(params: torch.Tensor, k: int) -> torch.Tensor:
        seen.append(k)
        return scale * params

    velocity = torch.zeros(3, 5, dtype=torch.float64) if momentum else None
    params, velocity = local_sgd(x, 3, 4, step, 0.1, correction=correction, momentum=momentum,
                                 velocity=velocity)
    shift = correction if corrected else torch.zeros(3, 5, dtype=torch.float64)
    expected = _torch_sgd(x.expand(3, 5), 4, 0.1, momentum, shift)
    assert seen == [0, 1, 2, 3]
    torch.testing.assert_close(params, expected, rtol=1e-12, atol=1e-12)
    assert (velocity is None) == (momentum == 0.0)


def test_the_local_dpsgd_algorithms_are_siblings_on_one_block():
    """DP-FedAvg, AdaptDP-FedAvg, DP-SCAFFOLD and DP-SGD each extend the building block, none
    another of them (a variant by composition, not a subclass of a richer method)."""
    names = ("dp-fedavg", "adaptdp-fedavg", "dp-scaffold", "dp-sgd")
    classes = [ALGORITHMS.get(n) for n in names]
    assert all(issubclass(c, FederatedDPSGD) for c in classes)
    assert not any(issubclass(a, b) for a in classes for b in classes if a is not b)
