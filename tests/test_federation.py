"""The local federation: its ports drawn outside the range the system hands out itself; a
process that exits while it comes up named with the last line of its log; a SuperNode whose
port was taken meanwhile started again."""

import socket
import subprocess
from pathlib import Path

import pytest

from dpfl.federation import PORTS, FederationError, LocalFederation, free_port, wait_for


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


def test_a_process_that_exits_while_the_federation_comes_up_is_named_with_its_log(tmp_path):
    federation = LocalFederation(tmp_path)
    process = federation.spawn("node.log", "python", "-c",
                               "print('starting'); print('ERROR: port 1234 taken'); print()")
    process.wait(timeout=60)
    with pytest.raises(FederationError) as error:
        wait_for(lambda: False, "the SuperNodes did not connect", federation.started,
                 logs=federation.logs)
    assert str(error.value).endswith(
        "python exited with status 0 (node.log: ERROR: port 1234 taken)")
    other = subprocess.Popen(["true"])
    other.wait(timeout=60)
    with pytest.raises(FederationError, match="status 0$"):  # no log known: the status alone
        wait_for(lambda: False, "down", [other], timeout=60)


def test_a_supernode_whose_port_was_taken_meanwhile_starts_again_on_another(tmp_path,
                                                                            monkeypatch):
    """The port drawn for a SuperNode's runtime API is taken before it binds (another process
    drew it too): the SuperNode exits, saying so, and is started again on a fresh port."""
    import dpfl.federation as federation_module

    real, draws = federation_module.free_port, []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", real()))
        taken.listen()

        def drawn() -> int:  # the SuperLink's port, then the taken one, then free ones
            draws.append(taken.getsockname()[1] if len(draws) == 1 else real())
            return draws[-1]

        monkeypatch.setattr(federation_module, "free_port", drawn)
        with LocalFederation(tmp_path / "federation") as federation:
            federation.start(["0"])
            # a third draw: the SuperNode was started again, and is up
            assert len(draws) == 3 and federation.nodes[0].poll() is None
