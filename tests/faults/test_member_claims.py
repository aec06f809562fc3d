"""A member claims only what its certificate names: its role, and its own SGLang ranks
(docs/security.md "Member identities").

Every member here holds the cluster's key and a certificate of its own from the cluster's
authority.  Mallory is a member too and claims what is not hers: the role "prefill" with a
certificate for "decode" (in her configuration, and in an etcd registration she signs),
and rank 0/0 of a prefill's SGLang bootstrap registry.  Each claim is refused with its
reason and counted; the real prefill's requests stay byte-exact.  Real NIXL agents, a real
prefill process, a real etcd, the registry's real HTTP server."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from kvservice import ConfigError, TransferService
from kvservice._trust.identity import Identity, load_identity, member_of
from kvservice._trust.keys import load_key
from kvservice.discovery.member import Member, encode
from kvservice.discovery.signing import sign
from kvservice.integrations.sglang import bootstrap, registration
from kvservice.testing import PeerProcess
from tests.discovery.conftest import etcd  # noqa: F401  (the fixture: a real etcd)
from tests.discovery.etcd_server import EtcdServer
from tests.discovery.test_hostile_etcd import GUARD_S, raw_client
from tests.discovery.test_signed_registrations import CLUSTER, PREFIX, linked
from tests.faults.test_member_identity import Authority, legit, named
from tests.helpers import config, eventually, peer_config, peers

pytestmark = [pytest.mark.nixl]

INFO = {"attn_tp_size": 1, "dp_size": 1, "page_size": 16, "kv_cache_dtype": "auto", "is_mla": False}


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


# -- an SGLang rank ----------------------------------------------------------------------------------


def claim(reg: bootstrap.Registry, address: str, incarnation: str, key: bytes, identity: Identity | None,
          status: int) -> None:
    """Register rank 0/0 at ``address``: refused with HTTP ``status``."""
    with pytest.raises(bootstrap.BootstrapError, match=f"refused the registration \\({status}\\)"):
        bootstrap.register(f"127.0.0.1:{reg.port}", 0, 0, address, INFO, key=key, incarnation=incarnation,
                           identity=identity, timeout=10)


async def receives(prefill: PeerProcess, decode: TransferService, reg: bootstrap.Registry, rid: str) -> None:
    """The decode looks rank 0/0 up (as an SGLang decode rank does) and receives ``rid``
    from whoever it names, byte-exact: the prefill process."""
    info, ranks = bootstrap.lookup(f"127.0.0.1:{reg.port}", timeout=10)
    assert info == INFO and ranks == {"0/0": prefill.address}, ranks
    await legit(prefill, decode, rid)


async def test_a_member_cannot_take_another_members_sglang_rank(cluster: Authority) -> None:
    """prefill-0's registry (its identity, as ``KVBootstrapServer`` loads it) holds rank 0/0
    of the real prefill process.  Mallory, a member with the cluster's key and a
    certificate of her own, registers rank 0/0 at her own address: with only the MAC (the
    issue's attack: before, her entry replaced the rank and the decode's next room read
    her bytes), signed as herself, signed under prefill-0's agent name, with prefill-0's
    certificate but her key, and with a certificate naming prefill-0 in role "decode".
    Each is refused with its reason and counted; the rank stays the prefill's and the
    decode receives from it byte-exact; prefill-0 restarted (a new incarnation, signed)
    moves the rank."""
    prefill_files = cluster.member("prefill-0")
    owner = identity_of(prefill_files)
    key = load_key(cluster.key)
    reg = bootstrap.Registry("127.0.0.1", 0, key=key, identity=owner)
    try:
        async with (peers(peer_config(**prefill_files)) as (prefill,),
                    TransferService(config(**cluster.member("decode-0", "decode"))) as decode,
                    TransferService(config(**cluster.member("mallory"))) as mallory):
            bootstrap.register(f"127.0.0.1:{reg.port}", 0, 0, prefill.address, INFO, key=key,
                               incarnation=prefill.agent, identity=owner, timeout=10)
            await receives(prefill, decode, reg, "before")
            own = identity_of(cluster.member("mallory"))
            claim(reg, mallory.address, mallory.agent_name, key, None, 401)  # the MAC alone
            claim(reg, mallory.address, mallory.agent_name, key, own, 403)  # signed as herself
            claim(reg, mallory.address, named("prefill-0"), key, own, 401)  # under prefill-0's agent name
            borrowed = Identity(owner.cert, owner.der, own.key, own.ca, owner.member)
            claim(reg, mallory.address, named("prefill-0"), key, borrowed, 401)  # prefill-0's certificate
            der, decode_key = cluster.forged("kvservice://c1/decode/prefill-0")
            cert = x509.load_der_x509_certificate(der)
            as_decode = Identity(cert, der, decode_key, own.ca, member_of(cert))
            claim(reg, mallory.address, named("prefill-0"), key, as_decode, 403)  # prefill-0, certified decode
            assert reg.refused == {"identity_missing": 1, "member": 1, "identity": 2, "identity_role": 1}, reg.refused
            await receives(prefill, decode, reg, "after")
            assert mallory.status()["peers"] == [] and decode.status()["peers"] == [prefill.address]
            restarted = named("prefill-0")  # prefill-0's next incarnation registers the rank again
            bootstrap.register(f"127.0.0.1:{reg.port}", 0, 0, "127.0.0.1:9", INFO, key=key, incarnation=restarted,
                               identity=owner, timeout=10)
            assert bootstrap.lookup(f"127.0.0.1:{reg.port}", timeout=10)[1] == {"0/0": "127.0.0.1:9"}
    finally:
        reg.close()


def test_a_registry_with_an_identity_needs_the_cluster_key(cluster: Authority) -> None:
    """Certificates are parsed only after a registration's MAC checked out: a registry
    with an identity and no key would parse a stranger's."""
    with pytest.raises(ValueError, match="needs the cluster's key"):
        bootstrap.Registry("127.0.0.1", 0, key=None, identity=identity_of(cluster.member("prefill-0")))


