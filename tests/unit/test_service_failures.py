"""How transfers fail: deadlines, door errors, sticky failures, timeouts, cancellation, abort."""

from __future__ import annotations

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
import structlog
import torch
from structlog.typing import EventDict

from kvservice import (
    FailureReason,
    KVPoll,
    TransferFailed,
    TransferHandle,
    TransferResult,
    TransferService,
    TransferStatus,
)
from kvservice.testing import FakeDoor, FakeFabric
from kvservice.testing.inspect import inside
from tests.helpers import eventually

from .harness import GUARD_S, door_of, fill, let_go_until_done, two_services, unit_config


class FakeNixlError(Exception):
    """Stands in for one of NIXL's exception classes (the fake door never imports nixl)."""


def door_of_sender(fabric: FakeFabric) -> FakeDoor:
    """The first door created: ``two_services`` enters the sender first."""
    return fabric.created[0]


def failed_events(logs: list[EventDict], request_id: str) -> list[EventDict]:
    return [e for e in logs if e["event"] == "transfer.failed" and e["request_id"] == request_id]


async def start_hung(tx: TransferService, rx: TransferService, txd: FakeDoor, rid: str,
                     src: list[int], dst: list[int]) -> TransferHandle:
    """A request whose only chunk is posted and stays in flight."""
    txd.hang()
    await rx.expect(rid, dst, sender=tx.address)
    handle = await tx.send(rid, src, last=True)
    await eventually(lambda: handle.poll() is KVPoll.Transferring and len(txd.live_ids()) >= 1, GUARD_S)
    return handle


async def test_bootstrap_timeout_is_logged() -> None:
    fabric = FakeFabric()
    with structlog.testing.capture_logs() as logs, anyio.fail_after(GUARD_S):
        async with TransferService(unit_config(bootstrap_timeout_s=0.2), door_factory=fabric.factory) as tx:
            h = await tx.send("boot", [1, 2], last=True)
            assert h.poll() is KVPoll.Bootstrapping
            result = await tx.await_completion(h)
    assert result.status is TransferStatus.FAILED and result.reason is FailureReason.TIMEOUT
    assert "no expect" in result.message and result.error is None and result.started_at is None
    assert h.poll() is KVPoll.Failed
    with pytest.raises(TransferFailed) as info:
        h.failure_exception()
    assert info.value.reason is FailureReason.TIMEOUT and info.value.request_id == "boot"
    assert info.value.peer is None and "(no peer known yet): no expect" in str(info.value)
    (event,) = failed_events(logs, "boot")
    assert event["reason"] == "TIMEOUT" and event["side"] == "send" and event["log_level"] == "warning"
    assert event["peer"] is None
    assert door_of(fabric, tx).post_count() == 0
    fabric.assert_clean()


async def test_hung_transfer_hits_the_transfer_deadline() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric, sender=unit_config(transfer_timeout_s=0.3)) as (tx, rx):
            txd = door_of(fabric, tx)
            h = await start_hung(tx, rx, txd, "hung", [1], [2])
            (xid,) = txd.live_ids()
            result = await tx.await_completion(h)
            assert result.reason is FailureReason.TIMEOUT and "deadline" in result.message
            arrived = await rx.await_arrival("hung")
            assert arrived.reason is FailureReason.TIMEOUT and "sender reported" in arrived.message
            await let_go_until_done(txd, xid)
            assert tx.status()["inflight_handles"] == 0
    fabric.assert_clean()


#: REMOTE_DISCONNECT also drops the peer: see test_remote_disconnect_drops_the_peer
REASONS = [FailureReason.BACKEND, FailureReason.PEER_LOST, FailureReason.CANCELLED,
           FailureReason.INCOMPATIBLE]


