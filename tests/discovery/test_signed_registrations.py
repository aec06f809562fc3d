"""Registrations signed by the member they name (docs/security.md, "etcd writer").

prefill-0 and decode-0 each hold a member identity from the cluster's authority, register
in a real etcd, are linked by name with traffic flowing and a request held over the
link.  Entries are then written with a raw etcd client, as anyone who can write to etcd
(or a member holding only its own key) could: prefill-0's own entry replaced by an
unsigned one, by one signed under a certificate of another authority, by one a member
signs as itself, by one under an expired certificate of prefill-0, and by a replay of
prefill-0's own older signed entry.  Each is ignored and counted by its reason; the
decode keeps its healthy link (the held request is not failed ``PEER_LOST``) and every
transfer stays byte-exact.  A fleet moving to identities admits unsigned members only
with ``allow_peers_without_identity``, and never in place of a signed one."""

from __future__ import annotations

import contextlib
import datetime as dt
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from kvservice import KVPoll, TransferService
from kvservice._trust.authority import issue
from kvservice._trust.identity import Identity, load_identity, member_of
from kvservice.discovery.member import Member, encode, read
from kvservice.discovery.signing import sign
from kvservice.testing import pattern
from tests.faults.test_member_identity import Authority
from tests.helpers import SMALL, config, eventually, members

from .etcd_server import EtcdServer
from .test_hostile_etcd import GUARD_S, Traffic, raw_client, transfer

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

CLUSTER = "c1"  # the authority's cluster, also the etcd cluster
PREFIX = f"/kvservice/{CLUSTER}/services/".encode()
VICTIM = PREFIX + b"prefill-0"


def opts(etcd: EtcdServer, authority: Authority, name: str, role: str, **kw: Any) -> dict[str, Any]:
    return {"discovery": "etcd", "etcd_endpoints": (etcd.endpoint,), "cluster": CLUSTER, "discovery_name": name,
            "discovery_role": role, **authority.member(name, role), **kw}


@pytest.fixture
def authority(tmp_path: Path) -> Authority:
    return Authority(tmp_path, CLUSTER)


@contextlib.asynccontextmanager
async def linked(etcd: EtcdServer, authority: Authority, **kw: Any,
                 ) -> AsyncIterator[tuple[TransferService, TransferService, Traffic]]:
    """prefill-0 and decode-0 with identities, linked by name, "held" expected by the
    decode over that link, traffic flowing; on leaving, "held" still arrives byte-exact."""
    async with TransferService(config(**opts(etcd, authority, "prefill-0", "prefill"))) as prefill, \
            TransferService(config(**opts(etcd, authority, "decode-0", "decode", **kw))) as decode:
        await eventually(members(decode, lambda ms: [m.name for m in ms] == ["prefill-0"]), timeout=GUARD_S)
        await transfer(prefill, decode, "first", [3], [30])
        await decode.expect("held", [40, 41], sender="prefill-0")
        traffic = Traffic(prefill, decode)
        async with anyio.create_task_group() as tg:
            tg.start_soon(traffic.run)
            yield prefill, decode, traffic
            await eventually(lambda: traffic.ok >= 3, timeout=GUARD_S)
            traffic.stop()
        assert decode.poll_arrival("held") is not KVPoll.Failed, decode.status()
        prefill.kv.write([4, 5], pattern(SMALL, "held", 2))
        sent = await prefill.await_completion(await prefill.send("held", [4, 5], last=True), timeout=GUARD_S)
        got = await decode.await_arrival("held", timeout=GUARD_S)
        assert sent.ok and got.ok, (sent, got)
        assert torch.equal(decode.kv.pages([40, 41]), pattern(SMALL, "held", 2))
        assert [m.agent for m in await decode.live_peers()] == [prefill.agent_name]
        assert decode.status()["discovery"]["outages"] == 0


def usurper(prefill: TransferService, agent: str | None = None) -> Member:
    """prefill-0's entry as an attacker writes it: another agent, the next incarnation."""
    genuine = prefill.status()["discovery"]
    assert genuine["name"] == "prefill-0"
    return Member(name="prefill-0", address=prefill.address, agent=agent or f"prefill-0-{secrets.token_hex(6)}",
                  incarnation=time.time_ns(), role="prefill")


async def overwrite(etcd: EtcdServer, decode: TransferService, value: bytes, why: str) -> None:
    """``value`` written over prefill-0's entry; the decode ignores it, counted as ``why``."""
    before = decode.status()["discovery"]["ignored"][why]
    async with raw_client(etcd) as client:
        await client.put(VICTIM, value)
    await eventually(lambda: decode.status()["discovery"]["ignored"][why] > before, timeout=GUARD_S,
                     what=lambda: f"ignored {why}: {decode.status()['discovery']['ignored']}")


