"""scikit-learn's bundled handwritten digits: the default demo data, no download."""

from __future__ import annotations

import torch

from dpfl.datasets.base import Dataset, hold_out
from dpfl.datasets.loading import DATASETS


@DATASETS.register("digits")
def load_digits(*, seed: int, num_public: int = 0, num_validation: int = 0) -> Dataset:
    """1,797 8×8 digit images, flattened to 64 features scaled to [0, 1] (pixel / 16).

    Train/test is a stratified 80/20 split drawn with ``seed`` (1,437 / 360 rows);
    ``num_public`` of the training rows are held out as public records, then
    ``num_validation`` of the rest as a validation split (:func:`hold_out`).
    """
    from sklearn.datasets import load_digits as sklearn_digits  # imported on use
    from sklearn.model_selection import train_test_split

    bunch = sklearn_digits()
    x = torch.tensor(bunch.data / 16.0, dtype=torch.float32)
    y = torch.tensor(bunch.target, dtype=torch.int64)
    train, test = train_test_split(
        range(len(y)), test_size=0.2, stratify=bunch.target, random_state=seed
    )
    train, test = torch.tensor(sorted(train)), torch.tensor(sorted(test))
    dataset = Dataset(
        "digits", x[train], y[train], x[test], y[test], task="classification", num_classes=10
    )
    return hold_out(dataset, seed, num_public=num_public, num_validation=num_validation)
