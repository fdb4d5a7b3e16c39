"""quickstart-dp: the model, the data and the private federation both apps share."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dpfl import PrivateFederation


class Net(nn.Module):
    """A small CNN for 28×28 grey images (GroupNorm, not BatchNorm: a batch norm mixes the
    samples of a batch, which per-sample clipping cannot allow)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)
        self.norm1 = nn.GroupNorm(4, 16)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.norm1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _idx(path: Path) -> np.ndarray:
    with gzip.open(path) as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * dims).reshape(shape)


def load_mnist(data_dir: Path, seed: int, max_train_records: int = 0):
    """MNIST's training and test images, scaled and standardised, from the four files in
    ``<data_dir>/mnist``; ``max_train_records`` keeps that many training images (0: all)."""
    def images(name: str) -> np.ndarray:
        x = _idx(data_dir / "mnist" / name).astype(np.float32)[:, None] / 255.0
        return (x - 0.1307) / 0.3081

    train_x, train_y = images("train-images-idx3-ubyte.gz"), _idx(
        data_dir / "mnist" / "train-labels-idx1-ubyte.gz").astype(np.int64)
    if max_train_records:
        keep = np.random.default_rng(seed).permutation(len(train_y))[:max_train_records]
        train_x, train_y = train_x[keep], train_y[keep]
    test_x, test_y = images("t10k-images-idx3-ubyte.gz"), _idx(
        data_dir / "mnist" / "t10k-labels-idx1-ubyte.gz").astype(np.int64)
    return train_x, train_y, test_x, test_y


def test(net: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """The mean cross-entropy loss and the accuracy of ``net`` on ``(x, y)``."""
    net.eval()
    with torch.no_grad():
        logits = net(torch.from_numpy(x))
        labels = torch.from_numpy(y)
        return (F.cross_entropy(logits, labels).item(),
                (logits.argmax(1) == labels).float().mean().item())


def federation(run_config) -> PrivateFederation:
    """The private run of this app's run config: DPSGD-GC, each client's ε at most
    ``epsilon`` (δ = 1e-5, record-level)."""
    return PrivateFederation(
        "dpsgd-gc", model=Net, data=load_mnist,
        num_clients=int(run_config["num-clients"]),
        num_rounds=int(run_config["num-server-rounds"]),
        epsilon=float(run_config["epsilon"]),
        hyperparameters={"learning-rate": float(run_config["learning-rate"]),
                         "clip": float(run_config["clip"]),
                         "batch-size": int(run_config["batch-size"])},
        options={"dataset-options": f"max_train_records={run_config['max-train-records']}"})
