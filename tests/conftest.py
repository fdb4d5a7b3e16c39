"""Shared test setup: the datasets from ``$DPFL_DATA_DIR``, else the user's data folder; small fast
configurations."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from dpfl.datasets.loading import data_folder

ROOT = Path(__file__).resolve().parents[1]
# the datasets are read (never downloaded) from $DPFL_DATA_DIR, else from the user's own data
# folder (dpfl's per-user cache), fixed here before the cache below is made temporary
os.environ.setdefault("DPFL_DATA_DIR", str(data_folder()))
# downloads and the nodes' caches of every run the tests start (Flower's included) go to a
# folder of this session, removed at its end: the tests leave nothing in the user's cache
if "DPFL_CACHE_DIR" not in os.environ:
    os.environ["DPFL_CACHE_DIR"] = tempfile.mkdtemp(prefix="dpfl-test-cache-")
    atexit.register(shutil.rmtree, os.environ["DPFL_CACHE_DIR"], ignore_errors=True)
# the nodes' state (clients' state files, ledgers, keys) of every run the tests start goes to a
# folder of this session too
if "DPFL_STATE_DIR" not in os.environ:
    os.environ["DPFL_STATE_DIR"] = tempfile.mkdtemp(prefix="dpfl-test-state-")
    atexit.register(shutil.rmtree, os.environ["DPFL_STATE_DIR"], ignore_errors=True)
# Flower's usage telemetry is off in every process the tests start (and in the compose
# containers): the tests send traffic only to loopback and to what they start
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"


def bash_blocks(doc: Path) -> list[str]:
    """The bodies of ``doc``'s plain ```` ```bash ```` blocks (the commands a reader copies;
    recipes, whose info string names them, are :mod:`tests.test_docs`')."""
    return re.findall(r"^```bash\n(.*?)^```", doc.read_text(), re.S | re.M)


@pytest.fixture
def small_config(tmp_path):
    """A few rounds of DPSGD-GC on digits with 4 clients (seconds on 2 cores)."""
    from dpfl.runconfig import RunConfig

    def make(**changes):
        values = {"num-partitions": 4, "num-server-rounds": 3, "batch-size": 16,
                  "results-dir": str(tmp_path / "results"), "run-name": "t"}
        values.update({k.replace("_", "-"): v for k, v in changes.items()})
        return RunConfig(values)

    return make


def _placeholder_plot(rounds, folder: Path, *, title: str, chance) -> None:
    """An empty ``summary.png`` where a run would draw it."""
    (folder / "summary.png").touch()


@pytest.fixture(autouse=True)
def summary_plot(request, monkeypatch):
    """Runs in a test's own process write an empty ``summary.png`` instead of drawing it (the
    drawing is about 0.25 s of CPU a run: a fifth of ``make test-fast`` by a profile); whether
    a run writes one is still seen. Tests marked ``summary_plot`` draw it: the figure is checked
    by ``tests/test_plots.py``. The processes a test starts draw it as usual."""
    if request.node.get_closest_marker("summary_plot") is None:
        from dpfl import plots

        monkeypatch.setattr(plots, "plot_summary", _placeholder_plot)


@pytest.fixture
def device(request) -> str:
    """This session's device (``--device``), for a test to pass on to the processes it starts:
    they do not see the session's default of the run-config key ``device``."""
    return request.config.getoption("--device")


def pytest_addoption(parser):
    parser.addoption("--device", choices=("cpu", "cuda"), default="cpu",
                     help="the default of the run-config key 'device' in this session: "
                     "--device cuda runs every test that leaves it unset on the GPU")


def share_the_cores(config) -> None:
    """Each pytest-xdist worker, and every process it starts, gets its share of the cores.
    torch's default, a thread a core in every worker, oversubscribes them, and its threads'
    spin-waits then make small tensor operations tens of times slower (an audit test: 5 s in
    one process, 236 s in each of two workers). The worker count is known only here, from
    xdist's worker input (not from the environment when this file is imported)."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if workers == 1 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def pytest_configure(config):
    share_the_cores(config)
    device = config.getoption("--device")
    if device != "cpu":
        import dataclasses

        from dpfl import config as params
        from dpfl import runconfig

        common = tuple(dataclasses.replace(p, default=device) if p.key == "device" else p
                       for p in params.COMMON)
        params.COMMON = runconfig.COMMON = common


def groups_kept(config, items) -> None:
    """Under ``--dist loadgroup`` the tests of an ``xdist_group`` run on one worker, so that
    their module's shared fixtures (the smoke reproductions) are built once: pytest-xdist marks
    them by a suffix of their node id, which a pytest release it does not support can drop
    without a word (pytest 9.2 with pytest-xdist 3.8.0). Stop the worker with one line then."""
    if getattr(config.option, "dist", None) != "loadgroup" or not hasattr(config, "workerinput"):
        return
    lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist ignored the xdist_group of {lost[0]} (and {len(lost) - 1} more) under "
            f"pytest {pytest.__version__}: install the pytest pyproject.toml's test extra allows")


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which suffixes the grouped ids
def pytest_collection_modifyitems(config, items):
    groups_kept(config, items)
    if config.getoption("--device") == "cpu":
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            item.add_marker(pytest.mark.skip(reason=f"--device {config.getoption('--device')}: "
                                             f"{marker.args[0]}"))


@pytest.fixture(scope="session")
def app(tmp_path_factory) -> Path:
    """dpfl's Flower app folder (:func:`dpfl.flower_app.write_app`), written once a session,
    for the tests that call ``flwr run`` themselves: the checkout's FAB, which Flower builds
    without visiting every file of the checkout's ``.venv`` (seconds a run)."""
    from dpfl.flower_app import write_app

    return write_app(tmp_path_factory.mktemp("app") / "dpfl")
