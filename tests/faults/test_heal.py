"""Settle after a heal: a lost link's held pages settle once the same sender links again
and proves, per request, that no WRITE of it can land any more.

Real NIXL (UCX over TCP on loopback) in real processes.  One side is SIGSTOPped past
``peer_timeout_s`` while requests are in flight, so both sides declare the link lost
and the receiver holds the pages; then SIGCONT.  The sender has kept checking the
lost link's handles instead of releasing them (its drain); they end ``DONE``; the
receiver dials it again, asks (``Ask``), and settles what the sender answers
(``Settled``) while the sender lives.  A canary written into the settled pages
afterwards must survive: a changed canary is a WRITE that landed after settling.
And a hostile or garbage ``Ask`` gets nothing but a count.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import anyio
import pytest
import structlog
import torch

from kvservice import FailureReason, KVPoll, TransferService
from kvservice._control.protocol import MAX_ASK, Ask, Settled
from kvservice._transfer import drain, proofs
from kvservice.testing import PeerProcess, pattern
from kvservice.testing.inspect import inside
from tests.faults.test_settle import LATE_WRITE_WAIT_S, LAYOUT, PAGES, TCP, canary, send_then_stop
from tests.helpers import config, eventually, heard_by, peer_config, peers, scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

FAST = {"heartbeat_interval_s": 0.2, "peer_timeout_s": 1.0}
#: the prefill's: its peer_timeout_s bounds its drain, and a WRITE resumed after a stall of
#: seconds waits for TCP's retransmission timer (backed off by then): give it time on a
#: loaded machine (1 s was seen to run out, leaving the request unproven: held, as it must)
PREFILL = {"heartbeat_interval_s": 0.2, "peer_timeout_s": 3.0}
#: hang guard for a settling that needs a loss (1 s), a resume, a re-dial and an Ask
SETTLE_GUARD_S = scaled(30.0)
LOST = {FailureReason.PEER_LOST, FailureReason.TIMEOUT, FailureReason.REMOTE_DISCONNECT}


async def test_a_stalled_sender_that_resumes_settles_what_it_proves() -> None:
    """The prefill is SIGSTOPped mid-copy past ``peer_timeout_s``: the decode fails the
    request ``PEER_LOST`` and holds its pages.  SIGCONT: the prefill finds its link lost,
    drains the in-flight WRITEs to ``DONE``; the decode links again and asks; the pages
    settle while the prefill lives, and nothing lands in them afterwards."""
    async with peers(peer_config(LAYOUT, ucx_env=TCP, **PREFILL), env=TCP) as (prefill,), \
            TransferService(config(LAYOUT, ucx_env=TCP, **FAST)) as decode:
        await send_then_stop(prefill, decode, "resume", timeout=None)  # lost by silence, not a deadline
        try:
            with anyio.fail_after(SETTLE_GUARD_S):
                failed = await decode.await_arrival("resume")
            assert failed.reason is FailureReason.PEER_LOST, failed
            await eventually(lambda: decode.status()["peers"] == [], timeout=5)  # link declared lost
            assert not (await decode.await_settled("resume", timeout=0.5)).settled
            assert decode.status()["unsettled_pages"] == len(PAGES)
        finally:
            prefill.signal(signal.SIGCONT)
        with anyio.fail_after(SETTLE_GUARD_S):
            settled = await decode.await_settled("resume")
        assert settled.settled, settled
        assert decode.status()["unsettled_pages"] == 0
        assert prefill.proc.returncode is None, "settled by the sender's proof, not by its exit"
        if settled.ok:  # every chunk was DONE on the prefill before it saw the loss: both say SUCCESS
            assert torch.equal(decode.kv.pages(PAGES), pattern(LAYOUT, "resume", len(PAGES)))
        else:
            assert settled.reason is FailureReason.PEER_LOST, settled
        sent = await prefill.event("completed", "resume")
        assert sent["status"] == ("SUCCESS" if settled.ok else "FAILED"), (settled, sent)
        await canary_survives(decode)
        await new_request_arrives(prefill, decode, "after")
        print(f"\nsender stalled: receiver settled {settled.status.value}, sender {sent['status']} {sent['reason']}")
        st = await status_of(prefill)
        assert st["inflight_handles"] == 0 and "ask_flood" not in st["refused"], st


async def test_a_stalled_receiver_that_resumes_settles_what_the_sender_proves() -> None:
    """The decode is SIGSTOPped while a request is in flight; the prefill declares it lost
    after ``peer_timeout_s`` and, instead of releasing the WRITEs, keeps checking them.
    SIGCONT: they complete (``DONE``), the decode finds its link lost, holds what failed,
    dials the prefill again, asks, and settles; a canary survives."""
    prefill_cfg = config(LAYOUT, ucx_env=TCP, **PREFILL)
    async with peers(peer_config(LAYOUT, ucx_env=TCP, **FAST), env=TCP) as (decode,), \
            TransferService(prefill_cfg) as prefill:
        await new_request_arrives_at(prefill, decode, "warm", [0], [1])
        rids = [f"stall-{i}" for i in range(4)]
        parts = [PAGES[i::4] for i in range(4)]
        for rid, pages in zip(rids, parts, strict=True):
            prefill.kv.write(pages, pattern(LAYOUT, rid, len(pages)))
            await decode.command(op="expect", rid=rid, pages=pages, sender=prefill.address)
            await decode.event("expecting", rid)
        handles = [await prefill.send(rid, pages, last=True) for rid, pages in zip(rids, parts, strict=True)]
        decode.signal(signal.SIGSTOP)
        try:
            with anyio.fail_after(SETTLE_GUARD_S):
                await eventually(lambda: prefill.status()["peers"] == [], timeout=SETTLE_GUARD_S)
        finally:
            decode.signal(signal.SIGCONT)
        with anyio.fail_after(SETTLE_GUARD_S):
            sent = [await prefill.await_completion(h) for h in handles]
        assert all(r.ok or r.reason in LOST for r in sent), sent
        arrived = {rid: await decode.event("arrived", rid, timeout=SETTLE_GUARD_S) for rid in rids}
        held = [rid for rid in rids if arrived[rid]["status"] != "SUCCESS"]
        for rid in held:
            assert FailureReason(arrived[rid]["reason"]) in LOST, arrived[rid]
        for rid in rids:
            await decode.command(op="await_settled", rid=rid, timeout=SETTLE_GUARD_S)
            got = await decode.event("settled", rid, timeout=SETTLE_GUARD_S + 5)
            assert got["settled"], got
        st = await status_of(decode)
        assert st["unsettled_pages"] == 0, st
        assert decode.proc.returncode is None
        assert prefill.status()["inflight_handles"] == 0
        # nothing lands after settling: the decode writes another request's pattern into the pages
        await decode.command(op="fill", rid="canary", pages=PAGES)
        await decode.event("filled", "canary")
        await anyio.sleep(LATE_WRITE_WAIT_S)
        await decode.command(op="verify", rid="canary", pages=PAGES)
        assert (await decode.event("verified", "canary"))["ok"], "a late WRITE landed in settled pages"
        await new_request_arrives_at(prefill, decode, "after", [1, 2], [5, 6])
        print(f"\nreceiver stalled: {len(held)} of {len(rids)} requests held, then settled")


async def test_a_receiver_stalled_past_the_senders_peer_timeout_settles_once_it_resumes() -> None:
    """The decode is SIGSTOPped with 6 requests (192 pages) in flight and stays stopped
    past the prefill's loss of it and ``peer_timeout_s`` more (where the prefill's drain
    used to give up and release the WRITEs unproven: the pages were held until the
    prefill exited).  The prefill keeps checking the lost link's WRITEs, the decode keeps
    the prefill's endpoint while it holds pages for it; SIGCONT: the WRITEs end, the
    decode links again, asks, and every request settles while the prefill lives; no
    handle is left, a canary survives and a new request arrives byte-exact."""
    async with peers(peer_config(LAYOUT, ucx_env=TCP, **FAST), env=TCP) as (decode,), \
            TransferService(config(LAYOUT, ucx_env=TCP, **PREFILL)) as prefill:
        await new_request_arrives_at(prefill, decode, "warm", [0], [1])
        rids = [f"long-stall-{i}" for i in range(6)]
        parts = [PAGES[32 * i : 32 * (i + 1)] for i in range(6)]
        for rid, pages in zip(rids, parts, strict=True):
            prefill.kv.write(pages, pattern(LAYOUT, rid, len(pages)))
            await decode.command(op="expect", rid=rid, pages=pages, sender=prefill.address)
            await decode.event("expecting", rid)
        handles = [await prefill.send(rid, pages, last=True) for rid, pages in zip(rids, parts, strict=True)]
        decode.signal(signal.SIGSTOP)
        try:
            with anyio.fail_after(SETTLE_GUARD_S):
                await eventually(lambda: prefill.status()["peers"] == [], timeout=SETTLE_GUARD_S)
            await anyio.sleep(1.5 * PREFILL["peer_timeout_s"])  # the stall outlasts peer_timeout_s
        finally:
            decode.signal(signal.SIGCONT)
        resumed = time.monotonic()
        with anyio.fail_after(SETTLE_GUARD_S):  # a send ends once its WRITEs in flight did (its source pages)
            sent = [await prefill.await_completion(h) for h in handles]
        assert all(r.ok or r.reason in LOST for r in sent), sent
        for rid in rids:
            arrived = await decode.event("arrived", rid, timeout=SETTLE_GUARD_S)
            assert arrived["status"] == "SUCCESS" or FailureReason(arrived["reason"]) in LOST, arrived
        for rid in rids:  # a generous wait (a hang guard): settled while the prefill lives
            await decode.command(op="await_settled", rid=rid, timeout=SETTLE_GUARD_S)
            got = await decode.event("settled", rid, timeout=SETTLE_GUARD_S + 5)
            assert got["settled"], got
        took = time.monotonic() - resumed
        st = await status_of(decode)
        assert st["unsettled_pages"] == 0, st
        assert decode.proc.returncode is None
        await eventually(lambda: prefill.status()["inflight_handles"] == 0 and inside(prefill).door.live_xfers() == 0,
                         timeout=SETTLE_GUARD_S, what="the prefill's handles released")
        await decode.command(op="fill", rid="canary", pages=PAGES)
        await decode.event("filled", "canary")
        await anyio.sleep(LATE_WRITE_WAIT_S)
        await decode.command(op="verify", rid="canary", pages=PAGES)
        assert (await decode.event("verified", "canary"))["ok"], "a late WRITE landed in settled pages"
        await new_request_arrives_at(prefill, decode, "after-long-stall", [1, 2], [5, 6])
        failed = sum(not r.ok for r in sent)
        print(f"\nreceiver stalled past peer_timeout_s: {failed} of 6 sends failed, "
              f"all settled {took:.1f} s after SIGCONT")


async def _abort_in_flight_then_cut(prefill: TransferService, decode: PeerProcess, rid: str) -> list[dict[str, Any]]:
    """A WRITE of ``rid`` in flight to the decode, SIGSTOPped mid-copy (left stopped), its
    request aborted on the prefill while NIXL still says ``PROC``, the link then cut (no
    settle fence can reach the decode: its link is gone before its Outcome).  The logs of
    the abort."""
    await new_request_arrives_at(prefill, decode, "warm", [0], [1])
    prefill.kv.write(PAGES, pattern(LAYOUT, rid, len(PAGES)))
    await decode.command(op="expect", rid=rid, pages=PAGES, sender=prefill.address)
    await decode.event("expecting", rid)
    plane = inside(prefill).plane
    handle = await prefill.send(rid, PAGES, last=True)
    decode.signal(signal.SIGSTOP)
    await eventually(lambda: handle.poll() is KVPoll.Transferring and plane.watchdog.inflight >= 1,
                     timeout=SETTLE_GUARD_S)
    with structlog.testing.capture_logs() as logs:
        aborted = await prefill.abort(rid)
        assert aborted is not None and aborted.reason is FailureReason.ABORTED, aborted
        plane.control.drop_peer(decode.agent, ConnectionResetError("the link is cut"))
        sent = await prefill.await_completion(handle, timeout=SETTLE_GUARD_S)
        assert sent.settled and sent.reason is FailureReason.ABORTED, sent
        await eventually(lambda: prefill.status()["peers"] == [], timeout=SETTLE_GUARD_S)
    return logs


async def _asked_after_resume(decode: PeerProcess, rid: str, *, proven: bool) -> dict[str, Any]:
    """SIGCONT: the decode fails ``rid``, links again and asks (again, while its asking lasts);
    the prefill's first answer that proved something (``proven``), or its first answer."""
    decode.signal(signal.SIGCONT)
    with structlog.testing.capture_logs() as logs:
        arrived = await decode.event("arrived", rid, timeout=SETTLE_GUARD_S)
        assert arrived["status"] == "FAILED", arrived

        def answers() -> list[dict[str, Any]]:
            return [e for e in logs if e["event"] == "transfer.asked" and e["agent"] == decode.agent
                    and (e["proven"] or not proven)]

        await eventually(lambda: bool(answers()), timeout=SETTLE_GUARD_S, what="an answer to the decode's Ask")
    return answers()[0]


