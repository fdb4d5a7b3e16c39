"""A dataset's files in the data folder: found there, or downloaded there once, all or nothing.

:func:`ensure_files` is the one way a loader with a download source (MNIST, Fashion-MNIST,
CIFAR-10) gets its files. Present: nothing happens (an offline copy is only read). Absent
without ``download``: a ConfigError naming the folder, ``DPFL_DATA_DIR`` and ``download``.
Absent with ``download``: under a file lock (concurrent runs, nodes and workers wait for the
first one and then find the files), the loader's ``get`` fetches them with torchvision's own
downloader (MD5-checked, with a progress bar on stderr) into a hidden staging folder beside
their destination; the finished files are then moved into place, and one line says where.
A failure (no network, a mirror down, a checksum that does not match, Ctrl-C) removes the
staging folder, so no partial file is ever left where a later run would read it, and raises
one ConfigError line (offline, the only line the run prints).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from http.client import HTTPException
from pathlib import Path

from filelock import FileLock

from dpfl.datasets.loading import DATA_DIR_ENV
from dpfl.errors import ConfigError

#: what a failed transfer raises: URLError and socket errors are OSErrors, a connection cut
#: mid-body is an HTTPException, a checksum mismatch is torchvision's RuntimeError
TRANSFER_ERRORS = (OSError, RuntimeError, HTTPException)

#: ``get(staging, names)`` downloads the files (or folders) ``names`` into the empty ``staging``
Get = Callable[[Path, list[str]], None]


def ensure_files(dataset: str, folder: Path, missing: Callable[[], list[str]], get: Get, *,
                 download: bool, lock: Path) -> None:
    """Make ``folder`` hold the files (or folders) of ``dataset``; ``missing()`` names those it
    lacks, ``get`` downloads them, ``lock`` is the file lock serialising this dataset's
    downloads."""
    absent = missing()
    if not absent:
        return
    if not download:
        raise ConfigError(
            "dataset", f"{dataset!r} is not available locally: {folder} does not hold "
            f"{', '.join(absent)}; set {DATA_DIR_ENV} (or data-dir) to a folder holding an "
            f"offline copy, or pass download=true to download it there")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        absent = missing()  # another process may have downloaded them meanwhile
        if absent:
            _download(dataset, folder, absent, get)


def _download(dataset: str, folder: Path, names: list[str], get: Get) -> None:
    staging = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", suffix=".part",
                                        dir=folder.parent))
        get(staging, names)
        folder.mkdir(exist_ok=True)
        for name in names:
            os.replace(staging / name, folder / name)
        print(f"dpfl: downloaded {dataset!r} into {folder}; later runs read it there",
              file=sys.stderr, flush=True)
    except TRANSFER_ERRORS as error:
        reason = " ".join(str(error).split())  # one line, whatever the error's text
        raise ConfigError(
            "download", f"could not download {dataset!r} into {folder} ({reason}); nothing "
            f"was written there; retry online, or set {DATA_DIR_ENV} to a folder holding "
            f"an offline copy ({folder.name}/{', '.join(names)})") from None
    finally:  # done, failed or interrupted: the staging folder goes
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def from_mirrors(mirrors: list[str], resources: list[tuple[str, str]]) -> Get:
    """A ``get`` for :func:`ensure_files`: each file from the first of ``mirrors`` (URL
    prefixes) that serves it with the MD5 ``resources`` gives it, through torchvision's
    downloader."""
    from torchvision.datasets.utils import download_url  # imported on use

    md5 = dict(resources)

    def get(staging: Path, names: list[str]) -> None:
        for name in names:
            errors = []
            for mirror in mirrors:
                try:
                    download_url(mirror + name, str(staging), filename=name, md5=md5[name])
                    break
                except TRANSFER_ERRORS as error:
                    errors.append(f"{mirror}{name}: {error}")
                    (staging / name).unlink(missing_ok=True)
            else:
                raise OSError("; ".join(errors))

    return get
