"""A member claims only what its certificate names: its role (docs/security.md "Member
identities").

Every member here holds the cluster's key and a certificate of its own from the cluster's
authority.  Mallory is a member too and claims what is not hers: the role "prefill" with a
certificate for "decode" (in her configuration, and in an etcd registration she signs).
Each claim is refused with its
reason and counted; the real prefill's requests stay byte-exact.  Real NIXL agents, a real
etcd."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvservice import ConfigError
from kvservice._trust.identity import Identity, load_identity
from kvservice.discovery.member import Member, encode
from kvservice.discovery.signing import sign
from tests.discovery.conftest import etcd  # noqa: F401  (the fixture: a real etcd)
from tests.discovery.etcd_server import EtcdServer
from tests.discovery.test_hostile_etcd import GUARD_S, raw_client
from tests.discovery.test_signed_registrations import CLUSTER, PREFIX, linked
from tests.faults.test_member_identity import Authority, named
from tests.helpers import config, eventually

pytestmark = [pytest.mark.nixl]

@pytest.fixture
def cluster(tmp_path: Path) -> Authority:
    return Authority(tmp_path, CLUSTER)


def identity_of(files: dict[str, Any]) -> Identity:
    return load_identity(files["identity_cert_file"], files["identity_key_file"], files["identity_ca_file"])


# -- a role ------------------------------------------------------------------------------------------


def test_a_service_cannot_be_configured_in_a_role_its_certificate_does_not_name(cluster: Authority) -> None:
    """A member certified "decode" configured as ``discovery_role = "prefill"``: refused at
    start, naming both roles; as "decode" (or no role) it starts."""
    files = cluster.member("mallory", "decode")
    with pytest.raises(ConfigError, match=r"discovery_role: it claims role 'prefill', but its certificate for "
                                          r"kvservice://c1/decode/mallory names role 'decode'"):
        config(**files, discovery_role="prefill")
    assert config(**files, discovery_role="decode").identity() is not None
    assert config(**files).identity() is not None


@pytest.mark.slow
async def test_a_member_cannot_register_in_a_role_its_certificate_does_not_name(etcd: EtcdServer,  # noqa: F811
                                                                               cluster: Authority) -> None:
    """Mallory, certified "decode", writes her own etcd entry, signed by her own key, under
    role "prefill": the decode ignores it (``role``, counted) and lists only prefill-0 as a
    prefill (before, she was listed, and an engine picking a prefill by role could pick
    her).  The same entry under her certificate's role is listed.  prefill-0's traffic and
    its held request pass byte-exact throughout (``linked``)."""
    mallory = identity_of(cluster.member("mallory", "decode"))
    key = PREFIX + b"mallory"

    def entry(role: str) -> bytes:
        claim = Member(name="mallory", address="127.0.0.1:9", agent=named("mallory"), incarnation=time.time_ns(),
                       role=role)
        return encode(sign(mallory, CLUSTER, key, claim))

    async with linked(etcd, cluster) as (_, decode, _):
        async with raw_client(etcd) as client:
            await client.put(key, entry("prefill"))
        await eventually(lambda: decode.status()["discovery"]["ignored"]["role"] == 1, timeout=GUARD_S,
                         what=lambda: f"ignored: {decode.status()['discovery']['ignored']}")
        assert [m.name for m in await decode.live_peers("prefill")] == ["prefill-0"]
        assert [m.name for m in await decode.live_peers()] == ["prefill-0"]
        async with raw_client(etcd) as client:  # the same member in its own role: listed
            await client.put(key, entry("decode"))

        async def listed() -> bool:
            return [m.name for m in await decode.live_peers("decode")] == ["mallory"]
        await eventually(listed, timeout=GUARD_S)
        assert [m.name for m in await decode.live_peers("prefill")] == ["prefill-0"]
        assert decode.status()["discovery"]["ignored"]["role"] == 1
        async with raw_client(etcd) as client:
            await client.delete(key)

        async def gone() -> bool:
            return [m.name for m in await decode.live_peers()] == ["prefill-0"]
        await eventually(gone, timeout=GUARD_S)
