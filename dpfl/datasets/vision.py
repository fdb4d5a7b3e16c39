"""MNIST, Fashion-MNIST and CIFAR-10 through torchvision's own loaders.

MNIST and Fashion-MNIST: the four original ``*-idx?-ubyte.gz`` files in
``<data_dir>/mnist`` (``fashion_mnist``), each with torchvision's MD5, are symlinked into
``<cache_dir>/MNIST/raw`` (``FashionMNIST/raw``), and torchvision is called with
``download=True``: it verifies each file's MD5, skips the download and decompresses next to
the links, without network.

CIFAR-10: ``<data_dir>/cifar10`` is a torchvision root (holding ``cifar-10-batches-py``),
read in place.

Files that are not in the data folder are downloaded there on request (``download=True``),
in the same layout, from torchvision's sources (:func:`dpfl.datasets.download.ensure_files`):
the next run reads them as local files.

Pixels are scaled to [0, 1], then standardised per channel with the usual
dataset statistics. Tensors are ``[n, channels, height, width]`` float32 with
int64 labels 0-9, on the standard train/test splits.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock

from dpfl.datasets.base import Dataset, hold_out
from dpfl.datasets.download import ensure_files, from_mirrors
from dpfl.datasets.loading import DATASETS, Loader
from dpfl.errors import ConfigError


def _standardised(
    pixels: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]
) -> torch.Tensor:
    """uint8 ``[n, c, h, w]`` pixels to float32, scaled to [0, 1], then per-channel standardised
    (in the one float32 copy: MNIST's 60,000 images are 188 MB, and a fresh tensor per
    operation cost three times as much, in page faults; the same values)."""
    shape = (1, len(mean), 1, 1)
    scaled = pixels.to(torch.float32).div_(255.0)
    scaled.sub_(torch.tensor(mean).view(shape)).div_(torch.tensor(std).view(shape))
    return scaled.contiguous()


IDX_SCALINGS = ("standardised", "unit", "raw")


def _subset(y: torch.Tensor, size: int, seed: int) -> torch.Tensor:
    """The rows of ``size`` training records drawn with ``seed``, stratified by label, in stored
    order."""
    if not 0 < size < len(y):
        raise ConfigError("dataset-options", f"num_train must be between 1 and {len(y) - 1}, "
                          f"got {size}", allowed=f"1..{len(y) - 1}, or 0 for all")
    from sklearn.model_selection import train_test_split

    rows, _ = train_test_split(np.arange(len(y)), train_size=size, random_state=seed,
                               stratify=y.numpy())
    return torch.from_numpy(np.sort(rows))


def _idx_loader(name: str, source_name: str, subdir: str, mean: float, std: float) -> Loader:
    """The loader of an idx dataset read by ``torchvision.datasets.<source_name>`` (imported
    on use: a ClientApp, started for every message, reads its node's cached data instead)."""

    @functools.lru_cache(maxsize=len(IDX_SCALINGS))
    def read(data_dir: Path, cache_dir: Path, download: bool, scaling: str) -> Dataset:
        """The whole dataset (one copy per scaling read, whatever the run seed)."""
        import torchvision.datasets
        from torchvision.datasets.utils import check_integrity

        source = getattr(torchvision.datasets, source_name)
        folder = data_dir / subdir
        lock = cache_dir / f"{source.__name__}.lock"

        def missing() -> list[str]:
            return [f for f, md5 in source.resources if not check_integrity(folder / f, md5)]

        ensure_files(name, folder, missing, from_mirrors(source.mirrors, source.resources),
                     download=download, lock=lock)
        raw = cache_dir / source.__name__ / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock)):
            for filename, _ in source.resources:
                link = raw / filename
                link.unlink(missing_ok=True)
                link.symlink_to((folder / filename).resolve())
            splits = [source(str(cache_dir), train=train, download=True) for train in (True, False)]
        statistics = ((mean,), (std,)) if scaling == "standardised" else ((0.0,), (1.0,))

        def pixels(data: torch.Tensor) -> torch.Tensor:
            if scaling == "raw":  # the uint8 values as they are, 0..255
                return data.unsqueeze(1).to(torch.float32)
            return _standardised(data.unsqueeze(1), *statistics)

        (train_x, train_y), (test_x, test_y) = [
            (pixels(s.data), s.targets.to(torch.int64)) for s in splits
        ]
        return Dataset(
            name, train_x, train_y, test_x, test_y, task="classification", num_classes=10
        )

    def load(*, seed: int, data_dir: Path, cache_dir: Path, download: bool,
             num_train: int = 0, num_public: int = 0, num_validation: int = 0,
             scaling: str = "standardised") -> Dataset:
        if scaling not in IDX_SCALINGS:
            raise ConfigError("dataset-options", f"{name}'s scaling {scaling!r} is not offered",
                              allowed=", ".join(IDX_SCALINGS))
        whole = read(data_dir, cache_dir, download, scaling)
        dataset, rest = whole, None
        if num_train:
            rows = _subset(whole.train_y, num_train, seed)
            dataset = Dataset(name, whole.train_x[rows], whole.train_y[rows], whole.test_x,
                              whole.test_y, task="classification", num_classes=10)
            left = torch.from_numpy(np.setdiff1d(np.arange(whole.num_train), rows.numpy()))
            rest = (whole.train_x[left], whole.train_y[left])
        return hold_out(dataset, seed, num_public=num_public, num_validation=num_validation,
                        candidates=rest)

    load.__doc__ = (
        f"{source_name}: 60,000 train / 10,000 test images, [n, 1, 28, 28]; ``scaling``: "
        f"``standardised`` (mean {mean}, std {std}), ``unit`` (pixels in [0, 1]) or ``raw`` "
        f"(the pixel values 0..255 as floats, unscaled); "
        f"``num_train``: a stratified random subset of the training images, drawn with the "
        f"run seed (0 = all; the adaptive-clipping paper trains on 3,000); ``num_public``: "
        f"public records drawn with the run seed from the training images outside the "
        f"subset (or held out of them without one), for a public projection (PCDP-SGD's "
        f"m = 100); ``num_validation``: a validation split drawn the same way after the public "
        f"records, from what they left."
    )
    return load


