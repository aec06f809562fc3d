"""Programming errors raise at once, and leave other requests alone."""

from __future__ import annotations

import anyio
import pytest
import structlog
import torch

from kvservice import (
    FailureReason,
    KVPoll,
    KVServiceError,
    TransferService,
    TransferStatus,
    UnknownRequestError,
)
from kvservice.testing import FakeFabric
from tests.helpers import eventually

from .harness import GUARD_S, door_of, fill, two_services, unit_config


async def test_bad_inputs_raise_at_once_and_leave_the_in_flight_request_alone() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            txd.hang()
            data = fill(tx, "good", [1, 2])
            await rx.expect("good", [3, 4], sender=tx.address)
            good = await tx.send("good", [1, 2], last=True)
            await eventually(lambda: good.poll() is KVPoll.Transferring and txd.live_xfers() == 1, GUARD_S)
            posts = txd.post_count()

            with pytest.raises(ValueError, match="out of range"):
                await tx.send("x", [64])
            with pytest.raises(ValueError, match="must not repeat"):
                await tx.send("x", [1, 1])
            with pytest.raises(ValueError, match="request_id"):
                await tx.send("", [1])
            with pytest.raises(ValueError, match="request_id"):
                await tx.send("r" * 257, [1])
            with pytest.raises(ValueError, match="send after last"):
                await tx.send("good", [5])
            with pytest.raises(ValueError, match="duplicate request id"):
                await rx.expect("good", [9], sender=tx.address)
            with pytest.raises(ValueError, match="out of range"):
                await rx.expect("y", [0, 64], sender=tx.address)
            with pytest.raises(ValueError, match="host:port"):
                await rx.expect("y", [1], sender="nowhere")
            with pytest.raises(UnknownRequestError, match="unknown request 'nope'"):
                await rx.await_arrival("nope")
            with pytest.raises(UnknownRequestError):
                rx.poll_arrival("nope")
            with pytest.raises(UnknownRequestError):
                await rx.abort("nope")
            with pytest.raises(UnknownRequestError):
                await tx.abort("nope")
            assert issubclass(UnknownRequestError, KeyError)

            # nothing above touched the request in flight, nor created another
            assert good.poll() is KVPoll.Transferring and txd.post_count() == posts
            assert rx.poll_arrival("good") is KVPoll.WaitingForInput
            assert tx.status()["sending"] == 1 and rx.status()["receiving"] == 1
            assert txd.finish_hung() == 1
            assert (await tx.await_completion(good)).ok
            assert (await rx.await_arrival("good")).ok
            assert torch.equal(rx.kv.pages([3, 4]), data)
            assert tx.status()["outcomes"] == {"send.SUCCESS": 1}
    fabric.assert_clean()


async def test_more_pages_than_the_receiver_expects_raises_once_the_destination_is_known() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            data = fill(tx, "big", [1, 2, 3])
            await rx.expect("big", [10, 11, 12], sender=tx.address)
            h = await tx.send("big", [1])
            await eventually(lambda: h.poll() is KVPoll.WaitingForInput, GUARD_S)  # bound, chunk done
            with pytest.raises(ValueError, match="4 pages sent, receiver expects 3"):
                await tx.send("big", [2, 3, 4])
            with pytest.raises(ValueError, match="last chunk ends at 2 pages, receiver expects 3"):
                await tx.send("big", [2], last=True)
            assert h.poll() is KVPoll.WaitingForInput  # the refused chunks changed nothing
            await tx.send("big", [2, 3], last=True)
            assert (await tx.await_completion(h)).ok
            assert (await rx.await_arrival("big")).ok
            assert torch.equal(rx.kv.pages([10, 11, 12]), data)
    fabric.assert_clean()


async def test_too_many_pages_for_an_expect_that_arrives_later_fails_incompatible() -> None:
    """Before the expect arrives the sender cannot know: the mismatch is a result on both sides."""
    fabric = FakeFabric()
    with structlog.testing.capture_logs() as logs, anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            h = await tx.send("mis", [1, 2, 3], last=True)
            await rx.expect("mis", [10, 11], sender=tx.address)
            sent = await tx.await_completion(h)
            arrived = await rx.await_arrival("mis")
    assert sent.reason is FailureReason.INCOMPATIBLE and "receiver expects 2" in sent.message
    assert arrived.reason is FailureReason.INCOMPATIBLE
    assert [e["side"] for e in logs if e["event"] == "transfer.failed" and e["request_id"] == "mis"] == [
        "send", "recv"]
    assert door_of(fabric, tx).post_count() == 0
    fabric.assert_clean()


async def test_send_after_a_completed_request_raises() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            await rx.expect("done", [5], sender=tx.address)
            h = await tx.send("done", [1], last=True)
            assert (await tx.await_completion(h)).status is TransferStatus.SUCCESS
            with pytest.raises(ValueError, match="already completed"):
                await tx.send("done", [2])
            with pytest.raises(ValueError, match="duplicate request id"):
                await rx.expect("done", [6], sender=tx.address)  # once arrived, still a duplicate
            with pytest.raises(RuntimeError, match="has not failed"):
                h.failure_exception()
    fabric.assert_clean()


async def test_api_outside_the_service_lifetime_raises() -> None:
    fabric = FakeFabric()
    svc = TransferService(unit_config(), door_factory=fabric.factory)
    with pytest.raises(KVServiceError, match="not running"):
        await svc.send("r", [1])
    with anyio.fail_after(GUARD_S):
        async with svc:
            pass
    with pytest.raises(KVServiceError, match="shutting down"):
        await svc.send("r", [1])
    with pytest.raises(KVServiceError, match="shutting down"):
        await svc.expect("r", [1], sender="127.0.0.1:1")
    fabric.assert_clean()


async def test_decline_checks_its_arguments_and_refuses_a_request_expected_here() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            await rx.expect("mine", [3], sender=tx.address)
            with pytest.raises(ValueError, match="expected here: abort"):
                await rx.decline("mine", sender=tx.address)
            with pytest.raises(ValueError, match="host:port"):
                await rx.decline("other", sender="nowhere")
            with pytest.raises(ValueError, match="request_id"):
                await rx.decline("", sender=tx.address)
            # declined before any send: the send of it fails ABORTED at once, nothing posted
            assert await rx.decline("other", sender=tx.address) is True
            await eventually(lambda: tx.expect_dropped("other"), GUARD_S)  # (why, whose) once dropped
            result = await tx.await_completion(await tx.send("other", [1], last=True), timeout=GUARD_S)
            assert (result.reason, result.settled) == (FailureReason.ABORTED, True), result
            await rx.abort("mine")
    with pytest.raises(KVServiceError, match="shutting down"):
        await rx.decline("late", sender=tx.address)
