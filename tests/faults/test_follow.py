"""A lone request's post followed to its WRITE's end (``cadence.FOLLOW_S``), with real NIXL.

The sender is a service in the test's process, where its watchdog's follows can be counted;
the decode is a child service, stopped (SIGSTOP) or killed (SIGKILL) while a follow is under
way.  Holding a second Expect, the decode polls at ``poll_interval_s`` (not the light cadence
of one hand-off) and posts leave their WRITE in flight, as the bench's W3 at one in flight
does: those are the posts a follow takes to their end.  Whatever the decode does, a follow
lasts at most ``FOLLOW_S``: the request then waits as any other does (lingering ticks), and
the loop keeps ticking throughout.
"""

from __future__ import annotations

import contextlib
import os
import signal

import anyio
import pytest

from kvservice import FailureReason, KVLayout, KVPoll, TransferService, TransferStatus
from kvservice._transfer import cadence
from kvservice.testing import PeerProcess, pattern
from kvservice.testing.inspect import inside
from tests.helpers import Ticker, config, eventually, peer_config, peers, scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


@pytest.fixture(autouse=True)
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender counts its decode as polling (``cadence.Warmth``) for longer than a step of
    these tests takes on a loaded machine (an Expect's round trip through the child can pass
    ``WARM_GRACE_S / 2``): each lone post is followed, whether or not the WRITE then ends
    within the follow."""
    monkeypatch.setattr(cadence, "WARM_GRACE_S", 60.0)

#: 64 KiB pages: a request of ``PAGES`` is 2 MiB, the bench's W3 request
MID = KVLayout(layers=2, page_tokens=16, kv_heads=8, head_dim=128, dtype="bfloat16", num_pages=256)
PAGES = 32
GUARD_S = scaled(30.0)
#: lone requests sent, one after another, until the sender counts the decode as polling
MOST = 200
LOST = {FailureReason.PEER_LOST, FailureReason.REMOTE_DISCONNECT}


def src_pages(i: int) -> list[int]:
    return list(range((i % 2) * PAGES, (i % 2 + 1) * PAGES))


DST = list(range(128, 128 + PAGES))


async def expect(decode: PeerProcess, svc: TransferService, rid: str, pages: list[int] = DST) -> None:
    await decode.command(op="expect", rid=rid, pages=pages, sender=svc.address)
    await decode.event("expecting", rid, timeout=GUARD_S)


async def lone(svc: TransferService, decode: PeerProcess, rid: str, i: int) -> None:
    """One request, expected first, sent alone: it lands byte-exact."""
    await expect(decode, svc, rid)
    src = src_pages(i)
    svc.kv.write(src, pattern(MID, rid, PAGES))
    result = await svc.await_completion(await svc.send(rid, src, last=True), timeout=GUARD_S)
    assert result.status is TransferStatus.SUCCESS, result
    arrived = await decode.event("arrived", rid, timeout=GUARD_S)
    assert arrived["status"] == "SUCCESS" and arrived["verified"] is True, arrived


async def warm(svc: TransferService, decode: PeerProcess) -> None:
    """Lone requests until the sender counts ``decode`` as polling and follows its posts: one
    completed within its post (the decode, holding that one Expect, polls every 100 us then)."""
    watchdog = inside(svc).plane.watchdog
    for i in range(MOST):
        await lone(svc, decode, f"warm-{i}", i)
        if watchdog.followed:
            return
    raise AssertionError(f"no post of {MOST} lone requests was followed")


async def warm_then_expect(svc: TransferService, decode: PeerProcess, rid: str) -> int:
    """``warm``, then ``rid`` expected and filled: the follows counted so far."""
    await warm(svc, decode)
    await expect(decode, svc, rid)
    svc.kv.write(src_pages(0), pattern(MID, rid, PAGES))
    return inside(svc).plane.watchdog.followed


async def test_lone_requests_are_followed_and_land_byte_exact() -> None:
    """Posts that leave their WRITE in flight (the decode holding two Expects polls at its
    cadence) are followed; whether a follow sees its WRITE end depends on the decode's polls
    (``benchmarks.loop_cpu`` counts ticks per request), every request lands either way."""
    async with peers(peer_config(MID)) as (decode,), TransferService(config(MID)) as svc:
        with anyio.fail_after(GUARD_S * 4):
            await warm(svc, decode)
            watchdog = inside(svc).plane.watchdog
            await expect(decode, svc, "held", pages=[200])
            followed = watchdog.followed
            for i in range(20):
                await lone(svc, decode, f"lone-{i}", i)
            assert watchdog.followed - followed == 20, (watchdog.followed - followed, watchdog.caught)
            await decode.command(op="abort", rid="held")
        assert svc.status()["live_nixl_handles"] == 0


def all_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (a signal's delivery is not at once)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/stat") as stat:
            states.append(stat.read().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state in ("T", "t") for state in states)


async def test_a_stopped_receiver_bounds_the_follow_and_the_request_lands_once_it_resumes() -> None:
    async with peers(peer_config(MID)) as (decode,), TransferService(config(MID)) as svc:
        with anyio.fail_after(GUARD_S * 4):
            watchdog = inside(svc).plane.watchdog
            followed = await warm_then_expect(svc, decode, "stopped")
            ticker = Ticker()
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker.run)
                decode.signal(signal.SIGSTOP)
                try:
                    await eventually(lambda: all_stopped(decode.pid), GUARD_S, what="the decode stopped")
                    handle = await svc.send("stopped", src_pages(0), last=True)
                    await eventually(lambda: watchdog.followed > followed, GUARD_S, what="its tick followed")
                    await anyio.sleep(cadence.FOLLOW_S * 50)  # far past the follow's bound
                    # The follow ended, its tick digested: the WRITE is the lingering ticks' now
                    # (most runs: it ends at the decode's next poll), or the transport ended it
                    # without the decode (a one-sided copy, seen once in CI) and it succeeded.
                    if handle.poll() is KVPoll.Transferring:
                        assert watchdog.inflight == 1
                    else:
                        assert handle.poll() is KVPoll.Success and watchdog.inflight == 0
                    ticks = ticker.ticks
                    await eventually(lambda: ticker.ticks > ticks + 5, GUARD_S, what="the loop ticking")
                finally:
                    decode.signal(signal.SIGCONT)
                result = await svc.await_completion(handle, timeout=GUARD_S)
                tg.cancel_scope.cancel()
            assert result.status is TransferStatus.SUCCESS, result
            arrived = await decode.event("arrived", "stopped", timeout=GUARD_S)
            assert arrived["status"] == "SUCCESS" and arrived["verified"] is True, arrived
            await lone(svc, decode, "after", 1)
            await decode.command(op="abort", rid="held")
        await eventually(lambda: svc.status()["live_nixl_handles"] == 0, GUARD_S, what="no live handle")


async def test_a_receiver_killed_while_followed_fails_the_request_and_the_service_goes_on() -> None:
    async with peers(peer_config(MID), peer_config(MID)) as (decode, other), \
            TransferService(config(MID)) as svc:
        with anyio.fail_after(GUARD_S * 4):
            watchdog = inside(svc).plane.watchdog
            followed = await warm_then_expect(svc, decode, "killed")
            decode.signal(signal.SIGSTOP)  # the WRITE stays in flight until the kill
            handle = await svc.send("killed", src_pages(0), last=True)
            await eventually(lambda: watchdog.followed > followed, GUARD_S, what="its tick followed")
            decode.signal(signal.SIGKILL)
            result = await svc.await_completion(handle, timeout=GUARD_S)
            assert result.status is TransferStatus.FAILED and result.reason in LOST, result
            assert result.message
            await eventually(lambda: svc.status()["live_nixl_handles"] == 0, GUARD_S, what="no live handle")
            await lone(svc, other, "elsewhere", 1)  # another decode is served as before
