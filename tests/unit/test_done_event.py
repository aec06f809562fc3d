"""A request is its own done event: waiters, cancellation, and what it holds."""

from __future__ import annotations

import asyncio
import gc

import anyio
import anyio.lowlevel

from kvservice._transfer.requests import RecvRequest, SendRequest


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
