"""A name is bound to the member that proves it (docs/security.md "Requests belong to
someone"): ``expect(sender=name)`` and ``send(receiver=name)`` take a peer at the address
the named member registered only when that peer proves the named member.

prefill-1 and decode-1 registered (signed by their own keys) at an address Mallory answers
at now (the port each left; their leases still run).  Mallory is a member: she proves her
own name, as she must, and so is refused as prefill-1 (the decode's expect by that name
fails ``REFUSED``, counted ``identity_member``, before any Expect reaches her) and as
decode-1 (her Expect for a send pinned to decode-1 by name is refused, counted
``receiver_mismatch``).  Before, whoever held the cluster's key at the address was taken.
prefill-0 and decode-0 transfer by name byte-exact throughout (``linked``).  Speaking
under another member's agent name is refused at the handshake
(``tests/faults/test_member_identity.py``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvservice import FailureReason, TransferService
from kvservice.discovery.member import Member, encode
from kvservice.discovery.signing import sign
from kvservice.testing import pattern
from tests.faults.test_member_claims import identity_of
from tests.faults.test_member_identity import Authority, named
from tests.helpers import SMALL, config, eventually, members

from .etcd_server import EtcdServer
from .test_hostile_etcd import GUARD_S, raw_client
from .test_signed_registrations import CLUSTER, PREFIX, linked

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


@pytest.fixture
def authority(tmp_path: Path) -> Authority:
    return Authority(tmp_path, CLUSTER)


async def registered_at(etcd: EtcdServer, authority: Authority, name: str, role: str, address: str,
                        decode: TransferService) -> None:
    """``name``'s own signed entry, naming ``address``, and the decode lists it."""
    files = authority.member(name, role)
    entry = Member(name=name, address=address, agent=named(name), incarnation=time.time_ns(), role=role)
    async with raw_client(etcd) as client:
        await client.put(PREFIX + name.encode(), encode(sign(identity_of(files), CLUSTER, PREFIX + name.encode(),
                                                             entry)))
    await eventually(members(decode, lambda ms: name in [m.name for m in ms]), timeout=GUARD_S)


async def unregister(etcd: EtcdServer, name: str, svc: TransferService) -> None:
    async with raw_client(etcd) as client:
        await client.delete(PREFIX + name.encode())
    await eventually(members(svc, lambda ms: name not in [m.name for m in ms]), timeout=GUARD_S)


def refused(svc: TransferService, kind: str) -> int:
    return int(svc.status()["refused"].get(kind, 0))


async def test_an_expect_by_name_is_not_taken_from_another_member(etcd: EtcdServer,
                                                                  authority: Authority) -> None:
    async with (linked(etcd, authority) as (_, decode, _),
                TransferService(config(**authority.member("mallory"))) as mallory):
        await registered_at(etcd, authority, "prefill-1", "prefill", mallory.address, decode)
        await decode.expect("by-name", [50, 51], sender="prefill-1")
        result = await decode.await_arrival("by-name", timeout=GUARD_S)
        assert result.reason is FailureReason.REFUSED, result
        assert "named as member 'prefill-1'" in result.message, result
        assert "proves member kvservice://c1/prefill/mallory" in result.message, result
        assert refused(decode, "identity_member") == 1
        assert not await mallory.expected("by-name")
        # the address stays named for prefill-1 (until a name is given for it again): by address too
        await decode.expect("by-address", [52], sender=mallory.address)
        result = await decode.await_arrival("by-address", timeout=GUARD_S)
        assert result.reason is FailureReason.REFUSED and "named as member 'prefill-1'" in result.message, result
        assert refused(decode, "identity_member") == 2
        assert not await mallory.expected("by-address")
        await unregister(etcd, "prefill-1", decode)


async def test_a_send_pinned_by_name_is_not_taken_by_another_member(etcd: EtcdServer,
                                                                     authority: Authority) -> None:
    async with linked(etcd, authority) as (prefill, decode, _):
        async with TransferService(config(**authority.member("mallory", "decode"))) as mallory:
            await registered_at(etcd, authority, "decode-1", "decode", mallory.address, prefill)
            prefill.kv.write([6], pattern(SMALL, "pinned", 1))
            handle = await prefill.send("pinned", [6], last=True, receiver="decode-1", timeout=GUARD_S)
            await mallory.expect("pinned", [1], sender=prefill.address)
            got = await mallory.await_arrival("pinned", timeout=GUARD_S)
            assert got.reason is FailureReason.REFUSED, got
            assert "pinned to another receiver" in got.message, got
            assert refused(prefill, "receiver_mismatch") == 1
            await prefill.abort("pinned")
            sent = await prefill.await_completion(handle, timeout=GUARD_S)
            assert sent.reason is FailureReason.ABORTED and sent.bytes == 0, sent
            await unregister(etcd, "decode-1", prefill)
            await eventually(members(decode, lambda ms: "decode-1" not in [m.name for m in ms]), timeout=GUARD_S)
