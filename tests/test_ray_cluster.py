"""``flwr run`` on a running multi-node Ray cluster (``dpfl flower --ray-address``): the
ClientApps run on every node, and the model is the engine's, bit for bit.

The cluster is two Ray nodes on this machine, each on a loopback address of its own (Ray
replaces 127.0.0.1 itself by the machine's outward address, so the nodes take 127.0.0.2 and
127.0.0.3), each with one CPU and a node cache folder of its own; both are started with
``ray start --block`` in a process group of their own and stopped by that group.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from dpfl.engine import run
from dpfl.errors import UsageError
from dpfl.federation import free_port
from dpfl.launch import flwr_run, started_processes
from dpfl.problem import data_dir
from dpfl.ray_cluster import check_cluster, ray_nodes
from dpfl.runconfig import RunConfig

RAY = Path(sys.executable).parent / "ray"
needs_ray = pytest.mark.skipif(not RAY.is_file(), reason=f"the `ray` command ({RAY}) is not "
                               "installed: `ray start` starts the cluster's nodes")

# LIBSVM duke, read from $DPFL_DATA_DIR: the nodes' ClientApps see it in `ray start`'s
# environment, not in dpfl's
CASE = {"algorithm": "dpsgd-gc", "dataset": "duke", "model": "logistic", "num-partitions": 4,
        "num-server-rounds": 2, "batch-size": 8, "seed": 7}


class Cluster:
    """Ray nodes started by ``ray start --block`` under ``folder``; ``head`` is the address
    of the first one's GCS."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        # Ray's sockets live under its temp dir: keep the path short (AF_UNIX paths are short)
        self.temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        self.nodes: list[subprocess.Popen] = []
        self.head = f"127.0.0.2:{free_port()}"

    def start_node(self, ip: str) -> Path:
        """Start the next node on loopback address ``ip`` (the head first; a worker once the
        head's GCS answers); returns its node cache folder (``DPFL_CACHE_DIR`` of the
        ClientApps it runs)."""
        i = len(self.nodes)
        cache = self.folder / f"node-{i}-cache"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(DPFL_DATA_DIR=data_dir(RunConfig(CASE)), DPFL_CACHE_DIR=str(cache),
                   RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0")
        role = (["--head", "--port", self.head.rsplit(":", 1)[1], "--include-dashboard",
                 "false", "--dashboard-port", str(free_port()), "--ray-client-server-port",
                 str(free_port())] if i == 0 else ["--address", self.head])
        with open(self.folder / f"node-{i}.log", "w") as out:
            self.nodes.append(subprocess.Popen(
                [str(RAY), "start", "--block", *role, "--node-ip-address", ip, "--num-cpus",
                 "1", "--num-gpus", "0", "--object-store-memory", str(100 << 20), "--temp-dir",
                 str(self.temp), "--disable-usage-stats", "--dashboard-agent-listen-port", "0"],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        if i == 0:
            self.wait(lambda: _answers(self.head), "the head's GCS does not answer")
        return cache

    def wait(self, done: Callable[[], bool], message: str, timeout: float = 60) -> None:
        """Poll ``done`` until it holds; fail with ``message`` and the nodes' logs after
        ``timeout`` seconds or as soon as a node's ``ray start`` exits."""
        deadline = time.monotonic() + timeout
        while not done():
            logs = "".join(log.read_text()[-1500:] for log in self.folder.glob("node-*.log"))
            assert all(node.poll() is None for node in self.nodes), f"ray start exited: {logs}"
            assert time.monotonic() < deadline, f"{message}: {logs}"
            time.sleep(0.2)

    def leftovers(self) -> list[str]:
        """Processes of these nodes still running: in their process groups, or naming their
        temp dir (a worker Ray started elsewhere would)."""
        groups = {p.pid for p in self.nodes}
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if stat[0] != "Z" and (int(stat[2]) in groups or str(self.temp) in cmd):
                found.append(f"{entry.name} {cmd[:120]}")
        return found

    def stop(self) -> None:
        """SIGTERM each node's process group (workers first), SIGKILL what is left."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for node in reversed(self.nodes):
                try:
                    os.killpg(node.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 20
            while self.leftovers() and time.monotonic() < deadline:
                time.sleep(0.2)
            for node in self.nodes:
                if node.poll() is None:
                    try:
                        node.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
            if not self.leftovers():
                return


def _answers(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture
def cluster(tmp_path) -> Iterator[tuple[Cluster, list[Path]]]:
    """A head and a worker node of one CPU each; their node cache folders."""
    nodes = Cluster(tmp_path)
    try:
        caches = [nodes.start_node("127.0.0.2"), nodes.start_node("127.0.0.3")]
        nodes.wait(lambda: len(ray_nodes(nodes.head)) == 2, "the worker did not join")
        yield nodes, caches
    finally:
        nodes.stop()
        left = nodes.leftovers()
        shutil.rmtree(nodes.temp, ignore_errors=True)
        assert not left, f"Ray processes left running: {left}"


def _actor_nodes(address: str) -> list[tuple[str, str, str]]:
    """(class, state, node address) of every actor the cluster's GCS has known, read by a
    driver of its own (the state API proper, ray.util.state, needs Ray's dashboard)."""
    script = ("import json, ray\n"
              f"ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False)\n"
              "where = {n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes()}\n"
              "print(json.dumps([(a['ActorClassName'], a['State'], "
              "where[a['Address']['NodeID']]) for a in ray._private.state.actors().values()]))\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return [tuple(a) for a in json.loads(done.stdout.strip().splitlines()[-1])]


@pytest.mark.flower
@needs_ray
@pytest.mark.serial  # another test's ray.init() would attach to this `ray start` cluster
def test_clients_run_on_every_node_of_a_ray_cluster_and_equal_the_engine(tmp_path, cluster,
                                                                         capsys):
    nodes, caches = cluster
    overrides = {**CASE, "results-dir": str(tmp_path / "results")}
    home = tmp_path / "flwr-home"
    with pytest.raises(UsageError, match="no node with room for one ClientApp actor of 2 CPUs"):
        check_cluster(nodes.head, 2, 0.0)  # Flower's default client-resources
    code = flwr_run({**overrides, "run-name": "flower"}, flwr_home=home, timeout=180,
                    ray_address=nodes.head, client_cpus=1)
    assert code == 0
    assert f"Ray cluster at {nodes.head}: 2 nodes, 2 CPUs, 0 GPUs; 2 ClientApp actors of 1 CPU" \
        in capsys.readouterr().out
    assert started_processes(home) == []
    actors = _actor_nodes(nodes.head)
    clients = [a for a in actors if a[0] == "ClientAppActor"]
    assert sorted(a[2] for a in clients) == ["127.0.0.2", "127.0.0.3"], actors
    # each node built its clients' rows in its own node cache: ClientApps ran on both
    for cache in caches:
        assert list((cache / "nodes").glob("data-*.pt")), f"no ClientApp ran with {cache}"
    run(RunConfig({**overrides, "run-name": "engine"}), echo=False)
    flower, engine = (torch.load(tmp_path / "results" / name / "model.pt")
                      for name in ("flower", "engine"))
    assert flower.keys() == engine.keys()
    assert all(torch.equal(flower[k], engine[k]) for k in engine)


@pytest.mark.parametrize("address, said", [
    ("127.0.0.1:{port}", "no Ray cluster answers at 127.0.0.1:{port} (Connection refused)"),
    ("head-without-port", "'head-without-port' (allowed: HOST:PORT of a running Ray cluster"),
], ids=["refused", "no-port"])
def test_a_ray_address_that_does_not_answer_is_one_line(tmp_path, capsys, address, said):
    """``dpfl flower --ray-address`` that reaches no Ray head: one ``dpfl: error:`` line
    naming the option, status 2, before any Flower process starts."""
    from dpfl.cli import main

    port = free_port()
    code = main(["flower", "--ray-address", address.format(port=port), "-c",
                 f'num-partitions=4 results-dir="{tmp_path}"'])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"dpfl: error: --ray-address: {said.format(port=port)}")
    assert not any(tmp_path.iterdir())  # no run started
