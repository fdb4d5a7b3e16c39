"""Commands users copy from the docs run as they are written.

A fenced block whose info string names a recipe (```` ```bash recipe="loopback" ````) is part
of a runnable recipe: the blocks of one recipe, in the order the docs give them, are run as one
bash script (``set -e``), from dpfl's checkout as a user would, in a session of its own that
is stopped whole at the end. A doc change that breaks a command fails here.

- ``readme``: the README's two commands (``make test`` only collects the suite here: it is
  the suite);
- ``loopback``: docs/deployment.md's TLS federation of three SuperNodes on loopback (nothing
  it started left running after its ``kill``), and the same stopped mid-run by SIGTERM (the
  same with a mistake made: tests/test_deployment_guide.py);
- ``ray-one-machine``: docs/multinode.md's two-node Ray cluster on this machine;
- ``compose-tls``: docs/deployment.md's docker-compose with TLS (where a Docker daemon is
  reachable).

The recipes use the ports their docs name; a port in use fails the test with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.interrupting import MARK, lingering

# fixed ports (the docs' own) and `ray stop`, which stops every Ray node of the machine
pytestmark = [pytest.mark.flower, pytest.mark.serial]

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r'^```(\w+) recipe="([\w-]+)"\n(.*?)^```', re.S | re.M)
VENV = ROOT / ".venv" / "bin"


def recipes() -> dict[str, str]:
    """Every recipe of the docs: its blocks joined, in the order the docs give them."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for language, name, body in BLOCK.findall(doc.read_text()):
            assert language == "bash", f"{doc.name}: recipe {name!r} is not bash"
            found.setdefault(name, []).append(body)
    return {name: "".join(blocks) for name, blocks in found.items()}


def test_every_recipe_is_run_by_a_test():
    assert set(recipes()) == {"readme", "loopback", "ray-one-machine", "compose-tls"}


def ports_free(*ports: int) -> None:
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                pytest.fail(f"port {port}, which the recipe uses as its docs say, is in use")


def needs_the_checkouts_venv() -> None:
    if Path(sys.executable).parent != VENV:
        pytest.skip(f"the recipes activate {VENV}, which this test run does not use")


