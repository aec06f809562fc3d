"""Failure paths made to happen with real processes and real NIXL.

Kill (SIGKILL), hang (SIGSTOP), cancel, abort, restart.  Each test asserts the
status, the reason and the original error; that nothing hung (every wait runs
under a hang guard far below the service's own timeouts); that no NIXL handle
is left live; and, where it matters, that the event loop kept ticking.

In-flight windows: with ``UCX_TLS=tcp`` a large WRITE takes tens of
milliseconds and completes only while the receiver keeps calling into NIXL, so
a SIGKILL or SIGSTOP reliably lands while the transfer is in flight.
"""

from __future__ import annotations

import signal
import time

import anyio
import pytest
import structlog

from kvservice import FailureReason, KVLayout, KVPoll, TransferFailed, TransferService, TransferStatus
from kvservice.testing import pattern
from tests.helpers import SMALL, Ticker, config, eventually, free_port, peer_config, peers

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

# 64 KiB pages; 2048 of them (128 MiB) take tens of ms over UCX's tcp transport.
BIG = KVLayout(layers=2, page_tokens=16, kv_heads=8, head_dim=128, dtype="bfloat16", num_pages=2048)
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
ALL = list(range(BIG.num_pages))
LOST = {FailureReason.PEER_LOST, FailureReason.REMOTE_DISCONNECT}


async def _in_flight(handle: object, timeout: float = 10.0) -> None:
    await eventually(lambda: handle.poll() is KVPoll.Transferring, timeout=timeout)  # type: ignore[attr-defined]


async def _expect_arrived(svc: TransferService) -> None:
    """Until the receiver's one Expect is at ``svc``.  Set-up, not the thing tested: a first
    link (the vetting child booting, the handshake, the metadata's trial load) takes seconds on
    a loaded machine, so this waits as long as a peer's own events do."""
    await eventually(lambda: svc.status()["expects_before_send"] == 1, timeout=30,
                     what=lambda: f"the Expect at the sender (status {svc.status()['expects_before_send']})")


async def test_receiver_killed_during_inflight_transfer() -> None:
    ticker = Ticker()
    cfg = peer_config(BIG, ucx_env=TCP)
    async with peers(cfg, cfg, env=TCP) as (victim, bystander), \
            TransferService(config(BIG, ucx_env=TCP)) as svc, anyio.create_task_group() as tg:
        tg.start_soon(ticker.run)
        await victim.command(op="expect", rid="big", pages=ALL, sender=svc.address)
        await bystander.command(op="expect", rid="fine", pages=[1, 2], sender=svc.address)
        await victim.event("expecting", "big")
        await bystander.event("expecting", "fine")
        handle = await svc.send("big", ALL, last=True, timeout=60)
        other = await svc.send("fine", [1, 2], last=True)  # another, live peer, queued behind "big"
        await _in_flight(handle)
        ticks_before = ticker.ticks
        victim.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        with anyio.fail_after(10):  # hang guard; the transfer timeout is 60 s
            result = await svc.await_completion(handle)
        assert result.status is TransferStatus.FAILED
        assert result.reason in LOST, result
        assert result.error is not None
        with pytest.raises(TransferFailed) as raised:
            handle.failure_exception()
        assert raised.value.__cause__ is result.error  # the very original exception instance
        assert f"failed {result.reason.value} (peer " in str(raised.value)  # says why by itself
        if result.reason is FailureReason.REMOTE_DISCONNECT:
            assert type(result.error).__name__ == "nixlRemoteDisconnectError"
        assert result.finished_at - killed_at < 10
        ok = await svc.await_completion(other, timeout=10)
        assert ok.ok, ok  # the other peer's transfer is unaffected
        assert (await bystander.event("arrived", "fine"))["status"] == "SUCCESS"
        await eventually(lambda: svc.status()["live_nixl_handles"] == 0)
        assert ticker.ticks > ticks_before  # the loop kept ticking through the failure
        tg.cancel_scope.cancel()


