"""``InlineDoorThread``: ``DoorThread``'s interface, running every door call on the loop.

Calls run at once, in the order they are made (the real thread runs them in
queue order), and the caller then yields once, as it would waiting for the
thread.  A tick that posts keeps the thread busy for ``POST_S`` (virtual) per post,
the copy's time: its outcome, and that of every call queued behind it, comes back
only then, in queue order, so the watchdog can queue the next tick behind one that
posts (``Watchdog._queue_next``) as it does on the real thread.  A watchdog tick that
asks to *linger* does its work at once; if it has nothing to report it stays pending
for its linger time (virtual) and then polls once more, or ends early when
``interrupt`` is set, as the real tick does when the loop has new work (posting what
the loop handed over first).  A tick's follow of its posts stops before its first check
(``wait_queued``).

``kill()`` is the SIGKILL of the process that owns it: from then on every call
raises ``CancelledError`` where it stands, so the dead service's code stops
instead of driving a closed door.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from kvservice._nixl.door import Door, TickOutcome, TickPlan, XferId, _check, post_late, run_tick

T = TypeVar("T")

#: virtual seconds the thread stays busy per post of a tick (the copy's time)
POST_S = 0.0005


class _Interrupt:
    def __init__(self, owner: InlineDoorThread) -> None:
        self._owner = owner
        self._set = False

    def set(self) -> None:
        self._set = True
        self._owner._end_linger()

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        raise AssertionError("nothing waits on the inline interrupt")


class _Linger:
    def __init__(self, future: asyncio.Future[TickOutcome], door: Door, plan: TickPlan, running: list[XferId],
                 out: TickOutcome, timer: asyncio.TimerHandle | None) -> None:
        self.future, self.door, self.plan, self.running, self.out, self.timer = future, door, plan, running, out, timer


class InlineDoorThread:
    thread_ident = None

    def __init__(self) -> None:
        self.interrupt = _Interrupt(self)
        self._linger: _Linger | None = None
        self.killed = False
        self.calls = 0
        #: when the thread is done with the posts queued so far (virtual time)
        self._busy_until = 0.0
        self._deferred: list[asyncio.Future[Any]] = []
        #: ticks whose outcome came back while another tick was still due (a tick queued
        #: behind one that posts): how often the sim drove that path
        self.overlapped = 0

    def wait_queued(self, timeout: float) -> bool:
        """A tick's follow of its posts (``TickPlan.follow``) waits on the real thread; inline,
        it would hold the loop, so here another call is always queued: the follow stops
        before its first check, and the WRITEs it would follow are checked by later ticks."""
        return True

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        self.interrupt.set()
        return await self.call_lingering(fn, *args)

    async def call_lingering(self, fn: Callable[..., T], *args: Any) -> T:
        future = self.submit(fn, *args)
        await asyncio.sleep(0)  # the hop to the thread and back
        return await future

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if self.killed:
            future.cancel()
            return future
        self.calls += 1
        now = loop.time()
        if fn is run_tick and (args[1].posts or now < self._busy_until):
            # run now (the door's tables change in queue order), answered once the thread
            # has done the copies queued before it and its own
            if now < self._busy_until:
                self.overlapped += 1
            plan = args[1]
            plan.linger = 0.0  # a tick with posts does not linger; one behind them is answered after them
            self._answer_later(future, fn, args, now, POST_S * len(plan.posts))
            return future
        if now < self._busy_until:  # behind a tick's copies
            self._answer_later(future, fn, args, now, 0.0)
            return future
        if fn is run_tick and args[1].linger > 0:
            door, plan = args
            assert isinstance(plan, TickPlan)
            linger, plan.linger = plan.linger, 0.0
            out = run_tick(door, plan)
            if out.posted or out.checked or out.notifs:
                future.set_result(out)
                return future
            self._end_linger()  # at most one tick lingers
            self._linger = _Linger(future, door, plan, list(plan.checks), out, None)
            self._linger.timer = loop.call_later(linger, self._end_linger)
            return future
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, as the real thread does
            future.set_exception(exc)
        return future

    def _answer_later(self, future: asyncio.Future[Any], fn: Callable[..., Any], args: tuple[Any, ...],
                      now: float, cost: float) -> None:
        # each answer strictly after the one before (timers due at one instant may run in any order)
        self._busy_until = max(now, self._busy_until) + cost + 1e-9
        delay = self._busy_until - now
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, as the real thread does
            result, error = None, exc
        self._deferred.append(future)

        def answer() -> None:
            self._deferred.remove(future)
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        asyncio.get_running_loop().call_later(delay, answer)

    def _end_linger(self) -> None:
        linger, self._linger = self._linger, None
        if linger is None:
            return
        if linger.timer is not None:
            linger.timer.cancel()
        if self.killed:
            linger.future.cancel()
            return
        # Posts handed over meanwhile are posted, and the tick polls once more (the real one
        # polls every poll_interval until news).
        post_late(linger.door, linger.plan, linger.out)
        _check(linger.door, linger.running, linger.out)
        linger.out.notifs = linger.door.notifs()
        linger.out.live = linger.door.live_xfers()
        if not linger.future.done():
            linger.future.set_result(linger.out)

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        self.interrupt.set()
        if self.killed:
            raise asyncio.CancelledError("the process was killed")
        return fn(*args)

    def shutdown(self) -> None:
        self.interrupt.set()

    def kill(self) -> None:
        self.killed = True
        self._end_linger()
        for future in self._deferred:
            future.cancel()