async def test_a_write_aborted_in_flight_is_proven_once_it_ended_and_its_pages_settle() -> None:
    """The abort does not release the WRITE (a release would not stop it): the prefill checks
    it on.  Once the stopped decode resumes, the WRITE ends ``DONE``, the decode's ``Ask`` on
    its new link is answered ``Settled``, its pages settle while the prefill lives, and a canary
    written into them afterwards survives.  (Before, the WRITE was released in flight, could
    never be proven, and the pages stayed held until the prefill exited.)"""
    async with peers(peer_config(LAYOUT, ucx_env=TCP, **FAST), env=TCP) as (decode,), \
            TransferService(config(LAYOUT, ucx_env=TCP, **PREFILL)) as prefill:
        try:
            logs = await _abort_in_flight_then_cut(prefill, decode, "let-go")
        finally:
            asked = await _asked_after_resume(decode, "let-go", proven=True)
        assert not [e for e in logs if e["event"] == "transfer.unproven"], logs
        assert asked["proven"] >= 1, asked
        await decode.command(op="await_settled", rid="let-go", timeout=SETTLE_GUARD_S)
        assert (await decode.event("settled", "let-go", timeout=SETTLE_GUARD_S + 5))["settled"]
        assert (await status_of(decode))["unsettled_pages"] == 0
        await decode.command(op="fill", rid="canary", pages=PAGES)
        await decode.event("filled", "canary")
        await anyio.sleep(LATE_WRITE_WAIT_S)
        await decode.command(op="verify", rid="canary", pages=PAGES)
        assert (await decode.event("verified", "canary"))["ok"], "a late WRITE landed in settled pages"
        await eventually(lambda: prefill.status()["inflight_handles"] == 0, timeout=SETTLE_GUARD_S)
        assert decode.proc.returncode is None