async def test_receiver_killed_before_post_fails_fast_not_by_timeout() -> None:
    async with peers(peer_config()) as (victim,), TransferService(config(bootstrap_timeout_s=60)) as svc:
        await victim.command(op="expect", rid="r", pages=[3, 4], sender=svc.address)
        await _expect_arrived(svc)
        victim.signal(signal.SIGKILL)
        await victim.proc.wait()
        await eventually(lambda: svc.status()["peers"] == [])
        handle = await svc.send("r", [1, 2], last=True)
        with anyio.fail_after(5):
            result = await svc.await_completion(handle)
        assert result.reason is FailureReason.PEER_LOST, result
        assert handle.poll() is KVPoll.Failed
        # sticky: a later chunk of the failed request returns at once and is not posted
        again = await svc.send("r", [5], last=True)
        assert again.poll() is KVPoll.Failed and again.result is result
        assert svc.status()["live_nixl_handles"] == 0


async def test_a_send_pinned_to_a_decode_killed_before_it_asked_fails_at_once() -> None:
    """A send pinned (``receiver=``) to a decode that is SIGKILLed before its Expect comes
    fails ``PEER_LOST`` with the link's error as soon as the link is lost, not at
    ``bootstrap_timeout_s``: that decode can never ask for it.  A send waiting for its Expect
    unpinned, and one pinned to a live decode, wait on; both still land byte-exact, the
    loop ticked throughout and no handle is left.  A decode restarted at the dead one's
    address takes a request pinned there afterwards."""
    ticker = Ticker()
    port = free_port()
    async with peers(peer_config(port=port), peer_config()) as (victim, bystander), \
            TransferService(config(bootstrap_timeout_s=120)) as svc, anyio.create_task_group() as tg:
        tg.start_soon(ticker.run)
        # a pinned request each first: its Expect proves each decode at its address
        for decode, rid in ((victim, "warm-v"), (bystander, "warm-b")):
            first = await svc.send(rid, [1], last=True, receiver=decode.address)
            await decode.command(op="expect", rid=rid, pages=[2], sender=svc.address)
            assert (await svc.await_completion(first, timeout=30)).ok, first.result
        svc.kv.write([5, 6], pattern(SMALL, "kept", 2))
        svc.kv.write([7], pattern(SMALL, "loose", 1))
        orphan = await svc.send("orphan", [3, 4], last=True, receiver=victim.address)
        kept = await svc.send("kept", [5, 6], last=True, receiver=bystander.address)
        loose = await svc.send("loose", [7], last=True)
        ticks_before = ticker.ticks
        victim.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        with anyio.fail_after(20):  # hang guard; its bootstrap timeout is 120 s
            result = await svc.await_completion(orphan)
        assert result.reason is FailureReason.PEER_LOST, result
        assert result.error is not None  # the link's own error, kept
        assert "lost peer" in result.message, result.message
        assert result.finished_at - killed_at < 20
        assert orphan.poll() is KVPoll.Failed
        assert kept.result is None and loose.result is None  # no Expect yet: they wait on
        await bystander.command(op="expect", rid="kept", pages=[8, 9], sender=svc.address)
        await bystander.command(op="expect", rid="loose", pages=[10], sender=svc.address)
        for handle, rid in ((kept, "kept"), (loose, "loose")):
            assert (await svc.await_completion(handle, timeout=30)).ok, handle.result
            assert (await bystander.event("arrived", rid))["verified"] is True
        async with peers(peer_config(port=port)) as (restarted,):
            svc.kv.write([11], pattern(SMALL, "again", 1))
            again = await svc.send("again", [11], last=True, receiver=restarted.address)
            await restarted.command(op="expect", rid="again", pages=[12], sender=svc.address)
            assert (await svc.await_completion(again, timeout=30)).ok, again.result
            assert (await restarted.event("arrived", "again"))["verified"] is True
        await eventually(lambda: svc.status()["live_nixl_handles"] == 0)
        assert ticker.ticks > ticks_before  # the loop kept ticking through the loss
        tg.cancel_scope.cancel()


