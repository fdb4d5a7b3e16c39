"""Real Flower processes: a ``flower-superlink`` and ``flower-supernode`` processes hosting
cohorts of clients, driven by ``flwr run``, give the engine's model bit for bit (PriSMA: its
first round of its own, then x^t and x^{t−1} broadcast and the noisy v_i kept in each node's
``Context.state``; AdaptDP-FedAvg: two exchanges a round; two clients per node)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dpfl.config import format_overrides
from dpfl.engine import run
from dpfl.runconfig import RunConfig

pytestmark = pytest.mark.flower

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    """Stop a process started in its own session, with everything it started."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=10)
            # its children (SuperExec, app processes) share the group: make sure they are gone
            os.killpg(process.pid, signal.SIGKILL)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue
        return


@pytest.fixture
def deployment(tmp_path):
    """Start a SuperLink and the given SuperNodes (their ``partition-ids``) on free loopback
    ports; yields the environment for ``flwr run . local-deployment``; stops every process."""
    started: list[subprocess.Popen] = []
    home = tmp_path / "flwr-home"
    home.mkdir()
    port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local-deployment"\n\n[superlink.local-deployment]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    env = dict(os.environ, FLWR_HOME=str(home), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
               FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
    env.setdefault("DPFL_DATA_DIR", str((ROOT.parent / "shared" / "data").resolve()))

    def spawn(log: str, program: str, *args: str) -> None:
        with open(tmp_path / log, "w") as out:
            started.append(subprocess.Popen([str(BIN / program), *args], stdout=out,
                                            stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                            start_new_session=True))

    def start(nodes: list[str]) -> dict[str, str]:
        spawn("superlink.log", "flower-superlink", "--insecure", "--host", "127.0.0.1",
              "--port", str(port), "--disable-runtime-dependency-installation")
        for i, ids in enumerate(nodes):
            spawn(f"supernode-{i}.log", "flower-supernode", "--insecure", "--superlink",
                  f"127.0.0.1:{port}", "--port", str(_free_port()),
                  "--node-config", f'partition-ids="{ids}"')
        deadline = time.monotonic() + 120
        while (tmp_path / "superlink.log").read_text().count("Activated node_id") \
                < len(nodes):
            assert time.monotonic() < deadline, "the SuperNodes did not connect"
            assert all(p.poll() is None for p in started), "a Flower process exited"
            time.sleep(0.5)
        return env

    try:
        yield start
    finally:
        for process in reversed(started):
            _stop(process)
        assert all(p.poll() is not None for p in started)


CASES = {
    "prisma": {"algorithm": "prisma", "num-partitions": 4, "num-server-rounds": 3,
               "batch-size": 16, "seed": 5, "gamma": 0.3, "clip-diff": 0.2,
               "learning-rate": 0.5},
    # two exchanges a round: the noisy statistic sets C_r, then K local DP-SGD steps
    "adaptdp-fedavg": {"algorithm": "adaptdp-fedavg", "dataset": "quadratic",
                       "model": "least-squares", "num-partitions": 4, "num-server-rounds": 4,
                       "batch-size": 50, "local-steps": 5, "learning-rate": 0.4, "clip": 3.0,
                       "calibration": "paper", "epsilon": 1000.0, "delta": 1e-4, "seed": 3},
    # the server's public subspace broadcast each round, client sampling, k-number uploads
    "fedpcdp": {"algorithm": "fedpcdp", "dataset-options": "num_public=40",
                "model": "logistic", "num-partitions": 4, "num-server-rounds": 3,
                "fraction-train": 0.75, "batch-size": 40, "local-steps": 3, "clip": 0.5,
                "learning-rate": 0.5, "projection-dim": 12, "noise-multiplier": 2.0,
                "momentum": 0.5, "seed": 4},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_real_supernodes_equal_the_engine_bitwise(tmp_path, deployment, case):
    overrides = {**CASES[case], "results-dir": str(tmp_path / "results")}
    env = deployment(["0,1", "2,3"])
    done = subprocess.run(
        [str(BIN / "flwr"), "run", str(ROOT), "local-deployment", "--stream", "--run-config",
         format_overrides({**overrides, "run-name": "deployed"})],
        env=env, cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run(RunConfig({**overrides, "run-name": "engine"}), echo=False)
    deployed = torch.load(tmp_path / "results" / "deployed" / "model.pt")
    engine = torch.load(tmp_path / "results" / "engine" / "model.pt")
    for k in engine:
        assert torch.equal(deployed[k], engine[k]), k
    rounds = [[json.loads(line) for line in (tmp_path / "results" / name / "rounds.jsonl")
               .read_text().splitlines()] for name in ("deployed", "engine")]
    for d, e in zip(*rounds, strict=True):
        d.pop("seconds"), e.pop("seconds")
        assert d == e
