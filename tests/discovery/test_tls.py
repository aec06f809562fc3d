"""etcd over TLS with client certificates: a service registers through https with the
configured CA, certificate and key; without a client certificate etcd refuses it, and the
service says it cannot reach etcd."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvservice import TransferService
from kvservice.discovery._etcd import Etcd, EtcdUnavailable
from kvservice.discovery.registry import DiscoveryUnavailable, options
from tests.helpers import config

from .conftest import _client_missing
from .etcd_server import EtcdServer, etcd_server

pytestmark = [pytest.mark.nixl]


def _cert(path: Path, name: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
          ca: bool = False) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer[0].subject if issuer else subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    (path / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (path / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    (path / f"{name}.key").chmod(0o600)
    return cert, key


async def test_registers_over_tls_with_a_client_certificate(tmp_path: Path) -> None:
    missing = _client_missing()
    if missing is not None:
        pytest.skip(missing)
    ca = _cert(tmp_path, "ca", None, ca=True)
    _cert(tmp_path, "server", ca)
    _cert(tmp_path, "client", ca)
    files = {n: str(tmp_path / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}
    with etcd_server(tmp_path, tls=(files["ca.pem"], files["server.pem"], files["server.key"])) as etcd:
        assert isinstance(etcd, EtcdServer)
        tls = {"discovery": "etcd", "etcd_endpoints": (f"https://{etcd.endpoint}",), "cluster": "tls",
               "discovery_name": "d0", "etcd_ca_file": files["ca.pem"], "etcd_connect_timeout_s": 2.0}
        async with TransferService(config(**tls, etcd_cert_file=files["client.pem"],
                                          etcd_key_file=files["client.key"])) as svc:
            assert svc.status()["discovery"]["registered"]
            client = await Etcd.connect(options(svc.config.discovery_settings))
            try:
                _, kvs = await client.list("/kvservice/tls/services/")
            finally:
                await client.close()
            assert [e.key for e in kvs] == [b"/kvservice/tls/services/d0"]
        # no client certificate: etcd refuses the handshake
        with pytest.raises(EtcdUnavailable):
            await Etcd.connect(options(config(**tls).discovery_settings))
        with pytest.raises(DiscoveryUnavailable, match="cannot reach etcd"):
            async with TransferService(config(**tls)):
                pytest.fail("started without a client certificate")
