"""The node-local cache (``dpfl.client.cache``): a node's view of a run equals the whole run's
for its clients; a message with a warm cache loads no dataset library and no accountant (a node
checking its budget: no Opacus package); a changed data file, an unreadable entry or an
unwritable folder never serve wrong data."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from dpfl.client import cache
from dpfl.client.cache import node_problem
from dpfl.datasets import loading
from dpfl.problem import build_problem, cached_problem
from dpfl.runconfig import RunConfig

DIGITS = {"algorithm": "dpsgd-gc", "num-partitions": 5, "seed": 3, "batch-size": 8}


def _items(values: dict) -> tuple:
    return tuple(sorted(RunConfig(values).as_dict().items()))


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path / "cache"))
    for cached in (node_problem, cached_problem, loading._load):
        cached.cache_clear()
    yield tmp_path / "cache" / "nodes"
    for cached in (node_problem, cached_problem, loading._load):
        cached.cache_clear()


def test_node_view_equals_the_run(folder):
    run = build_problem(RunConfig(DIGITS))
    node = node_problem(_items(DIGITS), (1, 3))
    for clients in ([1, 3], [3], [1]):
        mine, whole = node.cohort(clients), run.cohort(clients)
        assert torch.equal(mine.x, whole.x) and torch.equal(mine.y, whole.y)
        assert [len(i) for i in mine.indices] == [len(i) for i in whole.indices]
    assert node.releases(3) == run.releases(3) and node.server_releases() == run.server_releases()
    assert torch.equal(node.x0, run.x0)
    assert len(node.dataset.train_y) == len(run.partitions[1]) + len(run.partitions[3])
    with pytest.raises(ValueError, match=r"clients \[0\] are not hosted"):
        node.cohort([0, 1])
    with pytest.raises(ValueError, match="not hosted"):
        node.releases(2)
    assert len(list(folder.glob("data-*.pt"))) == len(list(folder.glob("releases-*.json"))) == 1
    # another run name or results folder: the same entries; another noise: new releases only
    node_problem(_items({**DIGITS, "run-name": "other", "results-dir": "elsewhere"}), (1, 3))
    node_problem(_items({**DIGITS, "noise-multiplier": 2.0}), (1, 3))
    assert len(list(folder.glob("data-*.pt"))) == 1
    assert len(list(folder.glob("releases-*.json"))) == 2


@pytest.mark.slow
def test_a_warm_message_loads_no_dataset_library_and_no_opacus_package(folder):
    """A message with a warm cache loads no dataset library and no accountant; a default-policy
    node's budget check after it (ε of its ledger with the round's releases) runs Opacus' RDP
    analysis without Opacus' package ``__init__`` (its PrivacyEngine, optimizers and
    scipy.stats: about 2 s of CPU a message) and gets the ε of Opacus' own accountant."""
    from opacus.accountants import RDPAccountant

    from dpfl.privacy import rdp

    script = (
        "import sys, dpfl.client.app\n"
        "from dpfl.client.cache import node_problem\n"
        "from dpfl.client.node_ledger import NodeLedger\n"
        "from dpfl.runconfig import RunConfig\n"
        f"problem = node_problem(tuple(sorted(RunConfig({DIGITS!r}).as_dict().items())), (0,))\n"
        "heavy = ('opacus', 'torchvision', 'flwr_datasets', 'datasets', 'sklearn', 'pandas',"
        " 'scipy', 'matplotlib')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "ledger = NodeLedger()\n"
        "ledger.charge('run', 1, problem.releases(0), every=1)\n"
        "print(repr(ledger.epsilon('rdp', 1e-5, problem.releases(0))))\n"
        "print(sorted(m for m in ('opacus', 'scipy.stats') if m in sys.modules))\n")
    cold, warm = (subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                 check=True).stdout.splitlines() for _ in range(2))
    assert "sklearn" in cold[0] and "opacus" not in cold[0]  # the first message calibrates
    assert warm[0] == "[]" and warm[2] == "[]", warm
    accountant = RDPAccountant()
    for release in 2 * cached_problem(_items(DIGITS)).releases(0):
        z, q, steps = release.event
        for _ in range(steps):
            accountant.step(noise_multiplier=z, sample_rate=q)
    # an interior order of Opacus' defaults: bit for bit
    assert float(cold[1]) == float(warm[1]) == accountant.get_epsilon(1e-5)
    assert rdp.DEFAULT_ORDERS == tuple(RDPAccountant.DEFAULT_ALPHAS)


def _svmlight(folder, rows: int) -> None:
    (folder / "libsvm").mkdir(parents=True, exist_ok=True)
    lines = [f"{1 if i % 2 else -1} 1:{i + 1} 3:0.5" for i in range(rows)]
    for name in ("a9a", "a9a.t"):
        (folder / "libsvm" / name).write_text("\n".join(lines) + "\n")


