"""The dataset registry and :func:`load_dataset`, which resolves folders and caches loads.

A loader is a function with keyword-only parameters. Those named ``seed``,
``data_dir``, ``cache_dir`` and ``download`` are filled in by :func:`load_dataset`
when the loader declares them; every other parameter is a dataset option the
caller may pass through ``**options``; ConfigErrors name them in run-config
spelling (``num_clients`` is ``num-clients``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from dpfl.datasets.base import Dataset
from dpfl.errors import ConfigError
from dpfl.registry import Registry

Loader = Callable[..., Dataset]

DATASETS: Registry[Loader] = Registry("dataset")

DATA_DIR_ENV = "DPFL_DATA_DIR"
CACHE_DIR_ENV = "DPFL_CACHE_DIR"
PROVIDED = ("seed", "data_dir", "cache_dir", "download")  # options the run config sets


def load_dataset(
    name: str,
    *,
    seed: int,
    data_dir: str | None = None,
    download: bool = False,
    **options: Any,
) -> Dataset:
    """Load the dataset registered as ``name``.

    Parameters
    ----------
    name : str
        A name in :data:`DATASETS`.
    seed : int
        Run seed. It fixes whatever is random in the dataset itself (synthetic
        problem instances, seeded train/test splits); loaders without randomness
        ignore it.
    data_dir : str | None
        Folder holding the real datasets (``mnist/``, ``libsvm/``, ...). Defaults
        to ``$DPFL_DATA_DIR``; unset means no local files.
    download : bool
        Let torchvision download MNIST, Fashion-MNIST or CIFAR-10 into the cache
        (``$DPFL_CACHE_DIR``, default ``~/.cache/dpfl``) when they are not in
        ``data_dir``. Nothing is downloaded otherwise.
    **options
        Dataset-specific options (see each loader's docstring).

    The result is cached in-process: the same request returns the same object.
    """
    loader = DATASETS.get(name)
    accepted = inspect.signature(loader).parameters
    allowed = [p for p in accepted if p not in PROVIDED]
    for option in options:
        if option not in allowed:
            raise ConfigError(
                _key(option),
                f"not an option of dataset {name!r}",
                allowed=[_key(p) for p in allowed] or "none",
            )
    folder = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV)
    provided = {
        "seed": seed,
        "data_dir": Path(folder).expanduser() if folder else None,
        "cache_dir": Path(os.environ.get(CACHE_DIR_ENV) or "~/.cache/dpfl").expanduser(),
        "download": download,
    }
    kwargs = {key: value for key, value in provided.items() if key in accepted} | options
    return _load(name, tuple(sorted(kwargs.items())))


def _key(option: str) -> str:
    """The run-config spelling of a loader option: ``num_clients`` is ``num-clients``."""
    return option.replace("_", "-")


@lru_cache(maxsize=16)
def _load(name: str, kwargs: tuple[tuple[str, Any], ...]) -> Dataset:
    return DATASETS.get(name)(**dict(kwargs))


def local_file(data_dir: Path | None, relative: str, *, dataset: str, download: bool) -> Path:
    """``data_dir / relative``, or a ConfigError that names the missing file.

    For datasets that only exist as local files: ``download=True`` cannot help.
    """
    if data_dir is not None and (data_dir / relative).is_file():
        return data_dir / relative
    where = (
        f"{data_dir / relative} does not exist"
        if data_dir
        else f"no data folder is set ({DATA_DIR_ENV})"
    )
    if download:
        raise ConfigError(
            "download",
            f"dataset {dataset!r} has no download source and {where}; "
            f"set {DATA_DIR_ENV} to a folder holding {relative}",
        )
    raise ConfigError(
        "dataset",
        f"{dataset!r} reads {relative} from the data folder, but {where}; "
        f"set {DATA_DIR_ENV} to a folder holding it",
    )


def positive_int(key: str, value: object) -> int:
    """``value`` as an int >= 1, or a ConfigError for the option ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"must be an integer >= 1, got {value!r}", allowed=">= 1")
    return value
