"""Launch ``flwr run`` on a local simulation connection of its own, and clean up after it.

``flwr run .`` on the local connection starts a managed SuperLink (and its SuperExec) that
keeps running after the run, on ports that are the same for every run on the machine unless
``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` and ``FLWR_LOCAL_CONTROL_API_PORT`` say otherwise. This
launcher validates the run config first (bad input never reaches Flower), gives every
invocation a private ``FLWR_HOME`` and free loopback ports (so concurrent runs on one machine
never share a SuperLink), reads the run's final status from ``flwr ls`` (``flwr run --stream``
exits 0 whatever the run's fate), and stops the processes the run started, by PID: every
process whose environment carries the launch's ``DPFL_LAUNCH`` token (the SuperLink, the
simulation, Ray's processes), when the run ends and when it is interrupted (Ctrl-C or SIGTERM,
:mod:`dpfl.interrupt`). ``flwr run`` runs in a session of its own, so that an interruption
reaches this process alone, which stops the run in order: the ServerApp first, which closes its
results folder, while ``flwr run`` still streams its last lines into ``flower.log``. Given a
Ray address, the simulation runtime attaches to that running cluster instead of starting Ray
here (:mod:`dpfl.ray_cluster`, docs/multinode.md).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from dpfl.config import Value, format_overrides
from dpfl.errors import UsageError
from dpfl.federation import BIN, free_port
from dpfl.flower_app import app_folder
from dpfl.process_family import Family
from dpfl.problem import build_problem, data_dir
from dpfl.ray_cluster import check_cluster, client_resources
from dpfl.results import CLOSE_WAIT
from dpfl.runconfig import RunConfig, check_runtime


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


LAUNCH_ENV = "DPFL_LAUNCH"  # marks every process a launch starts (they inherit it)


def launched(token: str) -> list[int]:
    """PIDs of the processes whose environment holds ``DPFL_LAUNCH=token``: every process
    a launch started and whatever they started (the SuperLink, its SuperExec, the simulation
    and Ray's processes), even those that left the launch's process tree."""
    return marked(LAUNCH_ENV, token)


def marked(variable: str, value: str) -> list[int]:
    """PIDs of the processes, this one aside, whose environment holds ``variable=value``."""
    mark = f"{variable}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def simulations(token: str) -> list[int]:
    """PIDs of launch ``token``'s Flower simulation processes (each runs a ServerApp)."""
    cmds = _cmdlines()
    return [pid for pid in launched(token) if "flwr-simulation" in cmds.get(pid, "")]


def stop_launched(token: str, family: Family, settle: float = 2.0) -> None:
    """Stop every process of launch ``token`` (:func:`launched`) and of its ``family`` (those it
    started, marked or not: :mod:`dpfl.process_family`), again until none is left for
    ``settle`` seconds: a dying Ray node can still start an agent or two."""
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < settle:
        if pids := sorted(set(launched(token)) | set(family.living())):
            stop(pids)
            quiet_since = time.monotonic()
        else:
            time.sleep(0.25)


def started_processes(flwr_home: Path) -> list[int]:
    """PIDs of the managed SuperLink of ``flwr_home`` and of its SuperExec children."""
    cmds = _cmdlines()
    links = [pid for pid, cmd in cmds.items()
             if "flower-superlink" in cmd and str(flwr_home) in cmd]
    execs = [pid for pid, cmd in cmds.items()
             if "flower-superexec" in cmd and any(f"--parent-pid {p}" in cmd for p in links)]
    return links + execs


def running(pid: int) -> bool:
    """Whether ``pid`` is alive: it exists and is not a zombie waiting for its parent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def send(pids: list[int], signum: int) -> None:
    """Send ``signum`` to those of ``pids`` that still exist."""
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def stop(pids: list[int], grace: float = 10.0, signum: int = signal.SIGTERM) -> None:
    """Send ``signum`` to ``pids``; SIGKILL those still :func:`running` ``grace`` seconds on."""
    send(pids, signum)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(running(p) for p in pids):
        time.sleep(0.2)
    send(pids, signal.SIGKILL)


def interrupt_simulations(token: str) -> bool:
    """Send SIGINT to launch ``token``'s simulations, whose ServerApps close their results
    folders (in the time Flower's exit allows); whether there was one."""
    pids = simulations(token)
    send(pids, signal.SIGINT)
    return bool(pids)


ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Flower's and Ray's lines that say nothing about this run: its debug log (printed twice; a
# stopped simulation's in another format), hints about federations that dpfl sizes itself, the
# private FLWR_HOME it sets up
NOISE = re.compile(r"^\d\d/\d\d/\d{4} [\d:]+:(DEBUG|INFO):|^DEBUG:flwr:|^INFO :\s*$|"
                   r"Flower configuration not found|^Starting local SuperLink|^Using SuperLink|"
                   r"Starting logstream|Since flwr 1\.32|simulated SuperNodes\)|To change "
                   r"federation size|flwr federation simulation-config|Successfully installed "
                   r"dpfl to|Manually terminating ClientAppActor|^\s*$")


class Stream:
    """What ``flwr run --stream`` printed: all of it (``log``), whether a ``dpfl: error:`` line
    said what went wrong (``explained``), and the results folder the ServerApp named."""

    def __init__(self, verbose: bool = False) -> None:
        self.verbose = verbose
        self.log: list[str] = []
        self.explained = False
        self.results: Path | None = None
        self.in_traceback = False

    def echo(self, raw: str) -> None:
        """Keep the line ``raw`` and echo it, less (unless ``verbose``) colour codes, the lines
        in :data:`NOISE` and the tracebacks Flower logs for an app that raised (dpfl's own
        ``dpfl: error:`` line says what went wrong)."""
        self.log.append(raw)
        line = ANSI.sub("", raw)
        if line.startswith("done: ") and "; results in " in line:
            self.results = Path(line.rsplit("; results in ", 1)[1].strip())
        if not self.verbose:
            if line.startswith("Traceback (most recent call last):"):
                self.in_traceback = True
                return
            if self.in_traceback:
                self.in_traceback = line.startswith((" ", "\t"))  # its last line: the exception
                return
            if NOISE.search(line):
                return
        self.explained = self.explained or line.startswith("dpfl: error:")
        sys.stdout.write(raw if self.verbose else line)
        sys.stdout.flush()

    def write_log(self, fallback: Path) -> Path:
        """Flower's whole output as ``flower.log`` in the run's results folder (or, for a run
        that never opened one, ``flower-<time>.log`` in ``fallback``)."""
        path = (self.results / "flower.log" if self.results and self.results.is_dir() else
                fallback / f"flower-{time.strftime('%Y%m%d-%H%M%S')}.log")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(self.log))
        return path


@contextmanager
def killed_after(proc: subprocess.Popen, seconds: float | None) -> Iterator[None]:
    """Inside, ``proc`` is killed once ``seconds`` have passed (never, for None)."""
    timer = threading.Timer(seconds, proc.kill) if seconds else None
    if timer:
        timer.start()
    try:
        yield
    finally:
        if timer:
            timer.cancel()


def stream(cmd: list[str], env: Mapping[str, str], cwd: Path, seen: Stream,
           timeout: float | None, wind_down: Callable[[], bool],
           started: Callable[[int], None] = lambda pid: None) -> int:
    """Run ``cmd`` in a session of its own (the terminal's Ctrl-C reaches this process alone),
    its output echoed by ``seen``; returns its exit status. Past ``timeout`` seconds it is
    killed. Interrupted (Ctrl-C, SIGTERM), it calls ``wind_down()``, which asks the run to end
    and says whether there was one to end: then ``cmd``'s output, the run's last lines, is
    still echoed until it exits (:data:`~dpfl.results.CLOSE_WAIT` and a little more seconds at
    most) before the interruption goes on. ``started`` is given its PID."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    started(proc.pid)
    assert proc.stdout is not None
    try:
        with killed_after(proc, timeout):
            try:
                for raw in proc.stdout:
                    seen.echo(raw)
                return proc.wait()
            except KeyboardInterrupt:
                if wind_down():
                    with killed_after(proc, CLOSE_WAIT + 5):
                        for raw in proc.stdout:
                            seen.echo(raw)
                raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def final_status(flwr: Path, env: Mapping[str, str], cwd: Path) -> tuple[str, str]:
    """``(status, details)`` of the latest run on the connection ``env`` points to, from
    ``flwr ls --format json`` (``finished:completed`` when it succeeded)."""
    listed = subprocess.run([str(flwr), "ls", "--format", "json"], env=env, cwd=cwd, text=True,
                            capture_output=True, timeout=120)
    try:
        runs = json.loads(listed.stdout)["runs"]
        latest = max(runs, key=lambda r: int(r["run-id"]))
        return str(latest["status"]), str(latest["status-details"])
    except (ValueError, KeyError, TypeError):
        return "unknown", (listed.stdout + listed.stderr).strip()[-300:]


def simulation_env(home: Path) -> dict[str, str]:
    """The environment of a ``flwr run`` on a local simulation connection of its own: a private
    ``FLWR_HOME``, free loopback ports for its managed SuperLink, no runtime dependency
    installation, and this interpreter's scripts first on ``PATH``."""
    return dict(os.environ, FLWR_HOME=str(home), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
                FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(free_port()),
                FLWR_LOCAL_CONTROL_API_PORT=str(free_port()),
                PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def flwr_run(overrides: Mapping[str, Value], *, num_supernodes: int | None = None,
             flwr_home: Path | None = None, timeout: float | None = None,
             verbose: bool = False, ray_address: str | None = None,
             client_cpus: int | None = None, client_gpus: float | None = None) -> int:
    """Run the dpfl app with ``flwr run`` (Ray simulation) on a SuperLink of its own; returns
    0 when the run finished completed, else non-zero (one ``dpfl: error:`` line saying how
    it ended). The app is a temporary copy of the app folder, from the checkout or the
    installed wheel (:func:`dpfl.flower_app.app_folder`). Flower's whole output goes to
    ``flower.log`` in the run's results folder, however the run ends (interrupted too); the
    console shows it less Flower's and Ray's noise (all of it with ``verbose``).

    ``ray_address`` (``HOST:PORT`` of a running Ray cluster's head; this machine must be one
    of its nodes) runs the ClientApps on that cluster instead of a Ray started here; it is
    checked to answer and to hold a ClientApp actor first. ``client_cpus`` and ``client_gpus``
    are Flower's ``client-resources`` per ClientApp actor (default 2 CPUs, no GPU): a node of
    ``n`` CPUs runs ``n // client_cpus`` actors at once."""
    config = RunConfig(overrides)  # raises ConfigError before anything starts
    cpus, gpus = client_resources(client_cpus, client_gpus)  # Flower's, where not given
    if ray_address is not None:
        print(check_cluster(ray_address, cpus, gpus))
    clients = config.data.num_partitions
    if num_supernodes is not None and not 0 < num_supernodes <= clients:
        raise UsageError(f"--num-supernodes {num_supernodes}: {clients} clients "
                         f"(num-partitions={clients}) for {num_supernodes} SuperNodes, a "
                         f"SuperNode would host none (allowed: 1 to {clients}; fewer "
                         f"SuperNodes than clients host blocks of them)")
    build_problem(config)  # so do the data, the split and the model
    check_runtime(config, "flower")
    federation: dict[str, Value] = {"num-supernodes": num_supernodes or clients}
    if client_cpus is not None or client_gpus is not None:
        federation.update({"client-resources-num-cpus": cpus, "client-resources-num-gpus": gpus})
    values = dict(overrides)
    results = Path(config.run.results_dir).expanduser().resolve()
    values["results-dir"] = str(results)
    home = (flwr_home or Path(tempfile.mkdtemp(prefix="dpfl-flwr-home-"))).resolve()
    env = simulation_env(home)
    token = env[LAUNCH_ENV] = secrets.token_hex(8)
    env["DPFL_DATA_DIR"] = data_dir(config)  # the folder resolved here, for the app's processes
    env.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    if ray_address is not None:  # read by the simulation runtime's ray.init()
        env["RAY_ADDRESS"] = ray_address.strip()
    flwr = BIN / "flwr"
    before = set(started_processes(home))
    with Family() as family:  # all it starts, marked or not: dpfl.process_family
        try:
            with app_folder() as app_dir:
                cmd = [str(flwr), "run", str(app_dir), "--stream", "--run-config",
                       format_overrides(values), "--federation-config",
                       format_overrides(federation)]
                seen = Stream(verbose)
                try:
                    code = stream(cmd, env, app_dir, seen, timeout,
                                  wind_down=lambda: interrupt_simulations(token),
                                  started=family.follow)
                finally:  # kept however the run ended, interrupted included
                    log = seen.write_log(results)
                if code == 0:
                    status, details = final_status(flwr, env, app_dir)
                    if status != "finished:completed":
                        print(f"dpfl: error: the Flower run ended {status}"
                              + ("" if seen.explained else f": {details}")
                              + f" (Flower's log: {log})", file=sys.stderr)
                        code = 1
            return code
        finally:  # done, failed or interrupted (Ctrl-C, SIGTERM): nothing it started outlives
            # it. The simulation (the ServerApp's process) is not in the terminal's process
            # group, and the SIGINT Flower's parent monitor raises when its SuperExec stops
            # reaches a thread that is not the main one: it is interrupted here (an interrupted
            # stream did so already), and closes its results folder in the time Flower's exit
            # allows, before the rest is stopped
            stop(simulations(token), grace=CLOSE_WAIT + 5, signum=signal.SIGINT)
            stop([p for p in started_processes(home) if p not in before])
            stop_launched(token, family)
            if flwr_home is None:
                shutil.rmtree(home, ignore_errors=True)
