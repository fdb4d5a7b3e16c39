"""The in-memory dataset every loader returns, and its natural per-client split."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TASKS = ("classification", "binary", "regression")


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test pair of dense tensors and the learning task they pose.

    Compared and hashed by identity (``eq=False``): two loads are equal only when
    they are the same object, which :func:`dpfl.datasets.load_dataset` returns for
    repeated identical requests. Treat the tensors as read-only; they are shared.

    Parameters
    ----------
    name : str
        The registered name it was loaded under.
    train_x, test_x : torch.Tensor
        float32 features, ``[n, *input_shape]``.
    train_y, test_y : torch.Tensor
        ``"classification"``: int64 class labels in ``0..num_classes-1`` (softmax
        cross-entropy). ``"binary"``: float32 labels in ``{-1, +1}`` (logistic loss
        ``log(1 + exp(-y aᵀx))``). ``"regression"``: float32 targets.
    task : str
        One of :data:`TASKS`.
    num_classes : int
        K for classification, 1 for binary and regression.
    client_sizes : tuple[int, ...] | None
        Sizes of the dataset's natural per-client blocks of contiguous training
        rows (client i owns the i-th block), or None where it has none.
    public_x, public_y : torch.Tensor | None
        Public records held out of the training rows (the dataset option
        ``num_public``): disjoint from every client's data, never partitioned, read
        only by algorithms that project onto a public subspace (PCDP-SGD's D_pub).
    """

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    task: str
    num_classes: int
    client_sizes: tuple[int, ...] | None = None
    public_x: torch.Tensor | None = None
    public_y: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task {self.task!r} is not one of {TASKS}")
        if self.client_sizes is not None and sum(self.client_sizes) != len(self.train_y):
            raise ValueError("client_sizes must add up to the number of training rows")

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input, without the leading sample axis."""
        return tuple(self.train_x.shape[1:])

    @property
    def num_public(self) -> int:
        """Number of public records (0 when there are none)."""
        return 0 if self.public_y is None else len(self.public_y)

    @property
    def num_train(self) -> int:
        """Number of training rows."""
        return len(self.train_y)


def natural_partition(dataset: Dataset) -> list[np.ndarray] | None:
    """The dataset's own per-client split (sorted int64 row indices), or None."""
    if dataset.client_sizes is None:
        return None
    ends = np.cumsum(dataset.client_sizes)
    return [
        np.arange(end - size, end, dtype=np.int64)
        for size, end in zip(dataset.client_sizes, ends, strict=True)
    ]


def with_public(dataset: Dataset, num_public: int, seed: int,
                candidates: np.ndarray | None = None) -> Dataset:
    """``dataset`` with ``num_public`` public records drawn uniformly with ``seed``: from the
    training rows (which then lose them) or, given ``candidates`` (``[k, ...]`` features and
    labels, e.g. the records a training subset left out), from those."""
    from dpfl.errors import ConfigError

    pool_x, pool_y = (dataset.train_x, dataset.train_y) if candidates is None else candidates
    if not 0 < num_public < len(pool_y):
        raise ConfigError("dataset-options", f"num_public must be between 1 and "
                          f"{len(pool_y) - 1}, got {num_public}",
                          allowed=f"1..{len(pool_y) - 1}, or 0 for none")
    picks = np.sort(np.random.default_rng(seed).choice(len(pool_y), num_public, replace=False))
    rows = torch.from_numpy(picks)
    train_x, train_y = dataset.train_x, dataset.train_y
    if candidates is None:
        keep = torch.from_numpy(np.setdiff1d(np.arange(len(pool_y)), picks))
        train_x, train_y = train_x[keep], train_y[keep]
    return Dataset(dataset.name, train_x, train_y, dataset.test_x, dataset.test_y,
                   task=dataset.task, num_classes=dataset.num_classes,
                   public_x=pool_x[rows], public_y=pool_y[rows])
