"""A user's own data by reference: ``dataset="package.module:callable"`` (:mod:`dpfl.reference`).

The callable receives ``seed`` and ``data_dir`` (the run's data folder, absolute) where its
signature takes them, and the dataset options as further keywords (``num_public`` and
``num_validation`` aside: dpfl holds those out itself, as for every dataset). It returns the
training and test sets in one of these forms:

* ``(train_x, train_y, test_x, test_y)``: arrays (NumPy, torch, or anything ``numpy.asarray``
  reads), features ``[n, *input_shape]``, labels ``[n]``;
* ``(train, test)``: two datasets of records, each a ``torch.utils.data.Dataset`` of
  ``(x, y)`` pairs (materialised once into tensors) or a Hugging Face ``datasets.Dataset``
  (features: its columns but the ``label`` one, one column as it is or several scalar ones side
  by side; labels: its ``label`` column);
* a mapping holding either ``train_x``, ``train_y``, ``test_x``, ``test_y`` or ``train``,
  ``test`` (a Hugging Face ``DatasetDict`` is one), and optionally ``task`` (``classification``,
  the default for integer labels, ``binary`` with labels -1/+1, ``regression``, the default for
  real labels), ``num_classes`` (else the largest label + 1) and ``clients``: the clients'
  natural split, a list of row-index lists (disjoint, covering every training row) or one
  client id per training row; ``partitioner="natural"`` then gives each client its rows.

Features of an integer type (token ids) stay integers (int64); all others become float32.
Every problem is a ConfigError on one line naming ``dataset``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpfl.datasets.arrays import labels
from dpfl.datasets.base import TASKS, Dataset, hold_out
from dpfl.errors import ConfigError
from dpfl.reference import accepted, first_line, resolve

KEY = "dataset"
#: what the callable is given, where its signature takes it
GIVEN = ("seed", "data_dir")
ARRAYS = ("train_x", "train_y", "test_x", "test_y")
LABELS = "label"  # the labels' column of a Hugging Face dataset
FORMS = ("(train_x, train_y, test_x, test_y), (train, test) as torch or Hugging Face datasets, "
         "or a dict of either (with task, num_classes, clients optional)")


def load_referenced(reference: str, *, seed: int, data_dir: Path, num_public: int = 0,
                    num_validation: int = 0, **options: Any) -> Dataset:
    """The dataset the callable ``reference`` returns (module docstring), called with
    ``options``; ``num_public`` training rows held out as public records, then
    ``num_validation`` as a validation split, drawn with ``seed``. Cached in-process per
    call."""
    function = resolve(KEY, reference)
    provided = accepted(function, dict(zip(GIVEN, (seed, Path(data_dir)), strict=True)))
    dataset = _load(reference, tuple(sorted(provided.items())), tuple(sorted(options.items())))
    return hold_out(dataset, seed, num_public=num_public, num_validation=num_validation)


@functools.lru_cache(maxsize=4)
def _load(reference: str, provided: tuple[tuple[str, Any], ...],
          options: tuple[tuple[str, Any], ...]) -> Dataset:
    try:
        result = resolve(KEY, reference)(**dict(provided), **dict(options))
    except ConfigError:
        raise
    except Exception as exc:  # the user's code: whatever it raised, on one line
        raise ConfigError(KEY, f"{reference!r} failed: {type(exc).__name__}: "
                          f"{first_line(exc)}") from None
    return as_dataset(reference, result)


def as_dataset(reference: str, result: object) -> Dataset:
    """``result`` of the callable ``reference`` in one of the forms of the module docstring,
    checked, as a :class:`Dataset`."""
    fields: Mapping[str, Any]
    if isinstance(result, Mapping) or _is_hf_dict(result):
        fields = result  # type: ignore[assignment]
    elif isinstance(result, tuple | list) and len(result) == 4:
        fields = dict(zip(ARRAYS, result, strict=True))
    elif isinstance(result, tuple | list) and len(result) == 2:
        fields = {"train": result[0], "test": result[1]}
    else:
        raise ConfigError(KEY, f"{reference!r} returned a {type(result).__name__}",
                          allowed=FORMS)
    if all(name in fields for name in ARRAYS):
        train_x, train_y, test_x, test_y = (fields[name] for name in ARRAYS)
    elif "train" in fields and "test" in fields:
        train_x, train_y = _records(reference, "train", fields["train"])
        test_x, test_y = _records(reference, "test", fields["test"])
    else:
        raise ConfigError(KEY, f"{reference!r} returned a mapping of {sorted(map(str, fields))}",
                          allowed=FORMS)
    train_x, test_x = (_features(reference, name, x)
                       for name, x in (("train_x", train_x), ("test_x", test_x)))
    if train_x.shape[1:] != test_x.shape[1:]:
        raise ConfigError(KEY, f"{reference!r}: training inputs are {tuple(train_x.shape[1:])}, "
                          f"test inputs {tuple(test_x.shape[1:])}: one input shape for both")
    ys = _array(reference, "train_y", train_y), _array(reference, "test_y", test_y)
    task = str(fields.get("task", "classification" if all(
        np.issubdtype(y.dtype, np.integer) for y in ys) else "regression"))
    if task not in TASKS:
        raise ConfigError(KEY, f"{reference!r}: task {task!r} is not a task", allowed=TASKS)
    train_y, test_y = (labels(repr(reference), name, y, len(x), task, key=KEY)
                       for name, y, x in (("train_y", ys[0], train_x), ("test_y", ys[1], test_x)))
    num_classes = _num_classes(reference, task, fields.get("num_classes"), train_y, test_y)
    sizes = None
    if fields.get("clients") is not None:
        order, sizes = _natural_split(reference, fields["clients"], len(train_y))
        train_x, train_y = train_x[order], train_y[order]
    return Dataset(reference, train_x, train_y, test_x, test_y, task=task,
                   num_classes=num_classes, client_sizes=sizes)


def _is_hf_dict(value: object) -> bool:
    """Whether ``value`` is a Hugging Face ``DatasetDict`` (a dict already; checked by name so
    that ``datasets`` is imported only by whoever made one)."""
    return type(value).__name__ == "DatasetDict"


def _records(reference: str, split: str, records: object) -> tuple[Any, Any]:
    """Features and labels of one split given as a dataset of records."""
    if type(records).__name__ == "Dataset" and hasattr(records, "column_names"):
        return _hf_records(reference, split, records)
    if isinstance(records, torch.utils.data.Dataset) and hasattr(records, "__len__"):
        pairs = [records[i] for i in range(len(records))]  # type: ignore[arg-type]
        if not pairs or not all(isinstance(p, tuple | list) and len(p) == 2 for p in pairs):
            raise ConfigError(KEY, f"{reference!r}: the {split} dataset's records must be "
                              "(x, y) pairs, and there must be at least one")
        xs, ys = zip(*pairs, strict=True)
        try:
            return (torch.stack([torch.as_tensor(np.asarray(x)) for x in xs]),
                    torch.as_tensor(np.asarray([np.asarray(y) for y in ys])))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ConfigError(KEY, f"{reference!r}: the {split} dataset's records do not "
                              f"stack into one tensor: {first_line(exc)}") from None
    raise ConfigError(KEY, f"{reference!r}: its {split} set is a {type(records).__name__}",
                      allowed="a torch.utils.data.Dataset of (x, y), a Hugging Face "
                      "datasets.Dataset")


def _hf_records(reference: str, split: str, table: Any) -> tuple[np.ndarray, np.ndarray]:
    """A Hugging Face dataset's features (its columns but ``label``) and labels."""
    columns = [c for c in table.column_names if c != LABELS]
    if LABELS not in table.column_names or not columns:
        raise ConfigError(KEY, f"{reference!r}: the {split} set's columns are "
                          f"{table.column_names}: it needs a {LABELS!r} column and a feature "
                          f"column (rename_column, select_columns)")
    data = table.with_format("numpy")
    values = [np.asarray(data[c]) for c in columns]
    if len(values) == 1:
        x = values[0] if values[0].ndim > 1 else values[0][:, None]
    elif all(v.ndim == 1 for v in values):
        x = np.stack(values, axis=1)
    else:
        raise ConfigError(KEY, f"{reference!r}: the {split} set's feature columns {columns} "
                          "hold arrays: give one array column, or several scalar ones")
    return x, np.asarray(data[LABELS])


