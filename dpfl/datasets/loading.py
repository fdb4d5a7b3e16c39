"""The dataset registry and :func:`load_dataset`, which resolves folders and caches loads.

The data folder is ``data_dir`` (run config ``data-dir``), else ``$DPFL_DATA_DIR`` (an offline
copy), else ``data`` in dpfl's per-user cache folder (:func:`user_cache`), where MNIST and
Fashion-MNIST are downloaded on first use, and CIFAR-10 when a run asks for it (``download``).

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
from dpfl.folders import user_cache
from dpfl.registry import Registry

Loader = Callable[..., Dataset]

DATASETS: Registry[Loader] = Registry("dataset")

DATA_DIR_ENV = "DPFL_DATA_DIR"
PROVIDED = ("seed", "data_dir", "cache_dir", "download")  # options the run config sets


def data_folder(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder the datasets are read from (and downloaded into): ``data_dir``, else
    ``$DPFL_DATA_DIR``, else ``data`` in :func:`user_cache`; absolute."""
    folder = data_dir or os.environ.get(DATA_DIR_ENV)
    return Path(folder).expanduser().absolute() if folder else user_cache() / "data"


#: datasets downloaded on first use into the per-user cache without being asked: small (12 and
#: 31 MB) and what a first run beyond the bundled digits asks for
FIRST_USE = ("mnist", "fashion-mnist")


def first_use(name: str, data_dir: str | os.PathLike[str] | None) -> bool:
    """Whether ``name`` is downloaded without ``download=true``: one of :data:`FIRST_USE`, read
    from dpfl's own per-user cache (no ``data-dir``, no ``$DPFL_DATA_DIR``), a folder that
    exists for downloads. A folder the user names (an offline copy) is only read."""
    return name in FIRST_USE and not data_dir and not os.environ.get(DATA_DIR_ENV)


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
        Folder holding the real datasets (``mnist/``, ``libsvm/``, ...); None is
        :func:`data_folder`'s default (``$DPFL_DATA_DIR``, else the per-user cache).
    download : bool
        Let torchvision download MNIST, Fashion-MNIST or CIFAR-10 into the data
        folder, in an offline copy's layout, when they are not there yet (once; a
        failed download leaves nothing). Without it only :func:`first_use` downloads
        (MNIST and Fashion-MNIST into the per-user cache).
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
    provided = {
        "seed": seed,
        "data_dir": data_folder(data_dir),
        "cache_dir": user_cache(),
        "download": download or first_use(name, data_dir),
    }
    kwargs = {key: value for key, value in provided.items() if key in accepted} | options
    return _load(name, tuple(sorted(kwargs.items())))


def _key(option: str) -> str:
    """The run-config spelling of a loader option: ``num_clients`` is ``num-clients``."""
    return option.replace("_", "-")


@lru_cache(maxsize=16)
def _load(name: str, kwargs: tuple[tuple[str, Any], ...]) -> Dataset:
    return DATASETS.get(name)(**dict(kwargs))


def local_file(data_dir: Path, relative: str, *, dataset: str, download: bool) -> Path:
    """``data_dir / relative``, or a ConfigError that names the missing file.

    For datasets that only exist as local files: ``download=True`` cannot help.
    """
    path = data_dir / relative
    if path.is_file():
        return path
    fix = f"set {DATA_DIR_ENV} (or data-dir) to a folder holding {relative}"
    if download:
        raise ConfigError("download", f"dataset {dataset!r} has no download source and {path} "
                          f"does not exist; {fix}")
    raise ConfigError("dataset", f"{dataset!r} reads {relative} from the data folder, but "
                      f"{path} does not exist; {fix}")


def stamp(file: Path) -> tuple[int, int] | None:
    """Size and modification time of ``file`` (None: not there), so that a file changed on disk
    is read again (and a node's cache keys its data by it)."""
    try:
        st = file.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def positive_int(key: str, value: object) -> int:
    """``value`` as an int >= 1, or a ConfigError for the option ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"must be an integer >= 1, got {value!r}", allowed=">= 1")
    return value
