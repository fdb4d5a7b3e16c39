"""``dpfl certs``: a certificate authority, a SuperLink certificate and SuperNode keys for a
federation over TLS with node authentication.

Writes into one folder:

* ``ca.crt`` / ``ca.key`` — a self-signed CA (SuperNodes and ``flwr`` trust ``ca.crt``:
  ``--root-certificates``, ``root-certificates`` of the connection);
* ``server.pem`` / ``server.key`` — the SuperLink's certificate, signed by the CA, valid for
  every ``--host`` (DNS names or IP addresses; ``localhost`` and ``127.0.0.1`` always);
* ``node-<i>.key`` / ``node-<i>.pub`` — one EC key pair (NIST P-384, OpenSSH format) per
  SuperNode: the private key goes to ``flower-supernode --auth-supernode-private-key``, the
  public key to ``flwr supernode register`` on a SuperLink started with
  ``--enable-supernode-auth``.

These are for a test federation: the CA key sits beside the certificates. A production
federation keeps its CA offline and generates each node's key on the node.
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dpfl.errors import UsageError

VALID_DAYS = 365
DEFAULT_HOSTS = ("localhost", "127.0.0.1")


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP384R1())


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
                 signer: ec.EllipticCurvePrivateKey, *, ca: bool,
                 hosts: Sequence[str] = ()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, encipher_only=False,
                          decipher_only=False), critical=True)
    else:
        builder = (builder
                   .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]),
                                  critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                                  critical=False))
    return builder.sign(signer, hashes.SHA256())


def files(nodes: int) -> list[str]:
    """The names :func:`generate` writes."""
    return (["ca.crt", "ca.key", "server.pem", "server.key"]
            + [f"node-{i}.{ext}" for i in range(nodes) for ext in ("key", "pub")])


def generate(folder: Path, nodes: int, hosts: Sequence[str] = ()) -> list[Path]:
    """Write the CA, the SuperLink certificate for ``hosts`` and ``nodes`` node key pairs into
    ``folder``; refuses to overwrite, and writes all the files or none."""
    if nodes < 0:
        raise UsageError(f"--nodes: {nodes} (allowed: an integer ≥ 0)")
    names = files(nodes)
    taken = [n for n in names if (folder / n).exists()]
    if taken:
        raise UsageError(f"{folder}: would overwrite {', '.join(taken)} (allowed: a folder "
                         "without them; remove them to generate new ones)")
    hosts = list(dict.fromkeys([*DEFAULT_HOSTS, *hosts]))
    ca_key, server_key = _key(), _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dpfl federation CA")])
    ca = _certificate("dpfl federation CA", ca_key, ca_name, ca_key, ca=True)
    server = _certificate(hosts[0], server_key, ca_name, ca_key, ca=False, hosts=hosts)
    content = {"ca.crt": ca.public_bytes(serialization.Encoding.PEM), "ca.key": _pem(ca_key),
               "server.pem": server.public_bytes(serialization.Encoding.PEM),
               "server.key": _pem(server_key)}
    for i in range(nodes):
        key = _key()
        content[f"node-{i}.key"] = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption())
        content[f"node-{i}.pub"] = key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n"
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".certs-", dir=folder))
    try:
        for name in names:
            path = staging / name
            path.write_bytes(content[name])
            path.chmod(0o600 if name.endswith(".key") else 0o644)
        for name in names:
            (staging / name).rename(folder / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [folder / n for n in names]
