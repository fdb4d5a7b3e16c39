"""Where data comes from without an offline copy: the per-user cache folder, MNIST downloaded
into it on first use (and into a folder a user names on request, ``download=true``), all or
nothing, once.

The network is mocked at urllib's transport (an opener serving the offline copy's files at
torchvision's URLs): torchvision's downloader, its MD5 checks, the staging folder, the layout
on disk and the reading back are the real ones. No test here reaches the network.
"""

from __future__ import annotations

import email.message
import io
import os
import pickle
import sys
import tarfile
import threading
import urllib.error
import urllib.request
import urllib.response
from pathlib import Path

import numpy as np
import pytest

from dpfl import cli
from dpfl.client.cache import cache_folder, node_problem
from dpfl.datasets import load_dataset, loading
from dpfl.datasets.loading import data_folder, user_cache
from dpfl.errors import ConfigError
from dpfl.problem import cached_problem, data_dir
from dpfl.runconfig import RunConfig
from tests.conftest import ROOT

OFFLINE = Path(os.environ["DPFL_DATA_DIR"])  # the offline copy the suite reads (conftest)
MNIST_FILES = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
               "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]


class _Body(io.BytesIO):
    """A response body that counts what it serves and, ``broken``, breaks off halfway."""

    def __init__(self, data: bytes, mirror: Mirror, broken: bool):
        super().__init__(data)
        self.mirror, self.broken, self.half = mirror, broken, len(data) // 2

    def read(self, size: int | None = -1) -> bytes:
        if self.broken:
            left = self.half - self.tell()
            if left <= 0:
                raise ConnectionResetError(104, "Connection reset by peer")
            size = left if size is None or size < 0 else min(size, left)
        chunk = super().read(size)
        with self.mirror.guard:
            self.mirror.served += len(chunk)
        return chunk


class Mirror(urllib.request.BaseHandler):
    """The network: any http(s) URL ending in a file name of ``folder`` gets that file's bytes;
    ``cut`` names a file whose transfer breaks off halfway (the connection reset)."""

    def __init__(self, folder: Path, cut: str = ""):
        self.folder, self.cut, self.served, self.guard = folder, cut, 0, threading.Lock()

    def http_open(self, request: urllib.request.Request) -> urllib.response.addinfourl:
        name = request.full_url.rsplit("/", 1)[-1]
        data = (self.folder / name).read_bytes()
        response = urllib.response.addinfourl(_Body(data, self, name == self.cut),
                                              email.message.Message(), request.full_url, 200)
        response.length = len(data)
        return response

    https_open = http_open


class Unreachable(urllib.request.BaseHandler):
    """No network at all: what urllib raises when no name resolves."""

    def http_open(self, request: urllib.request.Request) -> None:
        raise urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))

    https_open = http_open


class Forbidden(urllib.request.BaseHandler):
    """A test's assertion that nothing uses the network."""

    def http_open(self, request: urllib.request.Request) -> None:
        raise AssertionError(f"the network was used: {request.full_url}")

    https_open = http_open


@pytest.fixture
def network():
    """``network(handler)`` installs ``handler`` as urllib's only transport, for this test."""

    def install(handler: urllib.request.BaseHandler) -> urllib.request.BaseHandler:
        opener = urllib.request.OpenerDirector()
        opener.add_handler(handler)
        urllib.request.install_opener(opener)
        return handler

    yield install
    urllib.request.install_opener(None)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A user without an offline copy: DPFL_DATA_DIR unset, an empty per-user cache."""
    monkeypatch.delenv("DPFL_DATA_DIR", raising=False)
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path / "cache"))
    for cached in (node_problem, cached_problem, loading._load):
        cached.cache_clear()
    yield tmp_path / "cache"
    for cached in (node_problem, cached_problem, loading._load):
        cached.cache_clear()


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


def _dpfl_run_mnist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """``dpfl run`` of MNIST as a first user types it (the per-user cache, no ``download``):
    its exit status and stderr's lines."""
    config = f'dataset="mnist" num-server-rounds=1 results-dir="{tmp_path}/results"'
    code = cli.main(["run", "--run-config", config])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# --- the data folder ------------------------------------------------------------------------------


