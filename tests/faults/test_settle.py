"""Settled: after ``await_settled`` no late WRITE lands in a failed request's pages.

The experiment that showed the problem, with real NIXL between two processes: a
decode expects a large request, aborts it a few milliseconds after the prefill
starts sending, and at once writes its own bytes into those pages (what an
engine does when it recycles them).  Before settlement existed, the late WRITE
overwrote them.  Here the decode waits for ``await_settled`` first; its canary
must survive, and both sides must agree on how the request ended.  And a
receiver whose sender hangs (SIGSTOP) stays unsettled until that sender is
killed or resumes.
"""

from __future__ import annotations

import signal

import anyio
import pytest
import torch

from kvservice import FailureReason, KVLayout, TransferService
from kvservice.memory._pool import torch_dtype
from kvservice.testing import PeerProcess, pattern
from tests.helpers import config, eventually, peer_config, peers

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

# 128 KiB pages (4 layers x K/V x 16 KiB planes); 320 of them (40 MiB) take tens of ms over tcp.
LAYOUT = KVLayout(layers=4, page_tokens=16, kv_heads=4, head_dim=128, dtype="bfloat16", num_pages=400)
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
PAGES = list(range(40, 360))
LATE_WRITE_WAIT_S = 1.0  # long past any WRITE still on the wire (tens of ms)


def canary(npages: int, value: float) -> torch.Tensor:
    return torch.full((LAYOUT.layers, 2, npages, LAYOUT.page_elems), value, dtype=torch_dtype(LAYOUT.dtype))


@pytest.mark.parametrize("delay_ms", [0, 5, 15, 40])
async def test_abort_then_reuse_after_settle_keeps_the_reused_pages(delay_ms: int) -> None:
    cfg = peer_config(LAYOUT, ucx_env=TCP)
    async with peers(cfg, env=TCP) as (prefill,), TransferService(config(LAYOUT, ucx_env=TCP)) as decode:
        rid = f"reuse-{delay_ms}"
        await prefill.command(op="fill", rid=rid, pages=PAGES)
        await prefill.event("filled", rid)
        await decode.expect(rid, PAGES, sender=prefill.address)
        await prefill.command(op="send", rid=rid, pages=PAGES, last=True)
        await prefill.event("sent", rid)
        await anyio.sleep(delay_ms / 1000)
        aborted = await decode.abort(rid)
        assert aborted is not None
        with anyio.fail_after(10):
            result = await decode.await_settled(rid)
        assert result.settled, result
        # the engine recycles the pages: they must keep what it writes from now on
        mine = canary(len(PAGES), 3.0)
        decode.kv.write(PAGES, mine)
        await anyio.sleep(LATE_WRITE_WAIT_S)
        assert torch.equal(decode.kv.pages(PAGES), mine), "a late WRITE landed in settled pages"
        # both sides agree: the abort won (ABORTED both) or lost the race (SUCCESS both)
        sent = await prefill.event("completed", rid)
        if result.ok:
            assert sent["status"] == "SUCCESS", (result, sent)
        else:
            assert result.reason is FailureReason.ABORTED and sent["reason"] == "ABORTED", (result, sent)
        assert decode.status()["unsettled_pages"] == 0


async def send_then_stop(prefill: PeerProcess, decode: TransferService, rid: str) -> None:
    """``rid`` expected with a short arrival deadline, sent, and its sender SIGSTOPped mid-copy.
    The two are linked first (a small request), so the deadline is the copy's alone, not
    also a first link's (which vets both sides' NIXL metadata)."""
    warm = f"{rid}-warm"
    await prefill.command(op="fill", rid=warm, pages=[0])
    await prefill.event("filled", warm)
    await decode.expect(warm, [1], sender=prefill.address)
    await prefill.command(op="send", rid=warm, pages=[0], last=True)
    assert (await decode.await_arrival(warm, timeout=30)).ok
    await prefill.command(op="fill", rid=rid, pages=PAGES)
    await prefill.event("filled", rid)
    await decode.expect(rid, PAGES, sender=prefill.address, timeout=1.5)
    await prefill.command(op="send", rid=rid, pages=PAGES, last=True)
    await prefill.event("sent", rid)
    prefill.signal(signal.SIGSTOP)


async def test_a_stalled_sender_holds_the_pages_until_it_is_killed() -> None:
    """Receiver TIMEOUT against a SIGSTOPped sender: not settled (the sender's WRITE
    could resume), counted in unsettled pages; settled once the sender is SIGKILLed."""
    cfg = peer_config(LAYOUT, ucx_env=TCP)
    svc_cfg = config(LAYOUT, ucx_env=TCP, heartbeat_interval_s=0.2, peer_timeout_s=1.0)
    async with peers(cfg, env=TCP) as (prefill,), TransferService(svc_cfg) as decode:
        await send_then_stop(prefill, decode, "stall")
        try:
            result = await decode.await_arrival("stall", timeout=5)
            assert result.reason in (FailureReason.TIMEOUT, FailureReason.PEER_LOST), result
            still = await decode.await_settled("stall", timeout=2.0)
            assert not still.settled, still
            assert decode.status()["unsettled_pages"] == len(PAGES)
        finally:
            prefill.signal(signal.SIGKILL)
        with anyio.fail_after(15):
            settled = await decode.await_settled("stall")
        assert settled.settled and not settled.ok, settled
        assert decode.status()["unsettled_pages"] == 0


async def test_a_stalled_sender_that_resumes_stays_unsettled_until_it_exits() -> None:
    """The same, but the sender resumes (SIGCONT): it finds its link gone and releases
    its handles, but a released zero-copy WRITE goes on, and nothing shows when it
    stops; the pages stay unsettled (new requests with that sender work) until the
    sender's process is gone.  Reusing them before would be the bug."""
    cfg = peer_config(LAYOUT, ucx_env=TCP, heartbeat_interval_s=0.2, peer_timeout_s=1.0)
    svc_cfg = config(LAYOUT, ucx_env=TCP, heartbeat_interval_s=0.2, peer_timeout_s=1.0)
    async with peers(cfg, env=TCP) as (prefill,), TransferService(svc_cfg) as decode:
        await send_then_stop(prefill, decode, "resume")
        try:
            await decode.await_arrival("resume", timeout=5)
            await eventually(lambda: decode.status()["peers"] == [], timeout=5)  # link declared lost
            assert not (await decode.await_settled("resume", timeout=0.5)).settled
        finally:
            prefill.signal(signal.SIGCONT)
        # the resumed sender works with this receiver again (a new link) ...
        await prefill.command(op="fill", rid="after", pages=[1, 2])
        await prefill.event("filled", "after")
        await decode.expect("after", [5, 6], sender=prefill.address)
        await prefill.command(op="send", rid="after", pages=[1, 2], last=True)
        arrived = await decode.await_arrival("after", timeout=10)
        assert arrived.ok, arrived
        assert torch.equal(decode.kv.pages([5, 6]), pattern(LAYOUT, "after", 2))
        # ... but the old request's pages stay held while that process lives
        assert not (await decode.await_settled("resume", timeout=1.0)).settled
        assert decode.status()["unsettled_pages"] == len(PAGES)
        prefill.signal(signal.SIGKILL)
        with anyio.fail_after(20):
            settled = await decode.await_settled("resume")
        assert settled.settled, settled
        mine = canary(len(PAGES), -1.0)
        decode.kv.write(PAGES, mine)
        await anyio.sleep(LATE_WRITE_WAIT_S)
        assert torch.equal(decode.kv.pages(PAGES), mine)
