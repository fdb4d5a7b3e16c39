"""Synthetic regression problems of the papers, generated from the run seed.

The seed fixes the problem instance (ground truth and samples): the same seed
gives identical tensors, in any process. Test sets are a second, independent
draw from the same instance.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dpfl.datasets.base import Dataset, hold_out
from dpfl.datasets.loading import DATASETS, positive_int


def _tensors(*arrays: np.ndarray) -> list[torch.Tensor]:
    return [torch.from_numpy(a.astype(np.float32)) for a in arrays]


@DATASETS.register("prisma-least-squares")
def load_prisma_least_squares(
    *,
    seed: int,
    num_clients: int = 10,
    samples_per_client: int = 2000,
    duplicate: int = 1,
    dim: int = 10,
) -> Dataset:
    """PriSMA's first experiment (Figure 1, eq. 22): distributed least squares, ``b = aᵀx* + φ``.

    ``a_ij ~ U[-1, 1]^dim``, ``x* ~ N(0, I_dim)``, ``φ_ij ~ N(0, 2)`` (variance 2).
    Each of the ``num_clients`` (M) clients draws ``samples_per_client`` (N) rows,
    which are repeated ``duplicate`` (l) times, so F(x) is the same for every l.
    Rows are ordered client by client: client i owns rows ``[i·N·l, (i+1)·N·l)``,
    its natural split (``client_sizes``, partitioner ``natural``). The paper's
    regulariser belongs to the model, not the data. Task ``"regression"``; the
    test set is an independent draw of N rows.
    """
    clients = positive_int("num-clients", num_clients)
    per_client = positive_int("samples-per-client", samples_per_client)
    copies = positive_int("duplicate", duplicate)
    dim = positive_int("dim", dim)
    rng = np.random.default_rng(seed)
    x_star = rng.standard_normal(dim)

    def draw(rows: int) -> tuple[np.ndarray, np.ndarray]:
        a = rng.uniform(-1.0, 1.0, size=(rows, dim))
        return a, a @ x_star + rng.normal(0.0, math.sqrt(2.0), size=rows)

    a, b = draw(clients * per_client)
    blocks = [np.arange(i * per_client, (i + 1) * per_client) for i in range(clients)]
    rows = np.concatenate([np.tile(block, copies) for block in blocks])
    train_x, train_y, test_x, test_y = _tensors(a[rows], b[rows], *draw(per_client))
    return Dataset(
        "prisma-least-squares",
        train_x,
        train_y,
        test_x,
        test_y,
        task="regression",
        num_classes=1,
        client_sizes=(per_client * copies,) * clients,
    )


QUADRATIC_RADIUS = math.sqrt(7.8)


@DATASETS.register("quadratic")
def load_quadratic(
    *, seed: int, num_samples: int = 3000, dim: int = 100, num_test: int = 1000
) -> Dataset:
    """AdaptDP-FedAvg's synthetic quadratic (Fukami et al., §5; we complete what it leaves
    unstated): ``ℓ_i(x) = ½(z_iᵀ(x − b))²``.

    ``z_i ~ N(0, I_dim)``; the reference ``b`` is uniform on the sphere of radius
    √7.8, so ``f(0) ≈ 3.9`` (our calibration guess). Written as regression
    with features ``z_i`` and targets ``y_i = z_iᵀb``, so the squared-error loss
    ``½(z_iᵀx − y_i)²`` is the per-sample loss above and interpolation holds at
    ``x = b``. Defaults: n = 3000, d = 100; the test set is ``num_test`` fresh rows.
    """
    rows = positive_int("num-samples", num_samples)
    dim = positive_int("dim", dim)
    rng = np.random.default_rng(seed)
    direction = rng.standard_normal(dim)
    b = QUADRATIC_RADIUS * direction / np.linalg.norm(direction)
    z_train = rng.standard_normal((rows, dim))
    z_test = rng.standard_normal((positive_int("num-test", num_test), dim))
    train_x, train_y, test_x, test_y = _tensors(z_train, z_train @ b, z_test, z_test @ b)
    return Dataset("quadratic", train_x, train_y, test_x, test_y, task="regression", num_classes=1)


@DATASETS.register("synthetic-cifar10")
def load_synthetic_cifar10(*, seed: int, num_train: int = 500, num_test: int = 100,
                           num_validation: int = 0) -> Dataset:
    """CIFAR-10-shaped stand-in (``[n, 3, 32, 32]`` float32 in [−1, 1], 10 classes) for smoke
    runs without the real data: each class is a fixed random image, each sample that image
    plus uniform noise, clipped; labels uniform. Learnable, not CIFAR. ``num_validation`` of
    the ``num_train`` rows are held out as a validation split (:func:`hold_out`)."""
    rng = np.random.default_rng(seed)
    prototypes = rng.uniform(-1.0, 1.0, size=(10, 3, 32, 32))

    def draw(rows: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.integers(0, 10, size=rows)
        images = prototypes[labels] + rng.uniform(-1.0, 1.0, size=(rows, 3, 32, 32))
        return np.clip(images, -1.0, 1.0), labels

    (train_x, train_y), (test_x, test_y) = (draw(positive_int("num-train", num_train)),
                                            draw(positive_int("num-test", num_test)))
    dataset = Dataset("synthetic-cifar10", *_tensors(train_x), torch.from_numpy(train_y),
                      *_tensors(test_x), torch.from_numpy(test_y), task="classification",
                      num_classes=10)
    return hold_out(dataset, seed, num_validation=num_validation)
