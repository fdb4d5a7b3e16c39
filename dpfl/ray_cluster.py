"""An existing Ray cluster for the simulation runtime: its address checked, its room counted.

``flwr run`` on the local connection starts a managed SuperLink whose simulation runtime
(``flwr-simulation``) calls ``ray.init()``; with ``RAY_ADDRESS=HOST:PORT`` in its environment
that call attaches to the running cluster whose head (GCS) listens there instead of starting
Ray on this machine (Flower 1.41's federation config has no Ray address of its own). Flower
then creates one ClientApp actor per ``client-resources`` share of each alive node (its
``pool_size_from_resources``) and Ray places them, so the virtual SuperNodes' messages run on
every node. :func:`check_cluster` asks the head's GCS, before anything starts, that the
cluster answers and holds at least one actor, so a wrong address or resources that fit no node
end in one line instead of a run that fails after Ray's 30-second connect timeout.
"""

from __future__ import annotations

import math
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from dpfl.errors import UsageError
from dpfl.flower_internals import DEFAULT_SIMULATION_CONFIG

#: Flower's client-resources when the federation config names none
DEFAULT_CPUS = int(DEFAULT_SIMULATION_CONFIG.client_resources_num_cpus)
DEFAULT_GPUS = float(DEFAULT_SIMULATION_CONFIG.client_resources_num_gpus)
ADDRESS_HELP = ("HOST:PORT of a running Ray cluster's head, as `ray start --head --port PORT` "
                "prints it, e.g. 10.0.0.1:6379")


@dataclass(frozen=True)
class RayNode:
    """An alive node of the cluster: its address and the CPUs and GPUs it offers."""

    address: str
    cpus: float
    gpus: float

    def actors(self, cpus: int, gpus: float) -> int:
        """ClientApp actors of ``cpus`` CPUs and ``gpus`` GPUs that fit on this node
        (Flower's per-node rule: a GPU share on a node without GPUs fits none)."""
        fit = int(self.cpus / cpus)
        return min(fit, int(self.gpus / gpus)) if gpus > 0 else fit


def client_resources(cpus: int | None, gpus: float | None) -> tuple[int, float]:
    """``--client-cpus`` and ``--client-gpus`` checked, Flower's defaults for those not
    given."""
    cpus = DEFAULT_CPUS if cpus is None else cpus
    gpus = DEFAULT_GPUS if gpus is None else gpus
    if isinstance(cpus, bool) or not isinstance(cpus, int) or cpus < 1:
        raise UsageError(f"--client-cpus: {cpus!r} (allowed: an integer of at least 1, the "
                         "CPUs Ray reserves for each ClientApp actor)")
    if not (isinstance(gpus, int | float) and math.isfinite(gpus) and gpus >= 0):
        raise UsageError(f"--client-gpus: {gpus!r} (allowed: a number >= 0, the share of a "
                         "GPU Ray reserves for each ClientApp actor, e.g. 0.25)")
    return cpus, float(gpus)


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` (``[v6]:PORT`` too); UsageError otherwise."""
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--ray-address: {address!r} (allowed: {ADDRESS_HELP})")
    return host, int(port)


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Nothing on file descriptor 2 inside: Ray's C++ GCS client logs its connection retries
    there, and the one ``dpfl: error:`` line says what they mean."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def ray_nodes(address: str, timeout: float = 5.0) -> list[RayNode]:
    """The alive nodes of the Ray cluster whose head listens at ``address``, read from its
    GCS; UsageError naming ``--ray-address`` when nothing listens there or it is no Ray head
    (Ray's client waits 5 s to connect, then ``timeout``)."""
    host, port = split_address(address)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as error:
        raise UsageError(f"--ray-address: no Ray cluster answers at {address} "
                         f"({error.strerror or error}) (allowed: {ADDRESS_HELP})") from None
    # Ray's own client of the GCS, as `ray status` uses it: the public state API
    # (ray.util.state) asks the dashboard, which a cluster need not run
    from ray._raylet import InnerGcsClient
    from ray.core.generated.gcs_pb2 import GcsNodeInfo
    from ray.exceptions import RpcError

    try:
        with _quiet_stderr():
            gcs = InnerGcsClient.standalone(f"{host}:{port}", None, int(timeout * 1000))
            infos = gcs.get_all_node_info(timeout=timeout)
    except (RpcError, OSError) as error:
        raise UsageError(f"--ray-address: {address} answers, but not as a Ray cluster's head "
                         f"({error}) (allowed: {ADDRESS_HELP})") from None
    return [RayNode(info.node_manager_address, float(info.resources_total.get("CPU", 0)),
                    float(info.resources_total.get("GPU", 0)))
            for info in infos.values() if info.state == GcsNodeInfo.ALIVE]


def check_cluster(address: str, cpus: int, gpus: float) -> str:
    """Check that the cluster at ``address`` holds at least one ClientApp actor of ``cpus``
    CPUs and ``gpus`` GPUs; returns the line that says what it holds."""
    nodes = ray_nodes(address)
    actors = sum(node.actors(cpus, gpus) for node in nodes)
    room = (f"{len(nodes)} node{'s' * (len(nodes) != 1)}, "
            f"{sum(n.cpus for n in nodes):g} CPUs, {sum(n.gpus for n in nodes):g} GPUs")
    share = f"{cpus} CPU{'s' * (cpus != 1)}" + (f" and {gpus:g} GPU" if gpus else "")
    if actors == 0:
        raise UsageError(f"--client-cpus/--client-gpus: the Ray cluster at {address} ({room}) "
                         f"has no node with room for one ClientApp actor of {share} (allowed: "
                         f"--client-cpus at most the CPUs of a node, --client-gpus 0 on a "
                         f"cluster without GPUs)")
    return f"Ray cluster at {address}: {room}; {actors} ClientApp actors of {share}"
