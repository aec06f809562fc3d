"""A rotated member signs its etcd registration with its new certificate
(docs/security.md "Rotation").

Decode-0 and prefill-0 register in a real etcd, each with a member identity.  Decode-0's
files are issued again while it runs: its entry in etcd is written again, signed under
the new certificate, and prefill-0 keeps it listed (nothing ignored).  Before, the entry
stayed signed under the certificate the service started with, so it would be refused by
every reader once that certificate ended."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from kvservice import TransferService
from kvservice._trust.authority import issue, serial_of
from kvservice.discovery.member import read
from tests.discovery.etcd_server import EtcdServer, etcd_server
from tests.discovery.test_hostile_etcd import raw_client
from tests.faults.test_member_identity import WAIT_S, Authority
from tests.helpers import config, eventually, members

pytestmark = [pytest.mark.nixl]

CLUSTER = "c1"
PREFIX = f"/kvservice/{CLUSTER}/services/"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    pytest.importorskip("aetcd", reason="the etcd client is not installed (pip install 'kvservice[etcd]')")
    with etcd_server(tmp_path) as server:
        yield server


def opts(etcd: EtcdServer, files: dict[str, Any], name: str, role: str) -> dict[str, Any]:
    return {"discovery": "etcd", "etcd_endpoints": (etcd.endpoint,), "cluster": CLUSTER, "discovery_name": name,
            "discovery_role": role, **files}


async def registered_serial(etcd: EtcdServer, name: str) -> int:
    """The serial of the certificate ``name``'s entry in etcd is signed under."""
    async with raw_client(etcd) as client:
        got = await client.get((PREFIX + name).encode())
    assert got is not None, name
    member = read((PREFIX + name).encode(), got.value, PREFIX)
    cert = getattr(member, "cert", "")
    assert cert, member
    return x509.load_der_x509_certificate(base64.b64decode(cert)).serial_number


async def test_a_rotated_member_signs_its_registration_with_the_new_certificate(etcd: EtcdServer,
                                                                               tmp_path: Path) -> None:
    cluster = Authority(tmp_path, CLUSTER)
    decode_files = cluster.member("decode-0", "decode")
    async with (TransferService(config(**opts(etcd, cluster.member("prefill-0"), "prefill-0", "prefill"))) as prefill,
                TransferService(config(**opts(etcd, decode_files, "decode-0", "decode"))) as decode):
        await eventually(members(prefill, lambda ms: [m.name for m in ms] == ["decode-0"]), timeout=WAIT_S)
        old = await registered_serial(etcd, "decode-0")
        assert old == serial_of(decode_files["identity_cert_file"])
        ignored = dict(prefill.status()["discovery"]["ignored"])

        cert, _ = issue(cluster.dir, "decode", "decode-0", cluster.dir, force=True)
        new = serial_of(cert)

        async def signed_anew() -> bool:
            return await registered_serial(etcd, "decode-0") == new

        await eventually(signed_anew, timeout=WAIT_S, interval=0.2, what="the entry signed under the new certificate")
        await eventually(members(prefill, lambda ms: [m.name for m in ms] == ["decode-0"]), timeout=WAIT_S)
        assert dict(prefill.status()["discovery"]["ignored"]) == ignored
        assert decode.status()["discovery"]["outages"] == 0
