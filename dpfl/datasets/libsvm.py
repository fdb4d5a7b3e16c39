"""LIBSVM binary-classification sets (Chang & Lin 2011): a9a, duke, leukemia, w8a.

Read with ``sklearn.datasets.load_svmlight_file`` from ``<data_dir>/libsvm``
(``.bz2`` read directly) into dense float32 tensors. Labels are mapped to
float32 ``{-1, +1}`` (task ``"binary"``, logistic loss). By default each row is
scaled to unit ℓ2 norm, as the Clip21 logistic-regression experiments do
(our reading of the Clip21 paper's App. I.1); pass ``normalize=False`` for the raw features.

a9a is evaluated on a9a.t, leukemia (``leu``, 38 rows) on ``leu.t`` (34 rows). duke and w8a
ship no test file here, so their test set *is* the training set (the same tensors): the papers
using them report training-objective metrics (gradient norm, training loss). a9a and leukemia
can hold out a validation split (``num_validation``); duke and w8a refuse one, which their test
set would hold. ``join_test=true`` (a9a, leukemia) appends the test file's rows to the training
rows and tests on them all, for experiments that report a training objective over a dataset's
every row (the Clip21 paper's E1 on Leukemia: 72 rows, four equal clients of 18).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from dpfl.datasets.base import Dataset, hold_out
from dpfl.datasets.loading import DATASETS, Loader, local_file, stamp
from dpfl.errors import ConfigError


def _read(path: Path, n_features: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_svmlight_file  # imported on use

    sparse, labels = load_svmlight_file(str(path), n_features=n_features, dtype=np.float32)
    x = torch.from_numpy(sparse.toarray())
    if normalize:
        x = x / x.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return x, torch.from_numpy(np.where(labels > 0, 1.0, -1.0).astype(np.float32))


def _libsvm_loader(name: str, train_file: str, test_file: str | None, n_features: int) -> Loader:
    def stamps(data_dir: Path) -> tuple[tuple[int, int] | None, ...]:
        """Size and modification time of each file (None: not there yet), so that a file
        changed on disk is read again."""
        paths = [data_dir / "libsvm" / f for f in (train_file, test_file) if f]
        return tuple(stamp(path) for path in paths)

    @functools.lru_cache(maxsize=2)
    def whole(data_dir: Path, download: bool, normalize: bool,
              files: tuple[tuple[int, int] | None, ...]) -> Dataset:
        """The files' rows (one copy per ``normalize`` and state of the ``files`` on disk,
        whatever the run seed)."""
        def read(filename: str) -> tuple[torch.Tensor, torch.Tensor]:
            path = local_file(data_dir, f"libsvm/{filename}", dataset=name, download=download)
            return _read(path, n_features, normalize)

        train_x, train_y = read(train_file)
        test_x, test_y = read(test_file) if test_file else (train_x, train_y)
        return Dataset(name, train_x, train_y, test_x, test_y, task="binary", num_classes=1)

    def load(*, seed: int, data_dir: Path, download: bool, normalize: bool = True,
             num_validation: int = 0, join_test: bool = False) -> Dataset:
        if join_test and test_file is None:
            raise ConfigError("dataset-options", f"join_test: {name} has no test file",
                              allowed="false")
        if num_validation and (test_file is None or join_test):
            raise ConfigError("dataset-options", f"num_validation: {name} tests on its training "
                              f"set, so a validation split would be in the test set", allowed="0")
        rows = whole(data_dir, download, normalize, stamps(data_dir))
        if join_test:
            x, y = torch.cat([rows.train_x, rows.test_x]), torch.cat([rows.train_y, rows.test_y])
            return Dataset(name, x, y, x, y, task="binary", num_classes=1)
        return hold_out(rows, seed, num_validation=num_validation)

    test = (f"test on {test_file}; ``num_validation``: training rows held out as a validation "
            f"split, drawn with the run seed" if test_file else "test set = training set")
    load.__doc__ = f"LIBSVM {name} ({n_features} features; {test}); ``normalize``: unit-norm rows."
    return load


DATASETS.add("a9a", _libsvm_loader("a9a", "a9a", "a9a.t", n_features=123))
DATASETS.add("duke", _libsvm_loader("duke", "duke.bz2", None, n_features=7129))
DATASETS.add("leukemia", _libsvm_loader("leukemia", "leu.bz2", "leu.t.bz2", n_features=7129))
DATASETS.add("w8a", _libsvm_loader("w8a", "w8a", None, n_features=300))