async def test_receiver_killed_after_completion_changes_nothing() -> None:
    async with peers(peer_config()) as (victim,), TransferService(config()) as svc:
        await victim.command(op="expect", rid="done", pages=[7], sender=svc.address)
        await victim.event("expecting", "done")
        handle = await svc.send("done", [1], last=True)
        result = await svc.await_completion(handle, timeout=10)
        assert result.ok
        victim.signal(signal.SIGKILL)
        await eventually(lambda: svc.status()["peers"] == [])
        assert handle.poll() is KVPoll.Success and handle.result is result
        assert svc.status()["outcomes"] == {"send.SUCCESS": 1}


async def test_receiver_hung_times_out_and_its_handle_goes_once_it_ends() -> None:
    cfg = peer_config(BIG, ucx_env=TCP)
    async with peers(cfg, env=TCP) as (victim,), \
            TransferService(config(BIG, ucx_env=TCP, peer_timeout_s=60)) as svc:
        await victim.command(op="expect", rid="hung", pages=ALL, sender=svc.address)
        await _expect_arrived(svc)
        victim.signal(signal.SIGSTOP)
        try:
            with structlog.testing.capture_logs() as logs:
                handle = await svc.send("hung", ALL, last=True, timeout=1.5)
                with anyio.fail_after(15):  # it fails at its deadline, while the receiver is stopped
                    await eventually(lambda: handle.poll() is KVPoll.Failed, timeout=15)
            result = handle.result
            assert result is not None and result.reason is FailureReason.TIMEOUT, result
            assert result.error is None and "deadline" in result.message
            assert any(e["event"] == "transfer.failed" and e["reason"] == "TIMEOUT" for e in logs)
            # Not settled: its WRITE is let go, not released (a release would not stop it),
            # and the stopped receiver was told of the failure but has not answered, so a
            # notification of that WRITE could still complete the request there: its source
            # pages stay the sender's until the receiver answers (or its link is lost)
            assert not result.settled and svc.status()["live_nixl_handles"] >= 1
        finally:
            victim.signal(signal.SIGCONT)
        # the receiver wakes up, learns the sender gave up, and nothing crashes on either side
        arrived = await victim.event("arrived", "hung", timeout=15)
        assert arrived["status"] == "FAILED" and arrived["reason"] == "TIMEOUT"
        sent = await svc.await_completion(handle, timeout=15)
        assert sent.settled and sent.reason is FailureReason.TIMEOUT, sent
        await eventually(lambda: svc.status()["live_nixl_handles"] == 0)  # the WRITE ended
        await victim.command(op="expect", rid="after", pages=[1], sender=svc.address)
        await victim.event("expecting", "after")
        after = await svc.await_completion(await svc.send("after", [2], last=True), timeout=15)
        assert after.ok, after


async def test_sender_killed_receiver_fails_long_before_its_timeout() -> None:
    async with peers(peer_config()) as (prefill,), TransferService(config()) as svc:
        await svc.expect("orphan", [1, 2, 3], sender=prefill.address, timeout=120)
        assert svc.poll_arrival("orphan") is KVPoll.WaitingForInput
        prefill.signal(signal.SIGKILL)
        with anyio.fail_after(5):
            result = await svc.await_arrival("orphan")
        assert result.reason is FailureReason.PEER_LOST
        assert result.error is not None  # the connection error that revealed the loss


async def test_cancelled_waiter_does_not_cancel_the_transfer() -> None:
    cfg = peer_config(BIG, ucx_env=TCP)
    async with peers(cfg, env=TCP) as (decode,), \
            TransferService(config(BIG, ucx_env=TCP, peer_timeout_s=60)) as svc:
        await decode.command(op="expect", rid="c", pages=ALL, sender=svc.address)
        await _expect_arrived(svc)
        decode.signal(signal.SIGSTOP)  # hold the transfer in flight
        handle = await svc.send("c", ALL, last=True, timeout=60)
        cancelled = False

        async def waiter(scope: anyio.CancelScope) -> None:
            nonlocal cancelled
            with scope:
                try:
                    await svc.await_completion(handle)
                except anyio.get_cancelled_exc_class():
                    cancelled = True
                    raise

        scope = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, scope)
            await _in_flight(handle)
            scope.cancel()
        assert cancelled  # the caller saw its cancellation
        assert handle.poll() is KVPoll.Transferring  # ...and the transfer went on
        decode.signal(signal.SIGCONT)
        result = await svc.await_completion(handle, timeout=30)
        assert result.ok, result
        arrived = await decode.event("arrived", "c", timeout=30)
        assert arrived["status"] == "SUCCESS", arrived
        await eventually(lambda: svc.status()["live_nixl_handles"] == 0)