def start_recipe(script: str, log: Path, env: dict[str, str] | None = None,
                 temp: Path | None = None) -> subprocess.Popen:
    """Start ``script`` (a recipe's blocks) with bash from the checkout, in a session of its
    own, its output to ``log`` (``TMPDIR``: ``temp``, by default a new short folder in /tmp,
    where its ``mktemp -d`` folders go)."""
    path = log.with_suffix(".sh")
    path.write_text("set -e\n" + script)
    # a wide terminal, so that tables (`flwr ls`) are not cut; a short TMPDIR, under which Ray
    # makes its sockets (AF_UNIX paths are short)
    temp = temp or Path(tempfile.mkdtemp(prefix="d", dir="/tmp"))
    environment = {**os.environ, "TMPDIR": str(temp), "COLUMNS": "250", **(env or {})}
    for key in ("FLWR_HOME", "VIRTUAL_ENV"):
        environment.pop(key, None)
    with open(log, "w") as out:
        return subprocess.Popen(["bash", str(path)], cwd=ROOT, env=environment, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def stop_session(proc: subprocess.Popen) -> None:
    """Stop whatever is left of ``proc``'s session."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            time.sleep(2)
        except ProcessLookupError:
            break


def run_recipe(name: str, tmp_path: Path, *, timeout: float = 900,
               env: dict[str, str] | None = None, temp: Path | None = None,
               leaves_nothing: bool = False) -> str:
    """Run recipe ``name`` (:func:`start_recipe`); returns its output; fails with it on a
    non-zero exit, and, where it ``leaves_nothing``, on a process it started that is still
    running 30 s after it ended. Everything it started is stopped at the end (its session)."""
    token = uuid.uuid4().hex
    proc = start_recipe(recipes()[name], tmp_path / f"{name}.log", {**(env or {}), MARK: token},
                        temp)
    try:
        code = proc.wait(timeout=timeout)
        left = lingering(token) if leaves_nothing else []
    finally:
        stop_session(proc)
    output = (tmp_path / f"{name}.log").read_text()
    assert code == 0, output[-4000:]
    assert left == [], f"left running: {left}"
    return output


def folder_of(output: str) -> Path:
    """The ``mktemp -d`` folder a recipe printed (``cd "$(mktemp -d)" && pwd``)."""
    return Path(next(line for line in output.splitlines() if line.startswith("/")))


def test_the_deployment_guides_loopback_recipe_runs_as_written(tmp_path):
    """TLS, node keys registered, three SuperNodes of their default policy, each start waited
    for (`dpfl wait-for`), `flwr run`, `flwr ls`: the run completed, shown in full, and its ε
    holds against the server (secret noise on every node)."""
    needs_the_checkouts_venv()
    ports_free(9092, 9094, 9095, 9096)
    # an 80-column terminal, where `flwr ls`'s table would cut the status to `finished…`
    output = run_recipe("loopback", tmp_path, leaves_nothing=True, env={"COLUMNS": "80"})
    assert "this node can serve dpfl runs" in output and '"status": "finished:completed"' in output
    assert re.search(r"^the SuperLink answers at loopback \(\d+ s\)$", output, re.M)
    assert re.search(r"^3 SuperNodes online at loopback \(\d+ s\)$", output, re.M)
    summary = json.loads((folder_of(output) / "results" / "loopback" / "summary.json")
                         .read_text())
    assert summary["rounds_completed"] == 3
    assert summary["privacy"]["guarantee_against_server"] is True
    assert summary["privacy"]["noise"] == {"secure": 3}


def test_sigterm_to_the_loopback_recipe_mid_run_stops_everything_it_started(tmp_path):
    """What a CI timeout or a scheduler sends a federation it started, SIGTERM to its process
    group, in the middle of a run (of 100 rounds here): the SuperLink, the SuperNodes and every
    process they started (SuperExecs, the ServerApp, ClientApps) stop, and the ServerApp
    closes its results folder first (``stopped_early``)."""
    needs_the_checkouts_venv()
    ports_free(9092, 9094, 9095, 9096)
    script = recipes()["loopback"]
    assert "num-server-rounds=3 " in script
    token, log = uuid.uuid4().hex, tmp_path / "loopback.log"
    proc = start_recipe(script.replace("num-server-rounds=3 ", "num-server-rounds=100 "), log,
                        {MARK: token})
    try:
        deadline = time.monotonic() + 600
        while not _round_done(log):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        left = lingering(token)
    finally:
        stop_session(proc)
    assert left == []
    summary = json.loads((folder_of(log.read_text()) / "results" / "loopback" / "summary.json")
                         .read_text())
    assert summary["rounds_completed"] < 100 and summary["stopped_early"]


def _round_done(log: Path) -> bool:
    """Whether the loopback recipe logging to ``log`` has a run with a round done."""
    output = log.read_text()
    if not any(line.startswith("/") for line in output.splitlines()):
        return False
    rounds = folder_of(output) / "results" / "loopback" / "rounds.jsonl"
    return rounds.exists() and rounds.stat().st_size > 0


def test_the_multinode_guides_one_machine_recipe_runs_as_written(tmp_path):
    needs_the_checkouts_venv()
    if not (VENV / "ray").is_file():
        pytest.skip("the `ray` command is not installed")
    ports_free(6380)
    # Ray's sockets live under TMPDIR, whose path must stay short (AF_UNIX paths are short)
    temp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    try:
        output = run_recipe("ray-one-machine", tmp_path, temp=temp)
        results = folder_of(output) / "results" / "on-two-nodes"
        summary = json.loads((results / "summary.json").read_text())
        log = (results / "flower.log").read_text()
    finally:
        subprocess.run([str(VENV / "ray"), "stop", "--force"], capture_output=True,
                       timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
    assert summary["rounds_completed"] == 2 and "dpsgd-gc" in log
    # two ClientApp actors of one CPU on two nodes of one CPU: one actor on each node. (Ray
    # forwards the actors' own lines, which name their node's address, to the run's log only
    # when they arrive before Flower's log stream closes: not a check that can be relied on.)
    assert ("Ray cluster at 127.0.0.2:6380: 2 nodes, 2 CPUs, 0 GPUs; 2 ClientApp actors of "
            "1 CPU") in output


def test_the_readmes_two_commands_run_as_written(tmp_path):
    """``make run`` (the demo, in the checkout: its results folder is removed afterwards) and
    ``make test``, which here only collects the suite (it is the suite)."""
    needs_the_checkouts_venv()
    results = ROOT / "results"
    before = set(results.iterdir()) if results.is_dir() else set()
    try:
        output = run_recipe("readme", tmp_path, env={"PYTEST_ADDOPTS": "--collect-only -q"})
    finally:
        for made in (set(results.iterdir()) if results.is_dir() else set()) - before:
            shutil.rmtree(made) if made.is_dir() else made.unlink()
        if results.is_dir() and not before:
            results.rmdir()
    assert "source .venv/bin/activate" in output
    assert "the demo: a local SuperLink, Ray and 10 simulated SuperNodes" in output  # not silent
    quoted = re.search(r"`(round 30/30 \| [^`]*)`", (ROOT / "README.md").read_text()).group(1)
    assert re.search(r"^" + re.escape(quoted) + r" \| ", output, re.M), quoted  # what it prints
    assert re.search(r"^tests/test_docs\.py: \d+$", output, re.M)  # make test collected


def _docker() -> str | None:
    if shutil.which("docker") is None or shutil.which("docker-compose") is None:
        return "docker or docker-compose is not installed"
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return "no Docker daemon is reachable"
    return None


@pytest.mark.skipif(bool(_docker()), reason=_docker() or "")
def test_the_compose_tls_recipe_runs_as_written(tmp_path):
    """The compose TLS overlay, from a copy of the checkout (its certificates, connection and
    results stay there); every container and volume it started is removed."""
    from tests.test_compose import _base_image

    needs_the_checkouts_venv()
    ports_free(9092)
    copy = tmp_path / "dpfl"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    (copy / ".venv").symlink_to(ROOT / ".venv")
    project = f"dpfldocs{os.getpid()}"
    env = {"BASE_IMAGE": _base_image(), "COMPOSE_PROJECT_NAME": project,
           "FLWR_TELEMETRY_ENABLED": "0", "COLUMNS": "250"}  # `flwr ls` shows whole cells
    script = tmp_path / "compose-tls.sh"
    try:
        script.write_text("set -e\n" + recipes()["compose-tls"])
        with open(tmp_path / "compose-tls.log", "w") as out:
            code = subprocess.run(["bash", str(script)], cwd=copy, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=2400,
                                  env={**os.environ, **env}).returncode
    finally:
        subprocess.run(["docker-compose", "-f", "docker-compose.yml", "-f",
                        "docker-compose.override.yml", "-f", "docker-compose.tls.yml", "down",
                        "--remove-orphans", "--volumes"], cwd=copy, capture_output=True,
                       env={**os.environ, **env}, timeout=300)
    output = (tmp_path / "compose-tls.log").read_text()
    assert code == 0, output[-4000:]
    assert "finished:completed" in output
    summary = json.loads((copy / "results" / "compose-tls" / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and summary["privacy"]["noise"] == {"secure": 3}
    left = subprocess.run(["docker", "ps", "-aq", "--filter",
                           f"label=com.docker.compose.project={project}"],
                          capture_output=True, text=True)
    assert left.stdout.strip() == ""