def test_a_changed_data_file_is_not_served_from_the_cache(folder, tmp_path):
    data = tmp_path / "data"
    _svmlight(data, 20)
    values = {**DIGITS, "dataset": "a9a", "model": "logistic", "num-partitions": 2,
              "data-dir": str(data)}
    before = node_problem(_items(values), (0,))
    _svmlight(data, 30)
    for cached in (node_problem, cached_problem, loading._load):  # a fresh message's process
        cached.cache_clear()
    after = node_problem(_items(values), (0,))
    assert (len(before.dataset.train_y), len(after.dataset.train_y)) == (10, 15)
    assert len(list(folder.glob("data-*.pt"))) == 2


def test_a_changed_npz_outside_the_data_folder_is_not_served_from_the_cache(folder, tmp_path):
    rng = np.random.default_rng(0)

    def write(n: int) -> None:
        np.savez(tmp_path / "mine.npz", train_x=rng.normal(size=(n, 4)),
                 train_y=rng.integers(0, 2, n), test_x=rng.normal(size=(5, 4)),
                 test_y=rng.integers(0, 2, 5))

    write(20)
    values = {**DIGITS, "dataset": "npz", "num-partitions": 2,
              "dataset-options": f'path="{tmp_path / "mine.npz"}"'}
    before = node_problem(_items(values), (0,))
    write(30)
    for cached in (node_problem, cached_problem, loading._load):  # a fresh message's process
        cached.cache_clear()
    after = node_problem(_items(values), (0,))
    assert (len(before.dataset.train_y), len(after.dataset.train_y)) == (10, 15)
    assert len(list(folder.glob("data-*.pt"))) == 2


def test_an_edited_data_module_is_not_served_from_the_cache(folder, tmp_path, monkeypatch):
    """``dataset="module:callable"``: the user edits the module between runs; a node keys its
    cached rows by the module's file too, and builds them again."""
    import importlib
    import os

    module = tmp_path / "edited_data.py"

    def write(rows: int) -> None:
        module.write_text(
            "import numpy as np\n\n\n"
            "def load(*, seed):\n"
            "    rng = np.random.default_rng(seed)\n"
            f"    x, y = rng.normal(size=({rows}, 4)).astype(np.float32), "
            f"rng.integers(0, 2, {rows})\n"
            "    return x, y, x[:5], y[:5]\n")

    monkeypatch.syspath_prepend(str(tmp_path))
    write(20)
    values = {**DIGITS, "dataset": "edited_data:load", "num-partitions": 2}
    before = node_problem(_items(values), (0,))
    write(30)
    os.utime(module, ns=(module.stat().st_atime_ns, module.stat().st_mtime_ns + 10**9))
    importlib.reload(importlib.import_module("edited_data"))  # a fresh message's process
    from dpfl.datasets import reference

    for cached in (node_problem, cached_problem, loading._load, reference._load):
        cached.cache_clear()
    after = node_problem(_items(values), (0,))
    assert (len(before.dataset.train_y), len(after.dataset.train_y)) == (10, 15)
    assert len(list(folder.glob("data-*.pt"))) == 2


def test_an_unreadable_entry_is_rebuilt(folder):
    node_problem(_items(DIGITS), (2,))
    expected = cached_problem(_items(DIGITS)).cohort([2])
    for entry in [*folder.glob("data-*.pt"), *folder.glob("releases-*.json")]:
        entry.write_bytes(b"half a file")
    node_problem.cache_clear()
    again = node_problem(_items(DIGITS), (2,))
    assert torch.equal(again.cohort([2]).x, expected.x)
    assert json.loads(next(folder.glob("releases-*.json")).read_text())
    assert torch.load(next(folder.glob("data-*.pt")), weights_only=True)["clients"] == [2]


def test_an_unwritable_folder_warns_and_works(tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("DPFL_CACHE_DIR", str(blocked))
    node_problem.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="dpfl"):
            node = node_problem(_items(DIGITS), (4,))
    finally:
        node_problem.cache_clear()
    assert torch.equal(node.cohort([4]).x, build_problem(RunConfig(DIGITS)).cohort([4]).x)
    assert "cannot be written" in caplog.text and "DPFL_CACHE_DIR" in caplog.text


def test_only_the_most_recently_used_entries_are_kept(folder, monkeypatch):
    node_problem(_items(DIGITS), (0,))
    size = next(folder.glob("data-*.pt")).stat().st_size
    monkeypatch.setattr(cache, "KEEP_BYTES", int(2.5 * size))  # two entries of this size
    monkeypatch.setattr(cache, "KEEP_RELEASES", 3)
    used = dict.fromkeys(folder.glob("data-*.pt"))
    for seed in (1, 2, 3):
        node_problem(_items({**DIGITS, "seed": seed}), (0,))
    kept = set(folder.glob("data-*.pt"))
    assert len(kept) == 2 and not kept & set(used)
    assert len(list(folder.glob("releases-*.json"))) == 3