def test_a_certificate_or_signature_that_is_not_base64_is_refused(cluster: Authority) -> None:
    """A registration whose MAC checks out but whose certificate or signature header is
    not base64: refused ``identity`` with the reason; the registry goes on."""
    owner = identity_of(cluster.member("prefill-0"))
    key = load_key(cluster.key)
    reg = bootstrap.Registry("127.0.0.1", 0, key=key, identity=owner)
    try:
        agent = named("prefill-0")
        raw = json.dumps({"dp_rank": 0, "tp_rank": 0, "address": "127.0.0.1:7000", "info": INFO,
                          "incarnation": agent, "ts": time.time(), "nonce": secrets.token_hex(16)}).encode()
        headers = {registration.MAC_HEADER: registration.mac(registration.registry_key(key) or b"", raw),
                   **registration.signature_headers(owner, raw)}
        for bad in (registration.CERT_HEADER, registration.SIGNATURE_HEADER):
            sent = {**headers, bad: "not base64!"}
            head = "".join(f"{k}: {v}\r\n" for k, v in sent.items())
            request = (f"PUT {bootstrap.PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(raw)}\r\n{head}\r\n"
                       ).encode() + raw
            code, answer = registration._exchange(f"127.0.0.1:{reg.port}", request, 10)
            assert code == 401 and "not base64" in answer["error"], answer
        assert reg.refused == {"identity": 2}, reg.refused
        bootstrap.register(f"127.0.0.1:{reg.port}", 0, 0, "127.0.0.1:7000", INFO, key=key, incarnation=agent,
                           identity=owner, timeout=10)
        assert bootstrap.lookup(f"127.0.0.1:{reg.port}", timeout=10)[1] == {"0/0": "127.0.0.1:7000"}
    finally:
        reg.close()
