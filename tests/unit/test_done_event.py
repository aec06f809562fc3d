"""A request is its own done event: waiters, cancellation, and what it holds."""

from __future__ import annotations

import asyncio
import gc
from collections import Counter

import anyio
import anyio.lowlevel

from kvservice import TransferStatus
from kvservice._transfer.requests import RecvRequest, SendRequest, make_result
from kvservice.testing import FakeFabric

from .harness import two_services


def _req() -> SendRequest:
    return SendRequest(request_id="r", created=0.0, deadline=1.0)


async def test_every_waiter_wakes_and_a_cancelled_one_disturbs_none() -> None:
    req = _req()
    woke: list[int] = []

    async def waiter(i: int) -> None:
        await req.done.wait()
        woke.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(waiter, i)
        with anyio.move_on_after(0.01) as scope:  # a fourth waiter, cancelled while waiting
            await req.done.wait()
        assert scope.cancelled_caught
        await anyio.lowlevel.checkpoint()
        assert not req.done.is_set() and woke == []
        assert isinstance(req.waiters, list) and len(req.waiters) == 3  # the cancelled one left
        req.result = make_result(req, TransferStatus.SUCCESS)  # done only once it has a result
        req.done.set()
        req.done.set()  # idempotent
    assert sorted(woke) == [0, 1, 2]
    assert req.done.is_set() and req.waiters is None


async def test_a_lone_waiter_cancelled_leaves_nothing_and_wait_after_set_returns() -> None:
    req = RecvRequest(request_id="r", created=0.0, deadline=1.0)
    with anyio.move_on_after(0.01):
        await req.done.wait()
    assert req.waiters is None
    req.done.set()
    with anyio.fail_after(1):
        await req.done.wait()


async def test_a_request_nobody_waits_for_holds_no_event_objects() -> None:
    """The objects a live request keeps for the cyclic GC to walk: the request alone
    (no event, no deque, no set) until something is queued, posted or awaited."""
    req = _req()
    held = [o for o in gc.get_referents(req) if gc.is_tracked(o) and o is not type(req)]
    assert held == [], held
    assert not isinstance(req.done, asyncio.Event)


async def test_until_done_carries_the_result_and_a_cancelled_future_goes_with_the_next_waiter() -> None:
    """``until_done`` is what ``await_completion`` awaits directly (no coroutine per
    waiting task): its future ends with the result; one cancelled while awaited stays
    only until the next waiter comes, so repeated timed-out waits cannot pile up."""
    req = _req()
    for _ in range(3):  # each cancelled wait's future is dropped when the next one comes
        with anyio.move_on_after(0.001):
            await req.done.until_done()
        assert req.waiters is not None and not isinstance(req.waiters, list)
        assert req.waiters.cancelled()
    first = req.done.until_done()
    second = req.done.until_done()
    assert req.waiters == [first, second]
    req.result = make_result(req, TransferStatus.SUCCESS)
    req.done.set()
    assert (await first) is req.result and (await second) is req.result
    assert (await req.done.until_done()) is req.result  # after set: already done


async def test_what_the_gc_walks_per_request_sent_and_awaited() -> None:
    """The objects the cyclic GC tracks per live request (``python -m benchmarks.gc_probe``
    at 4,096 in flight): sent, not yet bound, and awaited by a task of its own whose
    coroutine is ``await_completion``.  kvservice's share is the request, its handle and
    the future the task waits on, which is its own iterator for ``await``; its queued
    chunk and its deadline entry are tuples the GC stops tracking at their first
    collection, and no coroutine of kvservice's sits between the task and that future.
    (The task's own objects, its Task, context and callbacks, are asyncio's.)"""
    n = 200
    async with two_services(FakeFabric()) as (tx, _):
        gc.collect()
        before = {id(o) for o in gc.get_objects()}
        handles = [await tx.send(f"r{i}", [i % 8], last=True) for i in range(n)]
        waiting = [asyncio.ensure_future(tx.await_completion(h)) for h in handles]
        await asyncio.sleep(0)  # each task runs to its first await
        assert not any(w.done() for w in waiting)
        gc.collect(1)  # what a full collection finds: after a young one, as the requests' objects are by then
        new = Counter(type(o).__qualname__ for o in gc.get_objects() if id(o) not in before)
        for w in waiting:
            w.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        for h in handles:
            await tx.abort(h.request_id)
    for kind in ("SendRequest", "TransferHandle", "_Waiter", "coroutine"):
        assert n <= new[kind] <= n + n // 10, (kind, new)  # one each: the task's coroutine is await_completion
    for kind in ("FutureIter", "Future", "tuple", "deque", "list", "dict", "method"):
        assert new[kind] < n // 10, (kind, new)
