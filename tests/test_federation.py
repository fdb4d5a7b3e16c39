"""The local federation's ports: drawn outside the range the system hands out itself."""

import socket
from pathlib import Path

import pytest

from dpfl.federation import PORTS, free_port


def test_free_ports_lie_outside_the_systems_own_range_and_are_free():
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low, high = map(int, ephemeral.read_text().split()) if ephemeral.exists() else (49152, 65535)
    ports = [free_port() for _ in range(200)]
    assert all(p in PORTS and not low <= p <= high for p in ports)
    assert len(set(ports)) > 150  # drawn at random, not one port over and over
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_taken_port_is_never_returned(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr("dpfl.federation.PORTS", range(port, port + 1))  # only that one
        with pytest.raises(OSError, match=f"no free loopback port in {port}-{port}"):
            free_port()
