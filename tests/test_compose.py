"""docker-compose: the project's image, Flower's compose layout (SuperLink, the ServerApp's
SuperExec, three SuperNodes with their ClientApp SuperExecs), 3 rounds of Clip21-SGD2M through
``flwr run``, its uploads summed by Flower's SecAgg+ with each client's noise split over the
three; the model equals the engine's in the same image, bit for bit. Runs wherever a
Docker daemon and docker-compose are reachable (skipped with the reason otherwise), on host
networking: every container on the host's loopback. Every container it starts is removed."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch

from dpfl.config import format_overrides
from dpfl.federation import BIN, free_port

pytestmark = pytest.mark.flower

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "dpfl:latest"


def _docker_unavailable() -> str | None:
    if shutil.which("docker") is None or shutil.which("docker-compose") is None:
        return "docker or docker-compose is not installed"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True)
    if info.returncode != 0:
        return "no Docker daemon is reachable"
    return None


def _base_image() -> str:
    """``DPFL_BASE_IMAGE``, else python:3.11-slim where it is on the daemon already or can be
    pulled, else a local Debian base built by deploy/base-image.sh (no registry needed)."""
    if base := os.environ.get("DPFL_BASE_IMAGE"):
        return base
    for image in ("python:3.11-slim", "dpfl-base:bookworm"):
        if subprocess.run(["docker", "image", "inspect", image],
                          capture_output=True).returncode == 0:
            return image
    try:
        if subprocess.run(["docker", "pull", "python:3.11-slim"], capture_output=True,
                          timeout=120).returncode == 0:
            return "python:3.11-slim"
    except subprocess.TimeoutExpired:
        pass  # no registry: build a local base
    built = subprocess.run(["bash", str(ROOT / "deploy" / "base-image.sh")],
                           capture_output=True, text=True, timeout=1200)
    if built.returncode != 0:
        pytest.skip(f"no base image: python:3.11-slim cannot be pulled and "
                    f"deploy/base-image.sh failed ({built.stderr.strip()[-200:]})")
    return "dpfl-base:bookworm"


@pytest.mark.skipif(bool(_docker_unavailable()), reason=_docker_unavailable() or "")
def test_compose_federation_equals_the_engine_bitwise(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    ports = {name: str(free_port()) for name in
             ("SUPERLINK_PORT", "NODE_0_PORT", "NODE_1_PORT", "NODE_2_PORT")}
    env = dict(os.environ, **ports, DPFL_RESULTS=str(results), BASE_IMAGE=_base_image(),
               DPFL_USER=f"{os.getuid()}:{os.getgid()}", FLWR_HOME=str(tmp_path / "flwr-home"),
               FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
    (tmp_path / "flwr-home").mkdir()
    (tmp_path / "flwr-home" / "config.toml").write_text(
        f'[superlink]\ndefault = "compose"\n\n[superlink.compose]\n'
        f'address = "127.0.0.1:{ports["SUPERLINK_PORT"]}"\ninsecure = true\n')
    compose = ["docker-compose", "-p", f"dpfltest{uuid.uuid4().hex[:8]}", "-f",
               str(ROOT / "docker-compose.yml"), "-f",
               str(ROOT / "deploy" / "compose.host-network.yml")]
    overrides = {"algorithm": "clip21-sgd2m", "num-partitions": 3, "num-server-rounds": 3,
                 "seed": 3, "secure-aggregation": True, "distributed-noise": True}
    try:
        built = subprocess.run([*compose, "build"], env=env, cwd=ROOT, capture_output=True,
                               text=True, timeout=1800)
        assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
        up = subprocess.run([*compose, "up", "-d"], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
        assert up.returncode == 0, up.stderr[-2000:]
        deadline = time.monotonic() + 180
        while subprocess.run([*compose, "logs", "superlink"], env=env, cwd=ROOT,
                             capture_output=True, text=True).stdout.count("Activated node_id") < 3:
            assert time.monotonic() < deadline, "the SuperNodes did not connect"
            time.sleep(1)
        done = subprocess.run(
            [str(BIN / "flwr"), "run", str(ROOT), "compose", "--stream", "--run-config",
             format_overrides({**overrides, "run-name": "compose"})],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "round 3/3" in done.stdout
        engine = subprocess.run(
            ["docker", "run", "--rm", "--network", "none", "-u", env["DPFL_USER"], "-v",
             f"{results}:/app/results", IMAGE, "dpfl", "run", "--run-config",
             format_overrides({**overrides, "run-name": "engine"})],
            capture_output=True, text=True, timeout=300)
        assert engine.returncode == 0, engine.stderr[-2000:]
    finally:
        subprocess.run([*compose, "down", "--remove-orphans", "--volumes"], env=env, cwd=ROOT,
                       capture_output=True, timeout=300)
    deployed = torch.load(results / "compose" / "model.pt")
    local = torch.load(results / "engine" / "model.pt")
    assert deployed.keys() == local.keys()
    for k in local:
        assert torch.equal(deployed[k], local[k]), k
    left = subprocess.run(["docker", "ps", "-aq", "--filter",
                           f"label=com.docker.compose.project={compose[2]}"],
                          capture_output=True, text=True)
    assert left.stdout.strip() == ""