DATASETS.add("mnist", _idx_loader("mnist", "MNIST", "mnist", 0.1307, 0.3081))
DATASETS.add(
    "fashion-mnist", _idx_loader("fashion-mnist", "FashionMNIST", "fashion_mnist", 0.2860, 0.3530)
)

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


SCALINGS = ("standardised", "symmetric")


@DATASETS.register("cifar10")
def load_cifar10(*, data_dir: Path, cache_dir: Path, download: bool,
                 scaling: str = "standardised") -> Dataset:
    """CIFAR-10 (50,000 train / 10,000 test, [n, 3, 32, 32]).

    ``scaling``: ``standardised`` (per channel, with the training images' statistics) or
    ``symmetric`` (pixels/127.5 − 1, in [−1, 1]: the DP-FTRL code's, which PriSMA's Table 1
    follows).
    """
    from torchvision.datasets import CIFAR10  # imported on use
    from torchvision.datasets.utils import download_and_extract_archive

    if scaling not in SCALINGS:
        raise ConfigError("dataset-options", f"cifar10's scaling {scaling!r} is not offered",
                          allowed=", ".join(SCALINGS))
    folder = data_dir / "cifar10"

    def missing() -> list[str]:
        return [] if (folder / CIFAR10.base_folder).is_dir() else [CIFAR10.base_folder]

    def get(staging: Path, names: list[str]) -> None:  # the archive, unpacked (the .tar.gz goes)
        download_and_extract_archive(CIFAR10.url, str(staging), filename=CIFAR10.filename,
                                     md5=CIFAR10.tgz_md5)

    ensure_files("cifar10", folder, missing, get, download=download,
                 lock=cache_dir / "CIFAR10.lock")
    splits = [CIFAR10(str(folder), train=train) for train in (True, False)]
    (train_x, train_y), (test_x, test_y) = [
        (
            _standardised(torch.from_numpy(s.data).permute(0, 3, 1, 2),
                          *((CIFAR10_MEAN, CIFAR10_STD) if scaling == "standardised"
                            else ((0.5,) * 3, (0.5,) * 3))),
            torch.tensor(s.targets, dtype=torch.int64),
        )
        for s in splits
    ]
    return Dataset(
        "cifar10", train_x, train_y, test_x, test_y, task="classification", num_classes=10
    )
