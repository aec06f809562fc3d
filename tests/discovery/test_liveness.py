"""Liveness through etcd, each made to happen with real processes: a sender restarted
under the same name (a new incarnation) is dropped at once, its old NIXL agent removed and
the new one linked by name; a sender whose lease lapses (SIGSTOP: its keep-alives stop)
is dropped once the grace has passed.  Either way its requests fail PEER_LOST and
nothing is settled by it: the pages settle when the old process is gone (docs/settle.md).

The receiver's own link liveness is set far beyond the test (``peer_timeout_s``), so
only discovery can be what drops the sender."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import torch

from kvservice import FailureReason, TransferService
from kvservice.testing import PeerProcess, pattern
from tests.helpers import READY_S, SMALL, config, eventually, members, peer_config, scaled

from .etcd_server import EtcdServer

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

GUARD_S = scaled(30.0)  # a hang guard, never a timed assertion
SLOW_LINK = {"heartbeat_interval_s": 0.5, "peer_timeout_s": 600.0}  # the link itself never times out here


def etcd_opts(server: EtcdServer, name: str, role: str, **kw: Any) -> dict[str, Any]:
    return {"discovery": "etcd", "etcd_endpoints": [server.endpoint], "cluster": "live", "discovery_name": name,
            "discovery_role": role, **kw}


async def expects_held(peer: PeerProcess, n: int) -> None:
    """Until ``peer`` holds ``n`` Expects for requests it has not sent (it could write them)."""
    async def held() -> bool:
        await peer.command(op="status", id="st")
        st = await peer.wait_for(lambda e: e["event"] == "status")
        return bool(st["expects_before_send"] >= n)

    await eventually(held, GUARD_S, 0.05, what=f"peer {peer.pid} holding {n} Expects before their sends")


async def verified_transfer(decode: TransferService, prefill: PeerProcess, rid: str, sender: str) -> None:
    await decode.expect(rid, [30, 31], sender=sender)
    await delivered(decode, prefill, rid, src=[5, 6], dst=[30, 31])


async def delivered(decode: TransferService, prefill: PeerProcess, rid: str, src: list[int],
                    dst: list[int]) -> None:
    """``prefill`` fills ``src`` and sends it for ``rid``, which the decode already expects
    into ``dst``: it arrives, byte-exact."""
    await prefill.command(op="fill", rid=rid, pages=src)
    await prefill.event("filled", rid)
    await prefill.command(op="send", rid=rid, pages=src)
    got = await decode.await_arrival(rid, timeout=GUARD_S)
    assert got.ok, got
    assert torch.equal(decode.kv.pages(dst), pattern(SMALL, rid, len(src)))


@contextlib.asynccontextmanager
async def holding(etcd: EtcdServer, **fast: float) -> AsyncIterator[tuple[TransferService, PeerProcess]]:
    """A child prefill and an in-process decode that found it through etcd (both with
    ``fast``), the decode expecting "held" into pages 1-2 from it, the prefill holding that
    Expect; the prefill is stopped when the block ends."""
    async with anyio.create_task_group() as tg:
        prefill = await PeerProcess.start(tg, peer_config(**etcd_opts(etcd, "prefill-0", "prefill", **fast)),
                                          ready_timeout=READY_S)
        try:
            async with TransferService(config(**etcd_opts(etcd, "decode-0", "decode", **fast),
                                              **SLOW_LINK)) as decode:
                await eventually(members(decode, lambda ms: len(ms) == 1, "prefill"), timeout=GUARD_S)
                await decode.expect("held", [1, 2], sender="prefill-0")
                await expects_held(prefill, 1)
                yield decode, prefill
        finally:
            with anyio.CancelScope(shield=True):
                await prefill.stop(timeout=5)
            tg.cancel_scope.cancel()


async def test_restart_under_the_same_name_drops_the_old_incarnation(etcd: EtcdServer) -> None:
    async with anyio.create_task_group() as tg:
        old = await PeerProcess.start(tg, peer_config(**etcd_opts(etcd, "prefill-0", "prefill")), ready_timeout=READY_S)
        new: PeerProcess | None = None
        try:
            async with TransferService(config(**etcd_opts(etcd, "decode-0", "decode"), **SLOW_LINK)) as decode:
                await eventually(members(decode, lambda ms: [m.agent for m in ms] == [old.agent], "prefill"),
                                 timeout=GUARD_S)
                await decode.expect("held", [1, 2], sender="prefill-0")
                await expects_held(old, 1)
                old.signal(signal.SIGSTOP)  # hung: its link stays open, its lease alive for a while
                new = await PeerProcess.start(tg, peer_config(**etcd_opts(etcd, "prefill-0", "prefill")),
                                              ready_timeout=READY_S)
                lost = await decode.await_arrival("held", timeout=GUARD_S)
                assert lost.reason is FailureReason.PEER_LOST, lost
                assert "new incarnation" in lost.message
                assert not lost.settled  # the old process may still write: nothing settled by this
                assert decode.status()["unsettled_pages"] == 2
                # the old agent is gone from the table (and NIXL); the name now means the new one
                await eventually(lambda: decode.status()["peers"] == [], timeout=GUARD_S)
                await verified_transfer(decode, new, "after", "prefill-0")
                assert decode.status()["peers"] == [new.address]
                # the old process gone: what it held settles (its address refuses connections)
                old.signal(signal.SIGKILL)
                settled = await decode.await_settled("held", timeout=GUARD_S)
                assert settled.settled and decode.status()["unsettled_pages"] == 0
        finally:
            with anyio.CancelScope(shield=True):
                for p in (old, new):
                    if p is not None:
                        await p.stop(timeout=5)
            tg.cancel_scope.cancel()


async def test_lapsed_lease_fails_requests_and_settles_once_the_link_heals(etcd: EtcdServer) -> None:
    async with holding(etcd, etcd_ttl_s=2, etcd_keepalive_s=0.5, etcd_rejoin_grace_s=1.0) as (decode, prefill):
        prefill.signal(signal.SIGSTOP)  # its keep-alives stop: its lease lapses in 2 s
        lost = await decode.await_arrival("held", timeout=GUARD_S)
        assert lost.reason is FailureReason.PEER_LOST, lost
        assert "lease lapsed" in lost.message
        assert (await decode.live_peers()) == []
        with anyio.move_on_after(1.0):  # nothing settles it while the process could still write
            await decode.await_settled("held")
        assert decode.status()["unsettled_pages"] == 2
        # resumed, it registers again on a new lease under its name, and is usable again
        prefill.signal(signal.SIGCONT)
        await eventually(members(decode, lambda ms: len(ms) == 1, "prefill"), timeout=GUARD_S)
        await verified_transfer(decode, prefill, "again", "prefill-0")
        # linked again, the same process answers for what the decode holds: it never posted a
        # WRITE of "held" (only its Expect was held), so the pages settle while it lives
        # (docs/settle.md: a healed link)
        settled = await decode.await_settled("held", timeout=GUARD_S)
        assert settled.settled and decode.status()["unsettled_pages"] == 0


async def test_a_lease_revoked_and_renewed_within_the_grace_drops_nothing(etcd: EtcdServer) -> None:
    """What a stopped etcd does to every lease when it resumes, done to one: etcd revokes
    the sender's lease; the sender registers again (same incarnation) on its next
    keep-alive, within the grace, so its link and its requests go on."""
    import aetcd

    async with holding(etcd, etcd_keepalive_s=0.5, etcd_rejoin_grace_s=3.0) as (decode, prefill):
        host, port = etcd.endpoint.split(":")
        async with aetcd.Client(host=host, port=int(port)) as client:
            kv = await client.get(b"/kvservice/live/services/prefill-0")
            await client.revoke_lease(kv.lease)
        await eventually(members(decode, lambda ms: "prefill-0" not in [m.name for m in ms]), timeout=GUARD_S)
        # lapsed, not judged yet: its name still resolves (a request now is not refused)
        await decode.expect("during", [3, 4], sender="prefill-0")
        assert decode.poll_arrival("during").name != "Failed"
        await eventually(members(decode, lambda ms: [m.agent for m in ms] == [prefill.agent]), timeout=GUARD_S)
        await anyio.sleep(decode.config.etcd_rejoin_grace_s + 0.5)  # past the grace: judged by now
        assert decode.status()["peers"] == [prefill.address]
        assert decode.status()["discovery"]["lapsed"] == []
        await delivered(decode, prefill, "held", src=[5, 6], dst=[1, 2])
        await delivered(decode, prefill, "during", src=[7, 8], dst=[3, 4])


async def test_a_send_pinned_inside_the_grace_fails_when_the_lapse_is_judged(etcd: EtcdServer) -> None:
    """A send named to a member whose lease lapsed but was not judged yet (it resolves to the
    member's address, no Expect can come) fails PEER_LOST when the lapse is judged, naming the
    member, not at its bootstrap timeout; a send pinned to another member is untouched."""
    fast = {"etcd_ttl_s": 2, "etcd_keepalive_s": 0.5, "etcd_rejoin_grace_s": 5.0}
    async with anyio.create_task_group() as tg:
        started = [await PeerProcess.start(tg, peer_config(**etcd_opts(etcd, f"decode-{i}", "decode", **fast)),
                                          ready_timeout=READY_S)
                   for i in range(2)]
        try:
            async with TransferService(config(**etcd_opts(etcd, "prefill-0", "prefill", **fast),
                                              bootstrap_timeout_s=120, **SLOW_LINK)) as prefill:
                await eventually(members(prefill, lambda ms: len(ms) == 2, "decode"), timeout=GUARD_S)
                gone, other = started
                gone.signal(signal.SIGSTOP)  # its keep-alives stop: its lease lapses
                await eventually(members(prefill, lambda ms: "decode-0" not in [m.name for m in ms]), timeout=GUARD_S)
                doomed = await prefill.send("to-gone", [1, 2], last=True, receiver="decode-0")
                kept = await prefill.send("to-other", [3, 4], last=True, receiver="decode-1")
                with anyio.fail_after(GUARD_S):  # a hang guard: judged after the grace
                    lost = await prefill.await_completion(doomed)
                assert lost.reason is FailureReason.PEER_LOST, lost
                assert "decode-0" in lost.message and "lease lapsed" in lost.message, lost
                assert kept.result is None, kept.result  # pinned to a member still alive: waits on
                await other.command(op="expect", rid="to-other", pages=[5, 6], sender=prefill.address)
                assert (await prefill.await_completion(kept, timeout=GUARD_S)).ok
        finally:
            with anyio.CancelScope(shield=True):
                for p in started:
                    await p.stop(timeout=5)
            tg.cancel_scope.cancel()
