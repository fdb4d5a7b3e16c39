"""A site's own data: one client's training records in a file the site keeps, for a real
deployment where there is no global dataset to partition.

The file is a NumPy ``.npz`` archive of

* ``x``: float32 features ``[n, *input_shape]``, preprocessed as dpfl's loader of the dataset
  preprocesses them (e.g. MNIST: ``[n, 1, 28, 28]``, standardised with mean 0.1307 and std
  0.3081);
* ``y``: labels ``[n]`` in the dataset's convention (int64 classes ``0..K-1``; float32
  ``{-1, +1}`` for binary tasks; float32 targets for regression);
* ``dataset``, ``task``, ``num_classes``: the registered dataset it follows, and its task.

``dpfl export-partition`` writes one from a benchmark split (what the tests and the demo use);
a site writes its own the same way from its records. A SuperNode reads it through its node
config ``data-path`` and hosts one client, whose data it is. The record count never leaves
the node: the run declares a public lower bound ``min-client-records`` that every client is
calibrated and charged from, and a node holding fewer records refuses to train.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpfl.datasets.base import TASKS
from dpfl.errors import ConfigError, UsageError

FIELDS = ("x", "y", "dataset", "task", "num_classes")


def write_site_data(path: Path, *, dataset: str, task: str, num_classes: int, x: torch.Tensor,
                    y: torch.Tensor) -> None:
    """Write a site file (never over an existing one; all or nothing)."""
    if path.exists():
        raise UsageError(f"{path} exists: a site's data file is never overwritten")
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".npz")
    os.close(handle)
    try:
        np.savez(temporary, x=x.numpy(), y=y.numpy(), dataset=np.str_(dataset),
                 task=np.str_(task), num_classes=np.int64(num_classes))
        os.replace(temporary, path)
    finally:
        Path(temporary).unlink(missing_ok=True)


def site_node_data(path: str, *, dataset: str, clients: list[int],
                   num_clients: int) -> dict[str, Any]:
    """The node data (:meth:`dpfl.problem.Problem.node_data`'s layout) of the one client a node
    with its own data hosts; ConfigError naming the key when the file does not fit the run."""
    if len(clients) != 1:
        raise ConfigError("partition-ids", f"a node with its own data (data-path) hosts one "
                          f"client, not {clients}", allowed="one client id")
    expected = "an .npz holding " + ", ".join(FIELDS) + " (dpfl export-partition writes one)"
    try:
        with np.load(path, allow_pickle=False) as archive:
            fields = {f: archive[f] for f in FIELDS}
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError("data-path", f"cannot read {path} ({error})",
                          allowed=expected) from None
    if str(fields["dataset"]) != dataset:
        raise ConfigError("data-path", f"{path} holds {str(fields['dataset'])!r} records, the "
                          f"run trains on {dataset!r}", allowed=dataset)
    task, num_classes = str(fields["task"]), int(fields["num_classes"])
    x, y = torch.from_numpy(fields["x"]), torch.from_numpy(fields["y"])
    if task not in TASKS or x.dtype != torch.float32 or len(x) != len(y) or x.ndim < 2:
        raise ConfigError("data-path", f"{path}: x must be float32 [n, ...], y n labels, task "
                          f"one of {TASKS}", allowed=expected)
    return {"name": dataset, "task": task, "num_classes": num_classes,
            "num_clients": num_clients, "clients": clients, "sizes": [len(y)], "train_x": x,
            "train_y": y, "public_x": None, "public_y": None}
