"""Settled: after ``await_settled`` no late WRITE lands in a failed request's pages.

The experiment that showed the problem, with real NIXL between two processes: a
decode expects a large request, aborts it a few milliseconds after the prefill
starts sending, and at once writes its own bytes into those pages (what an
engine does when it recycles them).  Before settlement existed, the late WRITE
overwrote them.  Here the decode waits for ``await_settled`` first; its canary
must survive, and both sides must agree on how the request ended.  And a
receiver whose sender hangs (SIGSTOP) stays unsettled until that sender is
killed; one that resumes settles what it proves once linked again (test_heal.py).
"""

from __future__ import annotations

import signal

import anyio
import pytest
import torch

from kvservice import FailureReason, KVLayout, TransferService
from kvservice.memory._pool import torch_dtype
from kvservice.testing import PeerProcess
from tests.helpers import config, peer_config, peers

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


async def send_then_stop(prefill: PeerProcess, decode: TransferService, rid: str,
                         timeout: float | None = 1.5) -> None:
    """``rid`` expected with an arrival deadline (``timeout``), sent, and its sender SIGSTOPped mid-copy.
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
    await decode.expect(rid, PAGES, sender=prefill.address, timeout=timeout)
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