@pytest.mark.parametrize("reason", REASONS, ids=lambda r: r.value)
async def test_post_error_fails_both_sides_with_the_original_exception(reason: FailureReason) -> None:
    fabric = FakeFabric()
    original = FakeNixlError(f"injected {reason.value}")
    with structlog.testing.capture_logs() as logs, anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            txd.fail_next_post(reason, original)
            await rx.expect("pe", [3], sender=tx.address)
            h = await tx.send("pe", [1], last=True)
            result = await tx.await_completion(h)
            arrived = await rx.await_arrival("pe")
    assert result.status is TransferStatus.FAILED and result.reason is reason
    assert result.error is original
    with pytest.raises(TransferFailed) as info:
        h.failure_exception()
    # the message says why by itself; the original is the cause, the very object
    assert info.value.__cause__ is original and info.value.reason is reason and info.value.result is result
    # a sender names a receiver it was not pinned to by its address
    assert info.value.peer == result.peer == rx.address
    assert str(info.value).startswith(f"request 'pe' failed {reason.value} (peer {rx.address}): ")
    assert "injected" in str(info.value)
    with pytest.raises(TransferFailed) as again:
        result.raise_for_failure()
    assert again.value.__cause__ is original
    assert arrived.reason is reason and arrived.error is None
    sides = {e["side"]: e for e in failed_events(logs, "pe")}
    assert set(sides) == {"send", "recv"}
    assert sides["send"]["reason"] == sides["recv"]["reason"] == reason.value
    assert sides["send"]["peer"] == rx.agent_name and "injected" in sides["send"]["error"]
    assert txd.post_count() == 1 and txd.posted_ids() == []
    fabric.assert_clean()


async def test_check_error_releases_the_handle_once() -> None:
    fabric = FakeFabric()
    original = FakeNixlError("peer endpoint reset")
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            txd.complete_after(1000)
            txd.fail_next_check(FailureReason.CANCELLED, original)
            await rx.expect("ce", [3], sender=tx.address)
            h = await tx.send("ce", [1], last=True)
            result = await tx.await_completion(h)
            assert result.reason is FailureReason.CANCELLED and result.error is original
            assert (await rx.await_arrival("ce")).reason is FailureReason.CANCELLED
            (xid,) = txd.posted_ids()
            assert txd.check_counts[xid] == 1 and txd.release_counts[xid] == 1
    fabric.assert_clean()


async def drop_peer_by_remote_disconnect(fabric: FakeFabric, logs: list[EventDict]) -> int:
    """A hung request to the receiver, then another one whose post fails
    REMOTE_DISCONNECT; returns the hung request's transfer id."""
    original = FakeNixlError("remote disconnect")
    async with two_services(fabric) as (tx, rx):
        txd = door_of(fabric, tx)
        other = await start_hung(tx, rx, txd, "other", [1], [2])
        (xid,) = txd.live_ids()
        txd.fail_next_post(FailureReason.REMOTE_DISCONNECT, original)
        await rx.expect("rd", [3], sender=tx.address)
        h = await tx.send("rd", [4], last=True)
        result = await tx.await_completion(h)
        assert result.reason is FailureReason.REMOTE_DISCONNECT and result.error is original
        lost = await tx.await_completion(other)
        assert lost.reason is FailureReason.PEER_LOST and lost.error is original
        assert (await rx.await_arrival("rd")).reason is FailureReason.REMOTE_DISCONNECT
        told = await rx.await_arrival("other")  # told why before the link closed
        assert told.reason is FailureReason.PEER_LOST and "remote disconnect" in told.message, told
        await eventually(lambda: txd.live_xfers() == 0 and rx.agent_name in txd.peers_removed, GUARD_S)
    assert any(e["event"] == "peer.lost" and e["agent"] == rx.agent_name for e in logs)
    return xid


async def test_remote_disconnect_drops_the_peer_and_its_other_requests() -> None:
    """NIXL keeps a disconnected agent loaded: one REMOTE_DISCONNECT fails the peer's
    other requests at once (PEER_LOST) instead of letting each post into it."""
    fabric = FakeFabric()
    with structlog.testing.capture_logs() as logs, anyio.fail_after(GUARD_S):
        xid = await drop_peer_by_remote_disconnect(fabric, logs)
    assert door_of_sender(fabric).release_counts[xid] == 1
    fabric.assert_clean()


