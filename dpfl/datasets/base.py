"""The in-memory dataset every loader returns, and its natural per-client split."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from dpfl.datasets.population import Population

TASKS = ("classification", "binary", "regression")


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test pair of dense tensors (and the splits held out of the training rows) and
    the learning task they pose.

    Compared and hashed by identity (``eq=False``): two loads are equal only when
    they are the same object, which :func:`dpfl.datasets.load_dataset` returns for
    repeated identical requests. Treat the tensors as read-only; they are shared.

    Parameters
    ----------
    name : str
        The registered name it was loaded under.
    train_x, test_x : torch.Tensor
        float32 features, ``[n, *input_shape]``; int64 for integer inputs (token ids) of a
        dataset by reference (:mod:`dpfl.datasets.reference`).
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
    validation_x, validation_y : torch.Tensor | None
        A validation split held out of the training rows (the dataset option
        ``num_validation``), for choosing hyperparameters without the test set: disjoint from
        the public records and from every client's data, never partitioned. Like the test
        set, the server's own data: it evaluates the global model on it, no client reads it.
    population : Population | None
        Clients whose training rows are made when a round needs them
        (:mod:`dpfl.datasets.population`): ``train_x``/``train_y`` then hold no row (only the
        input's shape and dtype), and the population is the natural split.
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
    validation_x: torch.Tensor | None = None
    validation_y: torch.Tensor | None = None
    population: Population | None = None

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
    def num_validation(self) -> int:
        """Number of validation records (0 when there are none)."""
        return 0 if self.validation_y is None else len(self.validation_y)

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


#: the splits :func:`hold_out` draws out of the training rows, in the order it draws them
HELD_OUT = ("public", "validation")


def hold_out(dataset: Dataset, seed: int, *, num_public: int = 0, num_validation: int = 0,
             candidates: tuple[torch.Tensor, torch.Tensor] | None = None) -> Dataset:
    """``dataset`` with ``num_public`` public records, then ``num_validation`` validation
    records (:data:`HELD_OUT`), each drawn uniformly without replacement by one generator
    seeded with ``seed``: from the training rows (which then lose them) or, given
    ``candidates`` (``[k, ...]`` features and labels, e.g. the records a training subset left
    out), from those; the validation records from what the public draw left. The public draw
    is the generator's first, so it does not depend on ``num_validation``. A size of 0 holds
    nothing out (``dataset`` itself when both are); the result has no natural per-client split
    (``client_sizes``)."""
    pool_x, pool_y = (dataset.train_x, dataset.train_y) if candidates is None else candidates
    rng = np.random.default_rng(seed)
    left = np.arange(len(pool_y))
    held: dict[str, torch.Tensor] = {}
    for split, size in zip(HELD_OUT, (num_public, num_validation), strict=True):
        if size == 0:
            continue
        _check_size(f"num_{split}", size, len(left))
        picks = np.sort(rng.choice(len(left), size, replace=False))
        rows = torch.from_numpy(left[picks])
        held[f"{split}_x"], held[f"{split}_y"] = pool_x[rows], pool_y[rows]
        left = np.delete(left, picks)
    if not held:
        return dataset
    if candidates is None:
        keep = torch.from_numpy(left)
        held["train_x"], held["train_y"] = dataset.train_x[keep], dataset.train_y[keep]
    return replace(dataset, client_sizes=None, **held)


def _check_size(option: str, size: object, pool: int) -> None:
    """A ConfigError unless ``size`` records can be drawn from ``pool`` leaving one."""
    from dpfl.errors import ConfigError

    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size < pool:
        raise ConfigError("dataset-options", f"{option} must be between 1 and {pool - 1}, "
                          f"got {size!r}", allowed=f"1..{pool - 1}, or 0 for none")