async def test_an_unsigned_entry_is_ignored(etcd: EtcdServer, authority: Authority) -> None:
    async with linked(etcd, authority) as (prefill, decode, _):
        await overwrite(etcd, decode, encode(usurper(prefill)), "unsigned")
        # an unsigned member under a new name: a service starting now lists it and ignores it
        async with raw_client(etcd) as client:
            await client.put(PREFIX + b"ghost", encode(Member(name="ghost", address="127.0.0.1:9",
                                                              agent="ghost-000000000000", incarnation=1)))
        async with TransferService(config(**opts(etcd, authority, "decode-1", "decode"))) as late:
            assert late.status()["discovery"]["ignored"]["unsigned"] >= 1
            await eventually(members(late, lambda ms: [m.name for m in ms] == ["decode-0", "prefill-0"]),
                             timeout=GUARD_S)
            await transfer(prefill, late, "late", [6], [50])


async def test_an_entry_signed_under_another_authority_is_ignored(etcd: EtcdServer, authority: Authority,
                                                                   tmp_path: Path) -> None:
    other = Authority(tmp_path, CLUSTER)  # a CA of its own, for the same cluster
    files = other.member("prefill-0", "prefill")
    forger = load_identity(files["identity_cert_file"], files["identity_key_file"], other.ca)
    async with linked(etcd, authority) as (prefill, decode, _):
        await overwrite(etcd, decode, encode(sign(forger, CLUSTER, VICTIM, usurper(prefill))), "signature")


async def test_a_member_cannot_write_another_members_entry(etcd: EtcdServer, authority: Authority) -> None:
    """The attack of the issue: a member (its own certificate, its own key) replaces
    prefill-0's entry with the next incarnation; signed as itself, or naming prefill-0's agents."""
    files = authority.member("mallory", "prefill")
    mallory = load_identity(files["identity_cert_file"], files["identity_key_file"], authority.ca)
    async with linked(etcd, authority) as (prefill, decode, _):
        own = usurper(prefill, agent=f"mallory-{secrets.token_hex(6)}")
        await overwrite(etcd, decode, encode(sign(mallory, CLUSTER, VICTIM, own)), "signature")
        await overwrite(etcd, decode, encode(sign(mallory, CLUSTER, VICTIM, usurper(prefill))), "signature")


async def test_an_entry_under_an_expired_certificate_is_ignored(etcd: EtcdServer, authority: Authority,
                                                                tmp_path: Path) -> None:
    out = tmp_path / "expired"
    out.mkdir()
    cert, key = issue(authority.dir, "prefill", "prefill-0", str(out), days=1,
                      not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=3))
    async with linked(etcd, authority) as (prefill, decode, _):
        await overwrite(etcd, decode, encode(sign_by_hand(cert, key, usurper(prefill))), "signature")


def sign_by_hand(cert_file: str, key_file: str, member: Member) -> Member:
    """``member`` signed with the key and certificate in these files, checked by nothing
    (``load_identity`` refuses an expired certificate; an attacker holding one does not)."""
    with open(cert_file, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    with open(key_file, "rb") as f:
        key = serialization.load_pem_private_key(f.read(), None)
    assert isinstance(key, ed25519.Ed25519PrivateKey)
    identity = Identity(cert, cert.public_bytes(serialization.Encoding.DER), key, cert, member_of(cert))
    return sign(identity, CLUSTER, VICTIM, member)


async def test_a_replayed_older_entry_is_ignored(etcd: EtcdServer, authority: Authority) -> None:
    """prefill-0's own signed entry, taken from etcd and written back after prefill-0
    wrote a newer one."""
    async with linked(etcd, authority) as (prefill, decode, _):
        async with raw_client(etcd) as client:
            old = bytes((await client.get(VICTIM)).value)
            first = read(VICTIM, old, PREFIX.decode())
            assert isinstance(first, Member) and first.sig, first
            await client.put(VICTIM, b"\x00not a member")  # prefill-0 writes its entry again, signed anew
            await eventually(lambda: prefill.status()["discovery"]["rewrites"] >= 1, timeout=GUARD_S)

            async def newer() -> bool:
                got = await client.get(VICTIM)
                m = read(VICTIM, bytes(got.value), PREFIX.decode()) if got is not None else None
                return isinstance(m, Member) and m.signed_at > first.signed_at
            await eventually(newer, timeout=GUARD_S)
        await overwrite(etcd, decode, old, "replay")


async def test_unsigned_members_join_a_mixed_fleet_but_never_replace_a_signed_one(
        etcd: EtcdServer, authority: Authority) -> None:
    async with linked(etcd, authority, allow_peers_without_identity=True) as (prefill, decode, _):
        async with TransferService(config(discovery="etcd", etcd_endpoints=(etcd.endpoint,), cluster=CLUSTER,
                                          discovery_name="old-0", discovery_role="prefill")):
            await eventually(members(decode, lambda ms: [m.name for m in ms] == ["old-0", "prefill-0"]),
                             timeout=GUARD_S)
        await overwrite(etcd, decode, encode(usurper(prefill)), "unsigned")
