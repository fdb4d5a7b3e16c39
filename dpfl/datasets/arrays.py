"""A user's own data: train and test arrays in one NumPy ``.npz`` file (dataset ``npz``).

The file holds

* ``train_x``, ``test_x``: numeric features ``[n, *input_shape]`` (read as float32; the same
  input shape in both), already scaled as the model should see them;
* ``train_y``, ``test_y``: labels ``[n]`` in the convention of the task;
* ``task`` (optional, default ``"classification"``): ``"classification"`` (integer classes
  ``0..K-1``, softmax cross-entropy), ``"binary"`` (labels ``-1``/``+1``, logistic loss) or
  ``"regression"`` (real targets);
* ``num_classes`` (optional, classification only): K, else the largest label + 1.

``np.savez(path, train_x=..., train_y=..., test_x=..., test_y=...)`` writes one. The run names
it with the dataset option ``path``: an absolute path, or one relative to the data folder
(``data-dir``, else ``$DPFL_DATA_DIR``, else dpfl's per-user cache), which every runtime
resolves alike (a Ray worker's or a SuperNode's working folder is not the user's). The file is
read without pickles (``allow_pickle=False``) and checked whole before anything trains: every
problem is a ConfigError naming ``dataset-options``. ``num_public`` and ``num_validation`` hold
training rows out as for every other dataset (:func:`hold_out`).

A site that keeps its own records in a deployment uses a site file instead
(:mod:`dpfl.datasets.site`): this dataset is one global training set that the run partitions.
"""

from __future__ import annotations

import functools
import zipfile
from pathlib import Path

import numpy as np
import torch

from dpfl.datasets.base import TASKS, Dataset, hold_out
from dpfl.datasets.loading import DATASETS, stamp
from dpfl.errors import ConfigError

ARRAYS = ("train_x", "train_y", "test_x", "test_y")
KEY = "dataset-options"


def source(path: str, data_dir: Path) -> Path:
    """The file ``path`` names: itself when absolute (``~`` expanded), else under
    ``data_dir``."""
    given = Path(path).expanduser()
    return given if given.is_absolute() else Path(data_dir) / given


@DATASETS.register("npz")
def load_npz(*, seed: int, data_dir: Path, path: str = "", num_public: int = 0,
             num_validation: int = 0) -> Dataset:
    """The arrays of the ``.npz`` file ``path`` (module docstring); ``num_public`` training
    rows held out as public records, then ``num_validation`` as a validation split, drawn with
    ``seed``."""
    if not path:
        raise ConfigError(KEY, "dataset 'npz' reads its arrays from a file: give path=FILE",
                          allowed="path=FILE.npz holding " + ", ".join(ARRAYS))
    file = source(path, data_dir)
    return hold_out(_read(file, stamp(file)), seed, num_public=num_public,
                    num_validation=num_validation)


@functools.lru_cache(maxsize=2)
def _read(file: Path, state: tuple[int, int] | None) -> Dataset:
    """The checked arrays of ``file`` (one copy per state of the file on disk)."""
    if state is None:
        raise ConfigError(KEY, f"path: {file} does not exist (a relative path is read from the "
                          "data folder: data-dir, else $DPFL_DATA_DIR)")
    try:
        with np.load(file, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ConfigError(KEY, f"path: {file} is not a readable .npz without pickles "
                          f"({str(exc).splitlines()[0]})") from None
    missing = [name for name in ARRAYS if name not in arrays]
    if missing:
        raise ConfigError(KEY, f"path: {file} lacks {', '.join(missing)}",
                          allowed="an .npz holding " + ", ".join(ARRAYS)
                          + " (task, num_classes optional)")
    task = str(arrays.get("task", "classification"))
    if task not in TASKS:
        raise ConfigError(KEY, f"path: {file}: task {task!r} is not a task", allowed=TASKS)
    train_x, test_x = (_features(file, name, arrays[name]) for name in ("train_x", "test_x"))
    if train_x.shape[1:] != test_x.shape[1:]:
        raise ConfigError(KEY, f"path: {file}: train_x's rows are {tuple(train_x.shape[1:])}, "
                          f"test_x's {tuple(test_x.shape[1:])}: one input shape for both")
    train_y, test_y = (labels(f"path: {file}", name, arrays[name], len(x), task)
                       for name, x in (("train_y", train_x), ("test_y", test_x)))
    num_classes = 1
    if task == "classification":
        largest = int(max(train_y.max(), test_y.max()))
        given = arrays.get("num_classes", np.int64(largest + 1))
        num_classes = int(given) if given.ndim == 0 and np.issubdtype(given.dtype,
                                                                      np.integer) else 0
        if num_classes < 2 or largest >= num_classes:
            raise ConfigError(KEY, f"path: {file}: classification needs labels 0..K-1 with K "
                              f">= 2; the labels reach {largest}, num_classes is {given}")
    return Dataset("npz", train_x, train_y, test_x, test_y, task=task, num_classes=num_classes)


def _features(file: Path, name: str, values: np.ndarray) -> torch.Tensor:
    if values.ndim < 2 or len(values) == 0 or not np.issubdtype(values.dtype, np.number) \
            or np.iscomplexobj(values):
        raise ConfigError(KEY, f"path: {file}: {name} must be real numbers [n, *input_shape] "
                          f"with n >= 1, got {values.dtype} {values.shape}")
    x = values.astype(np.float32)
    if not np.isfinite(x).all():
        raise ConfigError(KEY, f"path: {file}: {name} holds NaN or infinite values (as float32)")
    return torch.from_numpy(x)


def labels(where: str, name: str, values: np.ndarray, rows: int, task: str, *,
           key: str = KEY) -> torch.Tensor:
    """One label per row in the ``task``'s convention (integers 0..K-1, ±1, or finite reals),
    or a ConfigError on ``key`` whose message begins with ``where`` (the file, or
    a reference, the labels came from)."""
    if values.shape != (rows,):
        raise ConfigError(key, f"{where}: {name} must hold one label per row, shape ({rows},), "
                          f"got {values.shape}")
    if task == "classification":
        if not np.issubdtype(values.dtype, np.integer) or (rows and values.min() < 0):
            raise ConfigError(key, f"{where}: {name}: classification labels are integers "
                              f"0..K-1, got {values.dtype}"
                              + (f" from {values.min()}" if rows else ""))
        return torch.from_numpy(values.astype(np.int64))
    if not np.issubdtype(values.dtype, np.number) or np.iscomplexobj(values):
        raise ConfigError(key, f"{where}: {name} must be real numbers, got {values.dtype}")
    y = values.astype(np.float32)
    if task == "binary" and not np.isin(y, (-1.0, 1.0)).all():
        raise ConfigError(key, f"{where}: {name}: binary labels are -1 and +1")
    if not np.isfinite(y).all():
        raise ConfigError(key, f"{where}: {name} holds NaN or infinite values")
    return torch.from_numpy(y)