async def test_peer_drop_releases_each_in_flight_handle_once_at_the_nixl_level() -> None:
    """On peer loss both the door's ``remove_peer`` and the watchdog's queued release
    may name the same handle; the door's table makes the second an idempotent no-op,
    so NIXL's release runs exactly once."""
    fabric = FakeFabric()
    with structlog.testing.capture_logs() as logs, anyio.fail_after(GUARD_S):
        xid = await drop_peer_by_remote_disconnect(fabric, logs)
    sender = door_of_sender(fabric)
    assert sender.release_counts[xid] == 1
    assert sender.redundant_releases[xid] <= 1
    fabric.assert_clean()


async def test_failure_is_sticky_later_chunks_are_not_posted() -> None:
    fabric = FakeFabric()
    original = FakeNixlError("first chunk failed")
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            await rx.expect("st", [10, 11, 12], sender=tx.address)
            txd.fail_next_post(FailureReason.BACKEND, original)
            h1 = await tx.send("st", [1])
            first = await tx.await_completion(h1)
            assert first.reason is FailureReason.BACKEND
            h2 = await tx.send("st", [2])
            h3 = await tx.send("st", [3], last=True)
            # returned at once, already failed, with the first failure
            assert h2.result is first and h3.result is first
            assert h2.poll() is h3.poll() is KVPoll.Failed
            assert await tx.await_completion(h3) is first
            rounds = txd.rounds
            await eventually(lambda: txd.rounds >= rounds + 3, GUARD_S)
            assert txd.post_count() == 1
            assert (await rx.await_arrival("st")).reason is FailureReason.BACKEND
    fabric.assert_clean()


async def test_await_completion_timeout_fails_the_request_and_tells_the_receiver() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            h = await start_hung(tx, rx, txd, "wt", [1, 2], [5, 6])
            (xid,) = txd.live_ids()
            result = await tx.await_completion(h, timeout=0.2)
            assert result.reason is FailureReason.TIMEOUT and "await_completion timeout" in result.message
            assert h.result is result and h.poll() is KVPoll.Failed
            arrived = await rx.await_arrival("wt")
            assert arrived.status is TransferStatus.FAILED and arrived.reason is FailureReason.TIMEOUT
            await let_go_until_done(txd, xid)
    fabric.assert_clean()


async def test_await_arrival_timeout_tells_the_sender() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            h = await start_hung(tx, rx, txd, "at", [1], [5])
            (xid,) = txd.live_ids()
            arrived = await rx.await_arrival("at", timeout=0.2)
            assert arrived.reason is FailureReason.TIMEOUT
            result = await tx.await_completion(h)
            assert result.reason is FailureReason.TIMEOUT and "receiver aborted (TIMEOUT)" in result.message
            await let_go_until_done(txd, xid)
    fabric.assert_clean()


async def test_caller_cancellation_propagates_and_the_transfer_goes_on() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            data = fill(tx, "cc", [1, 2])
            h = await start_hung(tx, rx, txd, "cc", [1, 2], [30, 31])
            (xid,) = txd.live_ids()
            seen: list[BaseException] = []
            waiting = anyio.Event()

            async def waiter() -> None:
                waiting.set()
                try:
                    await tx.await_completion(h)
                except BaseException as exc:
                    seen.append(exc)
                    raise

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await waiting.wait()
                for _ in range(5):
                    await anyio.lowlevel.checkpoint()
                tg.cancel_scope.cancel()
            assert len(seen) == 1 and isinstance(seen[0], anyio.get_cancelled_exc_class())

            # the caller's own deadline is not the transfer's: nothing failed
            with anyio.move_on_after(0.05) as scope:
                await tx.await_completion(h)
            assert scope.cancelled_caught
            assert h.result is None and h.poll() is KVPoll.Transferring
            assert txd.live_ids() == [xid]

            assert txd.finish_hung() == 1
            assert (await tx.await_completion(h)).ok
            assert (await rx.await_arrival("cc")).ok
            assert torch.equal(rx.kv.pages([30, 31]), data)
            assert txd.release_counts[xid] == 1
    fabric.assert_clean()


