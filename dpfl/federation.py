"""A local federation of real Flower processes: a ``flower-superlink`` and ``flower-supernode``
processes on free loopback ports, plain or over TLS with SuperNode authentication, and a
connection ``local-deployment`` for ``flwr run``; every process is started in its own session
and stopped, with whatever it started, by PID. The deployment tests and the deployment benchmark
run on it; docs/deployment.md shows the same commands for machines of your own.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from dpfl.certs import generate

BIN = Path(sys.executable).parent
CONNECTION = "local-deployment"


#: Where :func:`free_port` draws from: above Ray's worker ports (10002-19999) and below the
#: ports systems hand out themselves (Linux from 32768, BSD, macOS and Windows from 49152).
PORTS = range(20000, 32768)


def free_port() -> int:
    """A TCP port free on loopback now, drawn at random from :data:`PORTS`. Not one the system
    hands out (``bind`` to port 0): the system hands the same range to every outgoing
    connection, Ray's and other runs' included, and one of them could take the port between
    this check and the server's bind (a managed SuperLink then exits at start)."""
    for _ in range(100):
        port = PORTS[secrets.randbelow(len(PORTS))]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise OSError(f"no free loopback port in {PORTS.start}-{PORTS.stop - 1} after 100 draws")


def stop(process: subprocess.Popen) -> None:
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


class FederationError(RuntimeError):
    """A local federation did not come up, or did not go down."""


#: the last line of a SuperNode's log when the port drawn for its runtime API was taken
#: between the draw and its bind (another process drew it too): started again on another port
PORT_TAKEN = "Runtime HTTP API failed to start"
PORT_TRIES = 3  # starts of one SuperNode, each on a port drawn afresh


def wait_for(done: Callable[[], bool], message: str, watched: list[subprocess.Popen],
             timeout: float = 120, logs: Mapping[int, Path] | None = None) -> None:
    """Poll ``done`` until it holds; :class:`FederationError` with ``message`` after
    ``timeout`` seconds, or as soon as one of ``watched`` exits (with the last line of its
    log, where ``logs`` has one for its pid)."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            raise FederationError(f"{message} after {timeout:g} s")
        exited = [p for p in watched if p.poll() is not None]
        if exited:
            process = exited[0]
            log = (logs or {}).get(process.pid)
            said = f" ({log.name}: {last_line(log)})" if log is not None else ""
            raise FederationError(f"{message}: {process.args[0]} exited with status "
                                  f"{process.returncode}{said}")
        time.sleep(0.5)


def last_line(log: Path) -> str:
    """The last line of ``log`` that is not blank (at most 300 characters), or "empty"."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    return next((line[:300] for line in reversed(lines) if line), "empty")


