"""Launch ``flwr run`` on the local simulation connection, and clean up after it.

``flwr run .`` on the local connection starts a managed SuperLink (and its
SuperExec) that keeps running after the run. This launcher validates the run
config first (bad input never reaches Flower), runs ``flwr run`` with a private
``FLWR_HOME`` unless one is given, and stops the processes that run started, by
PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from dpfl.config import Value, format_overrides
from dpfl.runconfig import RunConfig, check_runtime

ROOT = Path(__file__).resolve().parents[1]



def _cmdlines() -> dict[int, str]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "cmdline").read_bytes()
                out[int(entry.name)] = raw.replace(b"\0", b" ").decode()
            except OSError:
                continue
    return out


def started_processes(flwr_home: Path) -> list[int]:
    """PIDs of the managed SuperLink of ``flwr_home`` and of its SuperExec children."""
    cmds = _cmdlines()
    links = [pid for pid, cmd in cmds.items()
             if "flower-superlink" in cmd and str(flwr_home) in cmd]
    execs = [pid for pid, cmd in cmds.items()
             if "flower-superexec" in cmd and any(f"--parent-pid {p}" in cmd for p in links)]
    return links + execs


def stop(pids: list[int], grace: float = 10.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.2)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def flwr_run(overrides: Mapping[str, Value], *, num_supernodes: int | None = None,
             flwr_home: Path | None = None, app_dir: Path = ROOT,
             timeout: float | None = None) -> int:
    """Run the dpfl app with ``flwr run`` (Ray simulation); returns its exit status."""
    config = RunConfig(overrides)  # raises ConfigError before anything starts
    check_runtime(config, "flower")
    values = dict(overrides)
    values["results-dir"] = str(Path(str(config["results-dir"])).expanduser().resolve())
    home = (flwr_home or Path(os.environ.get("FLWR_HOME", ROOT / ".flwr-home"))).resolve()
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
    env.setdefault("DPFL_DATA_DIR", str((ROOT.parent / "shared" / "data").resolve()))
    env.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    bindir = Path(sys.executable).parent  # flwr starts flower-superlink from PATH
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    flwr = bindir / "flwr"
    cmd = [str(flwr), "run", str(app_dir), "--stream", "--run-config", format_overrides(values),
           "--federation-config",
           f"num-supernodes={num_supernodes or int(config['num-partitions'])}"]
    before = set(started_processes(home))
    try:
        return subprocess.run(cmd, env=env, cwd=app_dir, timeout=timeout).returncode
    finally:
        stop([p for p in started_processes(home) if p not in before])