def test_without_dpfl_data_dir_the_data_folder_is_the_user_cache_never_beside_the_checkout(
        cache, monkeypatch, tmp_path):
    assert data_dir(RunConfig({})) == str(cache / "data") == str(data_folder())
    assert data_dir(RunConfig({"data-dir": str(tmp_path / "mine")})) == str(tmp_path / "mine")
    monkeypatch.setenv("DPFL_DATA_DIR", str(tmp_path / "offline"))
    assert data_dir(RunConfig({})) == str(tmp_path / "offline")
    monkeypatch.delenv("DPFL_DATA_DIR")
    monkeypatch.delenv("DPFL_CACHE_DIR")
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data_dir(RunConfig({})) == str(tmp_path / "xdg" / "dpfl" / "data")
    assert not data_dir(RunConfig({})).startswith(str(ROOT.parent))
    assert cache_folder() == tmp_path / "xdg" / "dpfl" / "nodes"  # the nodes' cache beside it


@pytest.mark.parametrize(("platform", "variable", "expected"), [
    ("linux", None, ".cache/dpfl"),
    ("darwin", None, "Library/Caches/dpfl"),
    ("win32", "LOCALAPPDATA", "AppData/Local/dpfl"),
])
def test_the_user_cache_is_the_platforms_cache_directory(platform, variable, expected,
                                                         monkeypatch, tmp_path):
    monkeypatch.delenv("DPFL_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    if variable:
        monkeypatch.setenv(variable, str(tmp_path / "AppData" / "Local"))
    monkeypatch.setattr(sys, "platform", platform)
    assert user_cache() == tmp_path / expected


def test_a_missing_dataset_names_the_data_folder_actually_used(cache, network, tmp_path):
    """A folder the user names (an offline copy) is only read: a dataset missing there is one
    line naming it, with no network; CIFAR-10 (170 MB) is never downloaded unasked."""
    network(Forbidden())
    named = tmp_path / "offline-copy"
    with pytest.raises(ConfigError) as error:
        load_dataset("mnist", seed=0, data_dir=str(named))
    assert error.value.key == "dataset"
    assert f"{named / 'mnist'} does not hold train-images-idx3-ubyte.gz" in str(
        error.value) and "DPFL_DATA_DIR" in str(error.value) and "download=true" in str(
        error.value)
    with pytest.raises(ConfigError, match=f"{cache / 'data' / 'libsvm' / 'a9a'} does not exist"):
        load_dataset("a9a", seed=0)
    with pytest.raises(ConfigError, match="cifar10"):
        load_dataset("cifar10", seed=0)
    assert not named.exists() and not (cache / "data").exists()  # nothing written


def test_a_node_reads_and_keys_its_data_on_the_default_folder(cache):
    libsvm = cache / "data" / "libsvm"
    libsvm.mkdir(parents=True)

    def write(rows: int) -> None:
        lines = [f"{1 if i % 2 else -1} 1:{i + 1} 3:0.5" for i in range(rows)]
        for name in ("a9a", "a9a.t"):
            (libsvm / name).write_text("\n".join(lines) + "\n")

    values = tuple(sorted(RunConfig({"dataset": "a9a", "model": "logistic",
                                     "num-partitions": 2, "batch-size": 4}).as_dict().items()))
    write(20)
    before = node_problem(values, (0,))
    write(30)
    for cached in (node_problem, cached_problem, loading._load):  # a fresh message's process
        cached.cache_clear()
    after = node_problem(values, (0,))
    assert (len(before.dataset.train_y), len(after.dataset.train_y)) == (10, 15)
    assert len(list((cache / "nodes").glob("data-*.pt"))) == 2


# --- the download ---------------------------------------------------------------------------------


def test_mnist_is_downloaded_once_into_an_offline_copys_layout_and_read_back_offline(
        cache, network, capfd):
    mirror = network(Mirror(OFFLINE / "mnist"))
    loaded, failures = [], []

    def first_use() -> None:  # two processes' worth of first use at the same time
        try:
            loaded.append(load_dataset("mnist", seed=0, download=True))
        except BaseException as error:  # noqa: BLE001 - reported below
            failures.append(error)

    threads = [threading.Thread(target=first_use) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures and len(loaded) == 2
    data = cache / "data"
    assert _files(data) == sorted(f"mnist/{name}" for name in MNIST_FILES)  # no staging left
    for name in MNIST_FILES:
        path = data / "mnist" / name
        assert not path.is_symlink()
        assert path.read_bytes() == (OFFLINE / "mnist" / name).read_bytes()
    assert mirror.served == sum((OFFLINE / "mnist" / n).stat().st_size for n in MNIST_FILES)
    assert f"downloaded 'mnist' into {data / 'mnist'}" in capfd.readouterr().err

    network(Forbidden())
    again = load_dataset("mnist", seed=0, scaling="unit")  # read from the files, no network
    assert again.train_x.shape == (60000, 1, 28, 28) and again.test_x.shape == (10000, 1, 28, 28)
    assert again.train_y.tolist() == loaded[0].train_y.tolist()
    assert float(again.train_x.min()) == 0.0 and float(again.train_x.max()) == 1.0


def test_a_first_mnist_run_downloads_it_into_the_user_cache_unasked(cache, network, capsys,
                                                                     tmp_path):
    """``dpfl run -c 'dataset="mnist"'`` on a machine without an offline copy: MNIST arrives in
    the per-user cache (no ``download=true`` needed) and the run goes on."""
    mirror = network(Mirror(OFFLINE / "mnist"))
    code, _ = _dpfl_run_mnist(tmp_path, capsys)
    assert code == 0 and mirror.served > 0
    assert _files(cache / "data") == sorted(f"mnist/{name}" for name in MNIST_FILES)


def test_a_download_cut_off_is_one_line_exit_2_and_leaves_no_partial_file(
        cache, network, capsys, tmp_path):
    network(Mirror(OFFLINE / "mnist", cut="train-labels-idx1-ubyte.gz"))
    code, lines = _dpfl_run_mnist(tmp_path, capsys)
    assert code == 2
    error = lines[-1]  # after the progress bars of what did arrive
    assert error.startswith("dpfl: error: run config key 'download': could not download 'mnist'")
    assert "DPFL_DATA_DIR" in error and "Connection reset" in error
    assert "Traceback" not in "\n".join(lines)
    assert _files(cache / "data") == []  # the complete first file went with the staging folder
    assert not (tmp_path / "results").exists()


def test_offline_a_download_is_the_runs_only_line(cache, network, capsys, tmp_path):
    network(Unreachable())
    code, lines = _dpfl_run_mnist(tmp_path, capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("dpfl: error: run config key 'download': could not download")
    assert "DPFL_DATA_DIR" in lines[0] and "name resolution" in lines[0]
    assert _files(cache / "data") == []


def _small_cifar10(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``folder`` holding a CIFAR-10 archive in the real layout with 2 images per batch, whose
    MD5s torchvision is made to expect."""
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import calculate_md5

    batches = folder / "unpacked" / CIFAR10.base_folder
    batches.mkdir(parents=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    rng = np.random.default_rng(0)
    for name in names:
        entry = {"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8), "labels": [0, 9]}
        (batches / name).write_bytes(pickle.dumps(entry))
    (batches / "batches.meta").write_bytes(pickle.dumps({"label_names": list("0123456789")}))
    with tarfile.open(folder / CIFAR10.filename, "w:gz") as archive:
        archive.add(batches, arcname=CIFAR10.base_folder)
    md5 = {name: calculate_md5(batches / name) for name in [*names, "batches.meta"]}
    monkeypatch.setattr(CIFAR10, "train_list", [[n, md5[n]] for n in names[:5]])
    monkeypatch.setattr(CIFAR10, "test_list", [["test_batch", md5["test_batch"]]])
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": md5["batches.meta"]})
    monkeypatch.setattr(CIFAR10, "tgz_md5", calculate_md5(folder / CIFAR10.filename))
    return folder


def test_cifar10_is_downloaded_into_the_data_folder_unpacked_and_read_back_offline(
        cache, network, monkeypatch, tmp_path):
    network(Mirror(_small_cifar10(tmp_path / "server", monkeypatch)))
    first = load_dataset("cifar10", seed=0, download=True)
    assert first.train_x.shape == (10, 3, 32, 32) and first.test_x.shape == (2, 3, 32, 32)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
    assert _files(cache / "data") == sorted(f"cifar10/cifar-10-batches-py/{n}" for n in names)
    network(Forbidden())
    again = load_dataset("cifar10", seed=0, scaling="symmetric")  # the files, no network
    assert again.train_y.tolist() == first.train_y.tolist() == [0, 9] * 5
