"""UCI Bank Marketing (Moro, Cortez & Rita 2014), the AdaptDP-FedAvg paper's tabular task (§5)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dpfl.datasets.base import Dataset
from dpfl.datasets.loading import DATASETS, local_file

TEST_FRACTION = 0.1


@DATASETS.register("bank-marketing")
def load_bank_marketing(*, seed: int, data_dir: Path, download: bool) -> Dataset:
    """``bank_marketing/bank-full.csv``: 45,211 clients, 51 features, did they subscribe?

    The 9 categorical attributes are one-hot encoded (44 columns, categories in
    sorted order) and the 7 numeric ones, ``duration`` included, standardised
    over the whole file (51 features). Labels: ``y`` yes → 1, no → 0 (5,289 yes).

    All 45,211 rows are the training set, as in the paper (n_train = 45,211).
    The test set mirrors UCI's ``bank.csv``: a random 10% of the same rows
    (4,521), drawn with ``seed``, so it overlaps the training data.
    """
    path = local_file(
        data_dir, "bank_marketing/bank-full.csv", dataset="bank-marketing", download=download
    )
    import pandas as pd  # imported on use: a ClientApp starts for every message

    table = pd.read_csv(path, sep=";")
    labels = (table.pop("y") == "yes").to_numpy()
    numeric = table.select_dtypes("number")
    standardised = (numeric - numeric.mean()) / numeric.std(ddof=0)
    onehot = pd.get_dummies(table.select_dtypes(exclude="number"))
    x = torch.tensor(pd.concat([standardised, onehot], axis=1).to_numpy(np.float32))
    y = torch.tensor(labels, dtype=torch.int64)
    rng = np.random.default_rng(seed)
    test = torch.from_numpy(
        np.sort(rng.choice(len(y), size=round(TEST_FRACTION * len(y)), replace=False))
    )
    return Dataset("bank-marketing", x, y, x[test], y[test], task="classification", num_classes=2)
