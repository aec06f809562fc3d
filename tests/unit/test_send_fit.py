"""``send(fit="tail")``: a sender sends every page it has before its receiver's Expect
arrives; the Expect decides how many of the last ones move (a decode whose prefix cache
held the first ones reserves fewer).  Fitted when the request binds, whichever came first."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvservice import FailureReason, KVPoll, TransferService, TransferStatus
from kvservice.testing import FakeFabric
from kvservice.testing.inspect import inside
from tests.helpers import SMALL, eventually

from .harness import GUARD_S, door_of, fill, two_services, unit_config, untouched


async def _early(tx: TransferService, rid: str) -> None:
    """Wait until the receiver's Expect for ``rid`` is held on ``tx`` (before any send)."""
    early = inside(tx).early
    await eventually(lambda: rid in early, GUARD_S)


@pytest.mark.parametrize("expect_first", [False, True], ids=["send-first", "expect-first"])
async def test_a_receiver_that_reserved_fewer_pages_gets_exactly_the_last_ones(expect_first: bool) -> None:
    fabric = FakeFabric()
    src, dst = [5, 6, 7, 8], [40, 41]
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            fill(tx, "tail", src)
            if expect_first:
                await rx.expect("tail", dst, sender=tx.address)
                await _early(tx, "tail")
            h = await tx.send("tail", src, last=True, fit="tail")
            if not expect_first:
                assert h.poll() is KVPoll.Bootstrapping  # every page queued, the receiver unknown
                await rx.expect("tail", dst, sender=tx.address)
            sent = await tx.await_completion(h)
            arrived = await rx.await_arrival("tail")
            assert (sent.status, sent.pages, sent.bytes) == (TransferStatus.SUCCESS, 2, 2 * SMALL.page_bytes)
            assert arrived.ok and (arrived.pages, arrived.bytes) == (2, 2 * SMALL.page_bytes)
            assert torch.equal(rx.kv.pages(dst), tx.kv.pages([7, 8]))  # the last two, in order
            assert not torch.equal(rx.kv.pages(dst), tx.kv.pages([5, 6]))
            assert untouched(rx, dst)
    assert door_of(fabric, tx).post_count() == 1  # one WRITE: the last two pages
    fabric.assert_clean()


async def test_a_receiver_that_reserved_every_page_gets_them_all() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            data = fill(tx, "all", [1, 2, 3])
            h = await tx.send("all", [1, 2, 3], last=True, fit="tail")
            await rx.expect("all", [9, 10, 11], sender=tx.address)
            assert (await tx.await_completion(h)).pages == 3
            assert (await rx.await_arrival("all")).ok
            assert torch.equal(rx.kv.pages([9, 10, 11]), data)
    fabric.assert_clean()


@pytest.mark.parametrize("expect_first", [False, True], ids=["send-first", "expect-first"])
async def test_a_receiver_that_reserved_more_pages_fails_incompatible_on_both_sides(expect_first: bool) -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            fill(tx, "more", [1, 2])
            if expect_first:
                await rx.expect("more", [9, 10, 11], sender=tx.address)
                await _early(tx, "more")
            h = await tx.send("more", [1, 2], last=True, fit="tail")
            if not expect_first:
                await rx.expect("more", [9, 10, 11], sender=tx.address)
            sent = await tx.await_completion(h)
            arrived = await rx.await_arrival("more")
    assert sent.reason is FailureReason.INCOMPATIBLE and "2 pages, receiver expects 3" in sent.message
    assert arrived.reason is FailureReason.INCOMPATIBLE
    assert door_of(fabric, tx).post_count() == 0
    fabric.assert_clean()


async def test_fit_goes_only_with_a_requests_only_chunk() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            with pytest.raises(ValueError, match="fit must be None or 'tail'"):
                await tx.send("bad", [1, 2], last=True, fit="head")  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="fit= goes with a request's only chunk"):
                await tx.send("bad", [1, 2], fit="tail")  # not its last
            with pytest.raises(ValueError, match="fit= goes with a request's only chunk"):
                await tx.send("bad", [1, 2], last=True, fit="tail", layers=range(0, 1))  # not whole pages
            assert not inside(tx).plane.sent_before("bad")  # refused: nothing made
            h = await tx.send("two", [1])
            with pytest.raises(ValueError, match="fit= goes with a request's only chunk"):
                await tx.send("two", [2], last=True, fit="tail")  # its second chunk
            assert h.poll() is KVPoll.Bootstrapping  # the refused chunk changed nothing
            with pytest.raises(ValueError, match="non-empty"):
                await rx.expect("none", [], sender=tx.address)  # nothing to reserve: no Expect at all
            await rx.expect("two", [20, 21], sender=tx.address)
            await tx.send("two", [2], last=True)
            assert (await tx.await_completion(h)).ok
            assert (await rx.await_arrival("two")).ok
    fabric.assert_clean()


async def test_a_fitted_send_whose_receiver_already_left_fails_at_once() -> None:
    """The receiver expected, then aborted before the send: the send fails, ABORTED, and
    nothing is posted (the prefill frees its blocks at the next report, not at a timeout)."""
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            await rx.expect("gone", [9], sender=tx.address)
            await _early(tx, "gone")
            await rx.abort("gone")
            plane = inside(tx).plane
            await eventually(lambda: "gone" in plane.dropped, GUARD_S)
            h = await tx.send("gone", [1, 2], last=True, fit="tail")
            sent = await tx.await_completion(h)
    assert sent.reason is FailureReason.ABORTED and sent.settled
    assert door_of(fabric, tx).post_count() == 0
    fabric.assert_clean()


async def test_a_fitted_send_nobody_expects_times_out_at_the_bootstrap_deadline() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric, sender=unit_config(bootstrap_timeout_s=0.2)) as (tx, _):
            h = await tx.send("alone", [1, 2], last=True, fit="tail")
            sent = await tx.await_completion(h)
    assert sent.reason is FailureReason.TIMEOUT and "no expect" in sent.message and sent.settled
    assert door_of(fabric, tx).post_count() == 0
    fabric.assert_clean()
