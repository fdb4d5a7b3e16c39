"""``dpfl certs``: the CA, the SuperLink certificate and the node keys are what Flower and TLS
accept; bad input writes nothing."""

from __future__ import annotations

import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from dpfl.cli import main


def test_certificates_chain_and_name_every_host(tmp_path, capsys):
    assert main(["certs", str(tmp_path), "--nodes", "2", "--host", "link.example.org",
                 "--host", "10.0.0.7"]) == 0
    assert "wrote 8 files" in capsys.readouterr().out
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "link.example.org"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"),
                                                      ipaddress.ip_address("10.0.0.7")]
    key = serialization.load_pem_private_key((tmp_path / "server.key").read_bytes(), None)
    assert key.public_key().public_numbers() == server.public_key().public_numbers()
    assert (tmp_path / "ca.key").stat().st_mode & 0o077 == 0


def test_node_keys_load_as_flower_loads_them(tmp_path):
    """Flower reads the private key with ``load_ssh_private_key`` and the registered public
    key with ``load_ssh_public_key``, and wants NIST EC keys."""
    assert main(["certs", str(tmp_path), "--nodes", "3"]) == 0
    for i in range(3):
        private = serialization.load_ssh_private_key((tmp_path / f"node-{i}.key").read_bytes(),
                                                     None)
        public = serialization.load_ssh_public_key((tmp_path / f"node-{i}.pub").read_bytes())
        assert isinstance(private, ec.EllipticCurvePrivateKey)
        assert isinstance(public.curve, ec.SECP384R1)
        assert private.public_key().public_numbers() == public.public_numbers()
    keys = {(tmp_path / f"node-{i}.pub").read_bytes() for i in range(3)}
    assert len(keys) == 3


def test_bad_input_writes_nothing(tmp_path, capsys):
    assert main(["certs", str(tmp_path / "out"), "--nodes", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "dpfl: error: --nodes: -1 (allowed: an integer ≥ 0)"
    assert not (tmp_path / "out").exists()


def test_existing_files_are_never_overwritten(tmp_path, capsys):
    (tmp_path / "server.key").write_text("mine")
    assert main(["certs", str(tmp_path), "--nodes", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "would overwrite server.key (allowed:" in err
    assert (tmp_path / "server.key").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server.key"]