@pytest.mark.parametrize("side", ["sender", "receiver"])
async def test_abort_resolves_the_other_side_aborted(side: str) -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            h = await start_hung(tx, rx, txd, "ab", [1], [2])
            (xid,) = txd.live_ids()
            here: TransferResult | None
            if side == "sender":
                here = await tx.abort("ab")
                there = await rx.await_arrival("ab")
            else:
                here = await rx.abort("ab")
                there = await tx.await_completion(h)
            assert here is not None and here.reason is FailureReason.ABORTED
            assert there.reason is FailureReason.ABORTED
            again = await (tx if side == "sender" else rx).abort("ab")  # already ended: how it ended
            assert again is not None and (again.status, again.reason, again.message) == (
                here.status, here.reason, here.message)
            # the WRITE's handle is let go, not released: a release would not stop it
            assert txd.release_counts[xid] == 0 and xid in txd.live_ids()
            # the sender settles at once; the receiver when the sender's fence lands (posted
            # behind the WRITE; the fake no longer hangs it), or when the WRITE ended DONE
            assert (await tx.await_settled("ab", timeout=GUARD_S)).settled
            assert not (await rx.await_settled("ab", timeout=0.2)).settled
            assert rx.status()["unsettled_pages"] == 1
            txd.complete_immediately()
            await eventually(lambda: txd.finish_hung() >= 1, GUARD_S)  # the WRITE and the fence, hung
            assert (await rx.await_settled("ab", timeout=GUARD_S)).settled
            await eventually(lambda: txd.release_counts[xid] == 1, GUARD_S)
    fabric.assert_clean()


async def test_sender_abort_of_an_expect_not_yet_sent() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            await rx.expect("ae", [2], sender=tx.address)
            await eventually(lambda: "ae" in inside(tx).early, GUARD_S)
            assert await tx.abort("ae") is None
            assert (await rx.await_arrival("ae")).reason is FailureReason.ABORTED
            # nothing of it was ever posted: the receiver's pages are settled (found by the soak)
            assert (await rx.await_settled("ae", timeout=GUARD_S)).settled
            h = await tx.send("ae", [1], last=True)  # fails at once: the expect was dropped
            assert h.result is not None and h.result.reason is FailureReason.ABORTED
    assert door_of(fabric, tx).post_count() == 0
    fabric.assert_clean()


async def test_receiver_abort_before_the_send() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            await rx.expect("ar", [2], sender=tx.address)
            await eventually(lambda: "ar" in inside(tx).early, GUARD_S)
            aborted = await rx.abort("ar")
            assert aborted is not None and aborted.reason is FailureReason.ABORTED
            await eventually(lambda: "ar" not in inside(tx).early, GUARD_S)
            h = await tx.send("ar", [1], last=True)
            assert h.result is not None and h.result.reason is FailureReason.ABORTED
    assert door_of(fabric, tx).post_count() == 0
    fabric.assert_clean()


async def test_dial_failure_in_the_door_fails_the_expect_with_the_original_error() -> None:
    fabric = FakeFabric()
    original = FakeNixlError("metadata mismatch")
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            door_of(fabric, rx).fail_next_add_peer(FailureReason.INCOMPATIBLE, original)
            await rx.expect("df", [2], sender=tx.address)  # returns: the failure is a result
            arrived = await rx.await_arrival("df")
            assert arrived.reason is FailureReason.INCOMPATIBLE
            assert arrived.error is original
    fabric.assert_clean()


async def test_unreachable_sender_fails_the_expect_peer_lost() -> None:
    fabric = FakeFabric()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()  # nothing listens there now
    with anyio.fail_after(GUARD_S):
        async with TransferService(unit_config(), door_factory=fabric.factory) as rx:
            await rx.expect("un", [2], sender=f"127.0.0.1:{port}")
            arrived = await rx.await_arrival("un")
    assert arrived.reason is FailureReason.PEER_LOST
    assert isinstance(arrived.error, OSError)
    fabric.assert_clean()