async def test_a_write_given_up_in_flight_is_never_proven_to_a_receiver_that_asks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The proof is made where a handle is let go: the same WRITE, but the decode stays stopped
    past the prefill's ``DRAIN_S`` (shortened here), so the prefill gives it up (releases it
    while NIXL still says ``PROC``: its bytes may still land).  SIGCONT: the decode links again
    and asks; the prefill answers nothing for it, and the pages stay held."""
    monkeypatch.setattr(drain, "DRAIN_S", 0.5)
    monkeypatch.setattr(proofs, "DRAIN_S", 0.5)
    async with peers(peer_config(LAYOUT, ucx_env=TCP, **FAST), env=TCP) as (decode,), \
            TransferService(config(LAYOUT, ucx_env=TCP, **PREFILL)) as prefill:
        try:
            logs = await _abort_in_flight_then_cut(prefill, decode, "given-up")
            with structlog.testing.capture_logs() as more:
                await eventually(lambda: prefill.status()["inflight_handles"] == 0
                                 and not inside(prefill).plane.watchdog.draining_requests(decode.agent),
                                 timeout=SETTLE_GUARD_S, what="the WRITE given up")
        finally:
            asked = await _asked_after_resume(decode, "given-up", proven=False)
        assert asked["requests"] >= 1 and asked["proven"] == 0, asked
        await decode.command(op="await_settled", rid="given-up", timeout=1.0)
        assert not (await decode.event("settled", "given-up", timeout=SETTLE_GUARD_S))["settled"]
        st = await status_of(decode)
        assert st["unsettled_pages"] == len(PAGES), st
        assert decode.proc.returncode is None
        assert any(e["event"] == "transfer.unproven" and e["why"] == "drain ended unfinished"
                   for e in [*logs, *more]), [*logs, *more]


async def test_a_hostile_ask_gets_nothing_and_a_legit_transfer_follows() -> None:
    """A linked peer (``mallory``) asks about another receiver's requests (ignored, counted
    ``foreign_request``), about ids never sent (answered: nothing was ever posted, and it
    holds nothing of them), twice at once (counted ``ask_flood``), and with more ids than an
    ``Ask`` may carry (its link refused, ``frame``).  The legit receiver's transfers pass
    byte-exact before and after, and nothing stays unsettled."""
    async with peers(peer_config(LAYOUT, ucx_env=TCP, **FAST), env=TCP) as (prefill,), \
            TransferService(config(LAYOUT, ucx_env=TCP, **FAST)) as decode, \
            TransferService(config(LAYOUT, ucx_env=TCP, **FAST)) as mallory:
        await new_request_arrives(prefill, decode, "legit-1")
        await new_request_arrives(prefill, mallory, "m-warm")
        heard = heard_by(mallory)
        agent = prefill.agent
        inside(mallory).control.send_to(agent, Ask(["legit-1", "never-sent", "never-sent"]))
        inside(mallory).control.send_to(agent, Ask(["legit-1"]))  # at once: a flood
        await eventually(lambda: any(isinstance(m, Settled) for m in heard), timeout=10)
        await eventually(lambda: refused_at(prefill, "ask_flood"), timeout=10)
        st = await status_of(prefill)
        assert st["refused"].get("foreign_request", 0) >= 1, st
        assert [m.request_id for m in heard if isinstance(m, Settled)] == ["never-sent"], heard
        # oversized: refused by the decoder, the link closed: it was mallory's alone
        frames = st["refused"].get("frame", 0)
        too_many = [f"x{i}" for i in range(MAX_ASK + 1)]
        inside(mallory).control.send_to(agent, _unchecked_ask(too_many))
        await eventually(lambda: refused_at(prefill, "frame", frames + 1), timeout=10)
        await eventually(lambda: mallory.status()["peers"] == [], timeout=10)
        await new_request_arrives(prefill, decode, "legit-2")
        assert decode.status()["unsettled_pages"] == 0 and mallory.status()["unsettled_pages"] == 0


# -- helpers ---------------------------------------------------------------------------


def _unchecked_ask(ids: list[str]) -> Ask:
    """An ``Ask`` past its bounds, as a hostile peer would frame it (msgspec checks bounds
    only when decoding)."""
    return Ask(ids)


async def status_of(peer: PeerProcess) -> dict[str, Any]:
    await peer.command(op="status", id="st")
    return await peer.wait_for(lambda e: e.get("event") == "status" and e.get("id") == "st")


async def refused_at(peer: PeerProcess, kind: str, at_least: int = 1) -> bool:
    return int((await status_of(peer))["refused"].get(kind, 0)) >= at_least


async def canary_survives(decode: TransferService) -> None:
    mine = canary(len(PAGES), -1.0)
    decode.kv.write(PAGES, mine)
    await anyio.sleep(LATE_WRITE_WAIT_S)
    assert torch.equal(decode.kv.pages(PAGES), mine), "a late WRITE landed in settled pages"


async def new_request_arrives(prefill: PeerProcess, decode: TransferService, rid: str) -> None:
    """A small request from the prefill process to ``decode``, byte-exact."""
    await prefill.command(op="fill", rid=rid, pages=[1, 2])
    await prefill.event("filled", rid)
    await decode.expect(rid, [5, 6], sender=prefill.address)
    await prefill.command(op="send", rid=rid, pages=[1, 2], last=True)
    arrived = await decode.await_arrival(rid, timeout=SETTLE_GUARD_S)
    assert arrived.ok, arrived
    assert torch.equal(decode.kv.pages([5, 6]), pattern(LAYOUT, rid, 2))


async def new_request_arrives_at(prefill: TransferService, decode: PeerProcess, rid: str,
                                 src: list[int], dst: list[int]) -> None:
    """A small request from ``prefill`` to the decode process, verified there byte-exact."""
    prefill.kv.write(src, pattern(LAYOUT, rid, len(src)))
    await decode.command(op="expect", rid=rid, pages=dst, sender=prefill.address)
    await decode.event("expecting", rid)
    handle = await prefill.send(rid, src, last=True)
    assert (await prefill.await_completion(handle)).ok
    arrived = await decode.event("arrived", rid, timeout=SETTLE_GUARD_S)
    assert arrived["status"] == "SUCCESS" and arrived.get("verified", True), arrived
