"""An idle service sleeps (its watchdog's waits back off, ``_transfer.cadence``), and what
comes after a long idle is still taken at once: real NIXL agents in two processes.

Each test makes the idle waits far longer than its own bound (``IDLE_S``), so that only a
wake-up caused by the event itself (a sender's ``Posted`` for a cold Expect, a send, a
request's end) can meet the bound: a test that passed by waiting out a poll would take
``IDLE_S``.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from kvservice import TransferService, TransferStatus
from kvservice._transfer import cadence
from kvservice.testing import pattern
from kvservice.testing.inspect import inside
from tests.helpers import SMALL, config, eventually, peer_config, peers

pytestmark = pytest.mark.nixl

#: every idle wait of the service under test, far past each test's bound
IDLE_S = 600.0
#: generous: what is measured here takes milliseconds; a missed wake-up, ``IDLE_S``
BOUND_S = 60.0


async def idle(svc: TransferService) -> None:
    """Until ``svc``'s watchdog has gone idle and sleeps (its ticks stop moving)."""
    plane = inside(svc).plane
    await eventually(lambda: not plane.busy() and plane.watchdog.inflight == 0, timeout=BOUND_S,
                     what="the receiver going idle")
    seen = -1
    for _ in range(100):  # bounded: the ticks stop once the watchdog sleeps its idle wait
        now = plane.watchdog.ticks
        if now == seen:
            return
        seen = now
        await anyio.sleep(0.2)
    raise AssertionError("the watchdog kept ticking while idle")


async def test_arrival_after_long_idle_is_taken_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver's watchdog sleeps ``IDLE_S`` when idle; a request expected after that is
    still taken at once: its Expect wakes the watchdog, whose polling lets the WRITE land and
    takes its notification."""
    monkeypatch.setattr(cadence, "IDLE_FIRST_S", IDLE_S)
    async with peers(peer_config()) as (prefill,), \
            TransferService(config(idle_poll_interval_s=IDLE_S)) as svc:
        for rid, src, dst in (("warm", [1, 2], [11, 12]), ("after-idle", [3, 4, 5], [20, 31, 42])):
            await prefill.command(op="fill", rid=rid, pages=src)
            await prefill.event("filled", rid)
            await idle(svc)
            await svc.expect(rid, dst, sender=prefill.address)
            await prefill.command(op="send", rid=rid, pages=src, last=True)
            with anyio.fail_after(BOUND_S):
                result = await svc.await_arrival(rid)
            assert result.status is TransferStatus.SUCCESS, result
            assert torch.equal(svc.kv.pages(dst), pattern(SMALL, rid, len(dst)))
            assert (await prefill.event("completed", rid))["status"] == "SUCCESS"
        assert svc.status()["live_nixl_handles"] == 0


async def test_fence_after_abort_settles_while_idle() -> None:
    """The receiver aborts a request whose first chunk landed: the request ends, the service
    is idle, and the sender's settle fence (a WRITE and its notification) is taken while it
    idles, long before an idle wait of ``IDLE_S`` could end: the back-off starts short after
    work.  The pages are then settled, and nothing leaked on either side."""
    async with peers(peer_config()) as (prefill,), \
            TransferService(config(idle_poll_interval_s=IDLE_S)) as svc:
        src, dst = [6, 7, 8, 9], [50, 51, 52, 53]
        await prefill.command(op="fill", rid="fenced", pages=src)
        await prefill.event("filled", "fenced")
        await svc.expect("fenced", dst, sender=prefill.address)
        await prefill.command(op="send", rid="fenced", pages=src[:2], last=False)
        recvs = inside(svc).plane.recvs
        await eventually(lambda: recvs["fenced"].chunks_seen >= 1, timeout=BOUND_S,
                         what="the first chunk's arrival")
        aborted = await svc.abort("fenced")
        assert aborted is not None and aborted.status is TransferStatus.FAILED, aborted
        with anyio.fail_after(BOUND_S):
            settled = await svc.await_settled("fenced")
        assert settled.settled, settled
        assert svc.status()["live_nixl_handles"] == 0
        await prefill.command(op="status")
        assert (await prefill.event("status"))["live_nixl_handles"] == 0