class LocalFederation:
    """SuperLink and SuperNodes as local processes, logs and ``FLWR_HOME`` under ``folder``.

    ``start(nodes)`` starts one SuperNode per entry, its ``partition-ids`` node config, and
    returns the environment for ``flwr run . local-deployment``; ``close()`` stops everything.
    """

    def __init__(self, folder: Path, env: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.home = folder / "flwr-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.certs = folder / "certs"
        self.port = free_port()
        self.started: list[subprocess.Popen] = []
        self.logs: dict[int, Path] = {}  # each started process's log, by pid
        self.nodes: list[subprocess.Popen] = []
        self.env = dict(env if env is not None else os.environ, FLWR_HOME=str(self.home),
                        PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
                        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
        self._superlink_args: list[str] = []

    def spawn(self, log: str, program: str, *args: str) -> subprocess.Popen:
        with open(self.folder / log, "w") as out:
            self.started.append(subprocess.Popen(
                [str(BIN / program), *args], stdout=out, stderr=subprocess.STDOUT, env=self.env,
                cwd=self.folder, start_new_session=True))
        self.logs[self.started[-1].pid] = self.folder / log
        return self.started[-1]

    def supernode(self, name: str, ids: str, *security: str,
                  node_config: str = "") -> subprocess.Popen:
        """A SuperNode hosting the clients ``ids`` ("0,3"), logging to ``<name>.log``, with
        more ``node_config`` entries (e.g. ``data-path="site.npz"``)."""
        return self.spawn(f"{name}.log", "flower-supernode", *security, "--superlink",
                          f"127.0.0.1:{self.port}", "--port", str(free_port()),
                          "--node-config", f'partition-ids="{ids}" {node_config}'.strip())

    def node_security(self, i: int) -> list[str]:
        """Node ``i``'s flags: its key and the CA under TLS, ``--insecure`` otherwise."""
        return (["--root-certificates", str(self.certs / "ca.crt"),
                 "--auth-supernode-private-key", str(self.certs / f"node-{i}.key")]
                if self.certs.exists() else ["--insecure"])

    def start(self, nodes: list[str], *, tls: bool = False, database: bool = False,
              node_config: dict[int, str] | None = None, policy: str = "") -> dict[str, str]:
        """Start the SuperLink (over TLS with SuperNode authentication: certificates and one
        node key more than ``nodes``, every node's but the last registered; ``database``: its
        state in ``superlink.db``) and the SuperNodes (node ``i`` with ``node_config[i]``
        and every node with ``policy``, e.g. ``trust-server=true``, besides its
        ``partition-ids``); wait until they are connected."""
        connection = (f'root-certificates = "{self.certs / "ca.crt"}"' if tls
                      else "insecure = true")
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "127.0.0.1:{self.port}"\n{connection}\n')
        security = ["--insecure"]
        if tls:
            generate(self.certs, nodes=len(nodes) + 1)
            security = ["--ssl-ca-certfile", str(self.certs / "ca.crt"), "--ssl-certfile",
                        str(self.certs / "server.pem"), "--ssl-keyfile",
                        str(self.certs / "server.key"), "--enable-supernode-auth"]
        if database:
            security += ["--database", str(self.folder / "superlink.db")]
        self._superlink_args = [*security, "--host", "127.0.0.1", "--port", str(self.port),
                                "--disable-runtime-dependency-installation"]
        self.superlink = self.spawn("superlink.log", "flower-superlink", *self._superlink_args)
        if tls:
            for i in range(len(nodes)):
                wait_for(lambda i=i: subprocess.run(
                    [str(BIN / "flwr"), "supernode", "register", str(self.certs / f"node-{i}.pub"),
                     CONNECTION], env=self.env, capture_output=True).returncode == 0,
                    "the SuperLink did not register the node keys", self.started,
                    logs=self.logs)
        extra = node_config or {}
        specs = [(f"supernode-{i}", ids, self.node_security(i),
                  f"{extra.get(i, '')} {policy}".strip()) for i, ids in enumerate(nodes)]
        self.nodes = [self.supernode(name, ids, *flags, node_config=config)
                      for name, ids, flags, config in specs]
        attempt = 1
        while True:
            try:
                wait_for(lambda: (self.folder / "superlink.log").read_text().count(
                    "Activated node_id") >= len(nodes), "the SuperNodes did not connect",
                    self.started, logs=self.logs)
                return self.env
            except FederationError:
                taken = [i for i, node in enumerate(self.nodes) if node.poll() is not None
                         and PORT_TAKEN in last_line(self.logs[node.pid])]
                others = [p for p in self.started if p.poll() is not None
                          and p not in [self.nodes[i] for i in taken]]
                if attempt == PORT_TRIES or not taken or others:
                    raise
                attempt += 1
                for i in taken:  # exited: nothing to stop
                    self.started.remove(self.nodes[i])
                    name, ids, flags, config = specs[i]
                    self.nodes[i] = self.supernode(name, ids, *flags, node_config=config)

    def restart_superlink(self) -> None:
        """Kill the SuperLink process (not the ServerApp it started) and start it again with
        the same arguments, its database included."""
        os.kill(self.superlink.pid, signal.SIGKILL)
        self.superlink.wait(timeout=30)
        self.superlink = self.spawn("superlink-restarted.log", "flower-superlink",
                                    *self._superlink_args)

    def close(self) -> None:
        for process in reversed(self.started):
            stop(process)
        alive = [p.pid for p in self.started if p.poll() is None]
        if alive:
            raise FederationError(f"processes {alive} outlived their SIGKILL")

    def __enter__(self) -> LocalFederation:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
