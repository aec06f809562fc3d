"""Membership with a real etcd: services register on a lease under
/kvservice/<cluster>/services/<name>, see each other by name and role, a receiver names
its sender (``expect(sender="prefill-0")``) and the bytes arrive; an unknown name fails
the request PEER_LOST at once, on the receiver's side and on the sender's
(``send(receiver=)``); leaving deregisters."""

from __future__ import annotations

import json
import sys

import anyio
import pytest
import torch

from kvservice import FailureReason, KVPoll, TransferService
from kvservice.discovery._etcd import Etcd, EtcdOptions
from kvservice.discovery.member import Member, services_prefix
from kvservice.discovery.member import read as read_member
from kvservice.testing import pattern
from tests.helpers import SMALL, config, eventually, members, scaled

from .etcd_server import EtcdServer

pytestmark = [pytest.mark.nixl]

GUARD_S = scaled(30.0)  # a hang guard, never a timed assertion


def etcd_config(server: EtcdServer, name: str, role: str, **kw: object) -> dict[str, object]:
    return {"discovery": "etcd", "etcd_endpoints": (server.endpoint,), "cluster": "t", "discovery_name": name,
            "discovery_role": role, **kw}


async def test_register_resolve_by_name_and_transfer(etcd: EtcdServer) -> None:
    async with TransferService(config(**etcd_config(etcd, "prefill-0", "prefill"))) as prefill, \
            TransferService(config(**etcd_config(etcd, "decode-0", "decode"))) as decode:
        await eventually(members(decode, lambda ms: len(ms) == 1), timeout=GUARD_S)
        await eventually(members(prefill, lambda ms: len(ms) == 1), timeout=GUARD_S)
        assert [m.name for m in await decode.live_peers(role="prefill")] == ["prefill-0"]
        assert (await decode.live_peers(role="decode")) == []
        seen = (await decode.live_peers())[0]
        assert (seen.address, seen.agent, seen.role) == (prefill.address, prefill.agent_name, "prefill")
        assert seen.memory["pages"] == SMALL.num_pages

        # what etcd holds: both keys, on leases, with their members
        client = await Etcd.connect(EtcdOptions((etcd.endpoint,), 5.0))
        try:
            _, kvs = await client.list(services_prefix("t"))
        finally:
            await client.close()
        assert sorted(e.key for e in kvs) == [b"/kvservice/t/services/decode-0", b"/kvservice/t/services/prefill-0"]
        registered = read_member(kvs[1].key, kvs[1].value, services_prefix("t"))
        assert isinstance(registered, Member) and registered.agent == prefill.agent_name

        src, dst = [1, 2, 3], [10, 11, 12]
        prefill.kv.write(src, pattern(SMALL, "r1", 3))
        handle = await prefill.send("r1", src, last=True, receiver="decode-0")
        await decode.expect("r1", dst, sender="prefill-0")
        sent = await prefill.await_completion(handle, timeout=GUARD_S)
        got = await decode.await_arrival("r1", timeout=GUARD_S)
        assert sent.ok and got.ok, (sent, got)
        assert torch.equal(decode.kv.pages(dst), pattern(SMALL, "r1", 3))

        # a name no live member has: the request fails at once, PEER_LOST, naming it, on either side
        await decode.expect("r2", [20], sender="prefill-9")
        failed = await decode.await_arrival("r2", timeout=GUARD_S)
        assert failed.reason is FailureReason.PEER_LOST and "prefill-9" in failed.message
        gone = await prefill.send("r3", [4], last=True, receiver="decode-9")
        assert gone.poll() is KVPoll.Failed
        failed = await prefill.await_completion(gone, timeout=GUARD_S)
        assert failed.reason is FailureReason.PEER_LOST and "decode-9" in failed.message and failed.settled
        again = await prefill.send("r3", [5], last=True)  # sticky, as any failure: nothing posted
        assert again.result == failed
        with pytest.raises(ValueError, match="out of range"):  # a caller's error still raises first
            await prefill.send("r4", [10**6], last=True, receiver="decode-9")

        status = decode.status()["discovery"]
        assert status["registered"] and status["members"] == 1 and status["registrations"] == 1

        # the operator's view: kvservice cluster
        out = await anyio.run_process(
            [sys.executable, "-m", "kvservice", "cluster", "--endpoints", etcd.endpoint, "--cluster", "t",
             "--json"], check=False)
        assert out.returncode == 0, out.stderr.decode()
        rows = {r["name"]: r for r in json.loads(out.stdout)}
        assert set(rows) == {"prefill-0", "decode-0"}
        assert rows["prefill-0"]["address"] == prefill.address and rows["decode-0"]["role"] == "decode"
        table = (await anyio.run_process([sys.executable, "-m", "kvservice", "cluster", "--endpoints",
                                          etcd.endpoint, "--cluster", "t"])).stdout.decode()
        assert table.splitlines()[0].split() == ["NAME", "ROLE", "ADDRESS", "INCARNATION", "AGE", "LINKED",
                                                 "IN-FLIGHT"]
        # leaving deregisters at once (the lease is revoked, not left to lapse)
    async with TransferService(config(**etcd_config(etcd, "decode-1", "decode"))) as last:
        await eventually(lambda: last.status()["discovery"]["registered"], timeout=GUARD_S)
        assert (await last.live_peers()) == []


async def test_static_discovery_needs_no_etcd() -> None:
    async with TransferService(config()) as svc:
        assert (await svc.live_peers()) == [] and "discovery" not in svc.status()
        with pytest.raises(ValueError, match="address must be 'host:port'"):
            await svc.expect("r", [1], sender="prefill-0")
