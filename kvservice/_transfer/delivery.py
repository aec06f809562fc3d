"""Notifications a lingering tick hands from the door thread to the loop as they come.

A tick that lingers on the door thread (``watchdog``: polling NIXL while transfers are in
flight or awaited) does not end at a notification: it hands the batch over (``put``, the
plan's ``deliver``) and lingers on, so a receiver's arrival costs the loop one wake-up and no
new tick.  A task on the loop (``run``: the owner starts tasks of its own, which a bare loop
callback cannot) gives each batch to the owner in order; whatever it has not taken yet when a
tick's outcome is digested is taken first (``take``), so nothing is reordered.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping

import anyio
import anyio.abc

Notifs = Mapping[str, list[bytes]]


class Delivery:
    """The hand-over of one watchdog: the door thread only appends, the loop only takes."""

    def __init__(self, on_notifs: Callable[[Notifs], None]) -> None:
        self._on_notifs = on_notifs
        self._batches: deque[Notifs] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop ``run`` runs on
        #: batches handed over so far
        self.count = 0

    @property
    def running(self) -> bool:
        """Whether ``run`` has started: ``put`` may be used from then on."""
        return self._loop is not None

    def put(self, notifs: Notifs) -> None:
        """On the door thread: hand ``notifs`` to the loop."""
        assert self._loop is not None
        self._batches.append(notifs)
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def take(self) -> None:
        """On the loop: give every batch handed over and not taken yet to the owner."""
        while self._batches:
            self.count += 1
            self._on_notifs(self._batches.popleft())

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Take batches as they come, until cancelled (``put`` may be used once started)."""
        loop = self._loop = asyncio.get_running_loop()
        task_status.started()
        while True:
            self.take()
            self._waiter = loop.create_future()
            if not self._batches:  # appended since the take: go round again (its wake finds no waiter or a fresh one)
                await self._waiter
            self._waiter = None