async def test_abort_by_sender_fails_receiver_with_aborted() -> None:
    async with peers(peer_config()) as (decode,), TransferService(config()) as svc:
        await decode.command(op="expect", rid="a", pages=[1, 2], sender=svc.address)
        await decode.event("expecting", "a")
        handle = await svc.send("a", [1], last=False)  # more chunks to come: not complete
        aborted = await svc.abort("a")
        assert aborted is not None and aborted.reason is FailureReason.ABORTED
        arrived = await decode.event("arrived", "a", timeout=5)
        assert arrived["status"] == "FAILED" and arrived["reason"] == "ABORTED"
        assert handle.poll() is KVPoll.Failed


async def test_abort_by_receiver_fails_sender_with_aborted() -> None:
    async with peers(peer_config()) as (prefill,), TransferService(config()) as svc:
        await prefill.command(op="send", rid="b", pages=[1, 2], last=False)
        await prefill.event("sent", "b")
        await svc.expect("b", [10, 11, 12], sender=prefill.address)
        await prefill.command(op="status")
        result = await svc.abort("b")
        assert result is not None and result.reason is FailureReason.ABORTED
        await prefill.command(op="send", rid="b", pages=[3], last=True)
        completed = await prefill.event("completed", "b", timeout=5)
        assert completed["status"] == "FAILED" and completed["reason"] == "ABORTED"


async def test_decode_restart_on_same_address_reconnects_cleanly() -> None:
    port = free_port()
    async with TransferService(config()) as svc:
        for round_ in range(3):
            async with peers(peer_config(port=port)) as (decode,):
                rid = f"gen{round_}"
                svc.kv.write([round_], pattern(SMALL, rid, 1))
                await decode.command(op="expect", rid=rid, pages=[9], sender=svc.address)
                await decode.event("expecting", rid)
                result = await svc.await_completion(await svc.send(rid, [round_], last=True), timeout=10)
                assert result.ok, result
                assert (await decode.event("arrived", rid))["verified"] is True
                decode.signal(signal.SIGKILL)  # crash, then the next round restarts it
            await eventually(lambda: svc.status()["peers"] == [])
        assert svc.status()["live_nixl_handles"] == 0


async def test_prefill_restart_on_same_address_reconnects_cleanly() -> None:
    port = free_port()
    async with TransferService(config()) as svc:
        for round_ in range(2):
            async with peers(peer_config(port=port)) as (prefill,):
                rid = f"p{round_}"
                await prefill.command(op="fill", rid=rid, pages=[4, 5])
                await prefill.event("filled", rid)
                await svc.expect(rid, [20, 21], sender=prefill.address)
                await prefill.command(op="send", rid=rid, pages=[4, 5], last=True)
                result = await svc.await_arrival(rid, timeout=10)
                assert result.ok, result
                prefill.signal(signal.SIGKILL)
            await eventually(lambda: svc.status()["peers"] == [])


async def test_shutdown_fails_outstanding_work_as_shutdown_on_both_sides() -> None:
    async with peers(peer_config()) as (decode,):
        async with TransferService(config(drain_grace_s=0.2)) as svc:
            await decode.command(op="expect", rid="s", pages=[1, 2], sender=svc.address)
            await decode.event("expecting", "s")
            handle = await svc.send("s", [1], last=False)  # the engine never sends the rest
        assert handle.result is not None and handle.result.reason is FailureReason.SHUTDOWN
        arrived = await decode.event("arrived", "s", timeout=5)
        assert arrived["status"] == "FAILED" and arrived["reason"] == "SHUTDOWN", arrived