def _array(reference: str, name: str, values: object) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.dtype == object or not (np.issubdtype(array.dtype, np.number)
                                     or array.dtype == np.bool_) or np.iscomplexobj(array):
        raise ConfigError(KEY, f"{reference!r}: {name} must be real numbers of one shape, got "
                          f"{array.dtype} {array.shape} (pad sequences to one length)")
    return array


def _features(reference: str, name: str, values: object) -> torch.Tensor:
    """``[n, *input_shape]`` features: int64 for an integer type (token ids), else float32."""
    array = _array(reference, name, values)
    if array.ndim < 2 or len(array) == 0:
        raise ConfigError(KEY, f"{reference!r}: {name} must be [n, *input_shape] with n >= 1, "
                          f"got shape {array.shape}")
    if np.issubdtype(array.dtype, np.integer):
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    x = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ConfigError(KEY, f"{reference!r}: {name} holds NaN or infinite values (as float32)")
    return torch.from_numpy(x)


def _num_classes(reference: str, task: str, given: object, *ys: torch.Tensor) -> int:
    if task != "classification":
        return 1
    largest = max(int(y.max()) for y in ys if len(y))
    count = largest + 1 if given is None else given
    if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 2 \
            or largest >= count:
        raise ConfigError(KEY, f"{reference!r}: classification needs labels 0..K-1 with K >= 2; "
                          f"the labels reach {largest}, num_classes is {count!r}")
    return int(count)


def _natural_split(reference: str, clients: object, rows: int
                   ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The training rows ordered client by client (each client's in their own order) and the
    clients' sizes, from row-index lists or one client id per row (clients in sorted id
    order)."""
    if isinstance(clients, Sequence | np.ndarray | torch.Tensor) and len(clients) and all(
            isinstance(c, Sequence | np.ndarray | torch.Tensor) and not isinstance(c, str)
            for c in clients):
        lists = [np.sort(np.asarray(c, dtype=np.int64).reshape(-1)) for c in clients]
        order = np.concatenate(lists)
        if any(len(rows_of) == 0 for rows_of in lists) or not np.array_equal(
                np.sort(order), np.arange(rows)):
            raise ConfigError(KEY, f"{reference!r}: clients: the row-index lists must be "
                              f"non-empty, disjoint and cover the {rows} training rows")
        return torch.from_numpy(order), tuple(len(rows_of) for rows_of in lists)
    ids = np.asarray(clients.numpy() if isinstance(clients, torch.Tensor) else clients)
    if ids.shape != (rows,):
        raise ConfigError(KEY, f"{reference!r}: clients must be row-index lists or one client "
                          f"id per training row ({rows}), got shape {ids.shape}")
    _, inverse, sizes = np.unique(ids, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")
    return torch.from_numpy(order.astype(np.int64)), tuple(int(s) for s in sizes)
