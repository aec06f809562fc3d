"""The interface every layer above NIXL speaks, and the one thread it runs on.

``Door`` is a small synchronous interface over a NIXL agent.  ``_nixl.NixlDoor``
implements it with the real library; unit tests script a fake.  Whatever the
implementation, three rules hold and are enforced by the door itself:

* **One thread.**  Every door method runs on the single ``DoorThread``.  NIXL
  calls can block for the whole copy (a post on the default transport copies
  before it returns), so none runs on the event loop, and since they all run
  on one thread no two of them ever race on a handle.
* **Handles are released exactly once.**  The door owns every transfer handle in
  a table keyed by an integer ``XferId``.  A handle leaves the table, and is
  released, when it reaches a terminal state (``DONE`` or an error) or on
  ``release()``.  Any later use of that id is answered from the table
  (``GONE``) without touching NIXL, which would segfault on a released handle.
* **Failures are values.**  NIXL exceptions become ``DoorError`` carrying a
  ``FailureReason`` and the original exception; nothing else is caught.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from .._results import FailureReason, KVServiceError
from .._threads import start_thread

XferId = int
T = TypeVar("T")
#: memory to register: (address, bytes, device id)
Segment = tuple[int, int, int]
#: a local descriptor table for some peers, and the key it is shared under
LocalTable = tuple[Hashable, npt.NDArray[np.uint64]]


class XferState(enum.Enum):
    DONE = "DONE"  # complete; the handle has been released
    PROC = "PROC"  # in flight
    GONE = "GONE"  # not in the door's table (already released)


class DoorError(KVServiceError):
    """A NIXL call failed.  ``reason`` classifies it; ``original`` is NIXL's exception.

    Raised by every ``Door`` method, on the door thread.  The layers above never let
    it reach a caller: the request fails with ``reason`` and keeps ``original`` as its
    ``error`` (a peer NIXL would not load refuses that peer's link)."""

    def __init__(self, reason: FailureReason, original: BaseException, op: str) -> None:
        super().__init__(f"{op}: {type(original).__name__}: {original}")
        self.reason = reason
        self.original = original
        self.op = op

    def __reduce__(self) -> tuple[object, ...]:  # pickle rebuilds it from __init__'s arguments
        return type(self), (self.reason, self.original, self.op), self.__dict__


#: a notification that only asks NIXL whether a peer's endpoint is still there (receivers
#: take it as a stale notification)
PROBE_NOTIF = b"kvservice-probe"


class Door(Protocol):
    """What kvservice needs from NIXL.  All methods run on the door thread."""

    agent_name: str

    def metadata(self) -> bytes: ...

    def metadata_agent(self, metadata: bytes) -> str | None:
        """The agent name inside a peer's metadata, or None if unreadable.  Pure:
        the one door method that may run on any thread (it touches no agent)."""

    def register(self, segments: Sequence[Segment], mem_type: str, table: npt.NDArray[np.uint64]) -> None:
        """Register the KV memory's segments (``mem_type`` DRAM or VRAM) and prepare
        ``table`` (every page of every region) as the local side of transfers."""

    def add_peer(self, name: str, metadata: bytes, table: npt.NDArray[np.uint64],
                 local: LocalTable | None = None) -> None:
        """Load a peer agent (replacing one of that name) and prepare its descriptor
        table; transfers to it use ``local`` as their local side (prepared once per key,
        shared by the peers with that key) or, when None, the table of ``register``.
        The same agent loaded again with the same metadata, its endpoint not reported
        disconnected, is kept as it is (its handles in flight go on)."""

    def remove_peer(self, name: str, *, keep_loaded: bool = False) -> list[XferId]:
        """Release every handle to ``name``, then unload it.  Returns the released ids.
        ``keep_loaded``: its process may be alive (a lost link, not a gone peer): keep its
        NIXL agent and endpoint (within a bound), so that loading it again with the same
        metadata reuses them (``add_peer``) rather than opening another connection."""

    def forget_peer(self, name: str) -> None:
        """``name``, unloaded, is gone for good: drop what ``remove_peer`` kept of it."""

    def kept(self, name: str) -> bool:
        """Whether ``name``, unloaded by ``remove_peer(keep_loaded=True)``, is still kept
        (not linked again, forgotten or evicted by the bound)."""

    def post(
        self, peer: str, local_idx: npt.NDArray[np.int32], remote_idx: npt.NDArray[np.int32],
        notif: bytes,
    ) -> tuple[XferId, XferState]:
        """Create and post a WRITE.  Raises ``DoorError`` (nothing left behind)."""

    def check(self, xfer: XferId) -> XferState:
        """State of a handle; raises ``DoorError`` (and releases it) on failure."""

    def release(self, xfer: XferId) -> bool:
        """Release an in-flight handle (cancels it).  False if it was already gone."""

    def notifs(self) -> Mapping[str, list[bytes]]:
        """Drain notifications received since the last call, by sender agent name."""

    def send_notif(self, peer: str, message: bytes) -> None: ...

    def live_xfers(self) -> int: ...

    def close(self) -> None:
        """Release everything and drop the agent.  Idempotent."""


@dataclass(slots=True)
class PostOp:
    key: Any  # the caller's token, echoed in the outcome
    peer: str
    local_idx: npt.NDArray[np.int32]
    remote_idx: npt.NDArray[np.int32]
    notif: bytes
    #: run on the door thread just before the post (a staging gather: ``_transfer.staging``)
    prepare: Callable[[], None] | None = None


@dataclass(slots=True)
class FineWindow:
    """Until when (``time.monotonic()``) lingering ticks poll every ``poll`` seconds rather
    than at their plan's cadence: a WRITE was just posted, by this side or into it, and
    ends at a poll soon.  The loop opens it (``until``); the door thread reads it at every
    poll, so a tick lingering already takes it up at its next one, and closes it when
    notifications come (what the receiver polled for).  Shared by every tick."""

    poll: float = 0.0
    until: float = 0.0


@dataclass(slots=True)
class TickPlan:
    posts: list[PostOp] = field(default_factory=list)
    checks: list[XferId] = field(default_factory=list)
    releases: list[XferId] = field(default_factory=list)
    #: with nothing to report, keep polling on the door thread this long (seconds) ...
    linger: float = 0.0
    #: ... every ``poll`` seconds (every ``fine.poll`` while ``fine`` is open), and stop
    #: early once ``interrupt`` is set
    poll: float = 0.0
    fine: FineWindow | None = None
    interrupt: threading.Event | None = None
    #: posts handed over by the loop after this plan was made (``Watchdog.schedule``): the
    #: tick posts them after its own, and while it lingers as soon as ``interrupt`` wakes
    #: it, so a post that arrives during a linger costs no round trip through the loop.
    #: Shared by every tick; the loop only appends, the door thread only takes.
    late: deque[PostOp] | None = None
    #: while lingering, notifications are handed to this (on the door thread) and the tick
    #: lingers on, instead of ending to bring them back: a receiver's batch of arrivals then
    #: costs the loop one wake-up, not a wake-up and a new tick.  None: they end the tick.
    deliver: Callable[[Mapping[str, list[bytes]]], None] | None = None
    #: after its posts, check the WRITEs they left in flight every ``follow_poll`` seconds
    #: for up to this long (seconds), until each ends or another call is queued for the door
    #: thread (``queued(seconds)`` waits up to that long for one, True once there is one:
    #: ``DoorThread.wait_queued``): into a receiver known to be polling such a WRITE ends at
    #: that receiver's next poll, and seen ending here it costs the loop no second tick
    follow: float = 0.0
    follow_poll: float = 0.0
    queued: Callable[[float], bool] | None = None


@dataclass(slots=True)
class TickOutcome:
    posted: list[tuple[Any, XferId | DoorError, XferState | None]] = field(default_factory=list)
    #: terminal states only: a handle still in flight is left out
    checked: list[tuple[XferId, XferState | DoorError]] = field(default_factory=list)
    notifs: Mapping[str, list[bytes]] = field(default_factory=dict)
    live: int = 0
    #: the plan's releases, all done by the time the outcome exists
    released: list[XferId] = field(default_factory=list)
    #: (peer, seconds) of each post call above, timed here (``Stats.peers.posts``)
    post_times: list[tuple[str, float]] = field(default_factory=list)


def run_tick(door: Door, plan: TickPlan) -> TickOutcome:
    """One watchdog round trip: releases, then posts, then checks, then notifications.

    Runs on the door thread, so the event loop pays one thread hop per tick
    however many handles it covers.  When the plan asks for it and there is
    nothing to report, the tick *lingers*: it polls the still-running handles
    and the notifications every ``plan.poll`` seconds, here on the door thread,
    and returns at the first news, when ``plan.interrupt`` is set (the loop has
    new work, or another door call is queued) or after ``plan.linger``.  Posts
    the loop hands over meanwhile (``plan.late``) are posted before it returns.
    Notifications are not news that ends it when the plan has ``deliver``: they
    are handed to it as they come, and the tick lingers on.  Polling
    here costs a few microseconds per round instead of a thread hop, and
    ``time``-based waits keep sub-millisecond cadences that event-loop timers
    (uvloop's are in whole milliseconds) cannot.
    """
    out = TickOutcome(released=plan.releases)
    for xfer in plan.releases:
        door.release(xfer)
    _post(door, plan.posts, out)
    if plan.late:  # handed over since this plan was made: planned after its posts
        _post(door, take_late(plan.late), out)
    if plan.follow > 0:
        _follow(door, plan, out)
    running = _check(door, plan.checks, out)
    out.notifs = door.notifs()
    if plan.linger > 0 and not (out.posted or out.checked):
        _hand_over_notifs(plan, out)
        if not out.notifs:
            _linger(door, plan, running, out)
    out.live = door.live_xfers()
    return out


def _hand_over_notifs(plan: TickPlan, out: TickOutcome) -> None:
    """Give a lingering tick's notifications to ``plan.deliver`` (if it has one), so that
    it lingers on; otherwise they stay in ``out`` and end the tick."""
    if out.notifs and plan.deliver is not None:
        plan.deliver(out.notifs)
        out.notifs = {}


def _post(door: Door, ops: list[PostOp], out: TickOutcome) -> None:
    for op in ops:
        t0 = time.monotonic()
        try:
            if op.prepare is not None:
                _prepare(op.prepare)
            xid, state = door.post(op.peer, op.local_idx, op.remote_idx, op.notif)
        except DoorError as err:
            out.post_times.append((op.peer, time.monotonic() - t0))
            out.posted.append((op.key, err, None))
        else:
            out.post_times.append((op.peer, time.monotonic() - t0))
            out.posted.append((op.key, xid, state))


def take_late(late: deque[PostOp]) -> list[PostOp]:
    """Every post handed over so far, in the order handed (safe beside the loop's appends)."""
    ops = []
    while True:
        try:
            ops.append(late.popleft())
        except IndexError:
            return ops


def post_late(door: Door, plan: TickPlan, out: TickOutcome) -> None:
    """Post what was handed over to a lingering tick, if anything was."""
    if plan.late:
        _post(door, take_late(plan.late), out)


def _prepare(prepare: Callable[[], None]) -> None:
    """A post's copy before it (a staging gather); its failure fails that post alone."""
    try:
        prepare()
    except (RuntimeError, ValueError, OSError) as exc:
        raise DoorError(FailureReason.BACKEND, exc, "staging gather") from exc


def _check(door: Door, xfers: list[XferId], out: TickOutcome) -> list[XferId]:
    """Check ``xfers``; terminal states go to ``out``, the ids still running are returned."""
    running = []
    for xfer in xfers:
        try:
            state = door.check(xfer)
        except DoorError as err:
            out.checked.append((xfer, err))
            continue
        if state is XferState.PROC:
            running.append(xfer)
        else:
            out.checked.append((xfer, state))
    return running


def _follow(door: Door, plan: TickPlan, out: TickOutcome) -> None:
    """Check the WRITEs this tick's posts left in flight (``PROC``) every ``plan.follow_poll``
    until each has ended, ``plan.follow`` has passed or another call is queued (``plan.queued``);
    the ends go to ``out.checked`` (the loop digests a post, then its check, as two ticks would
    bring them)."""
    assert plan.queued is not None
    running = [got for _, got, state in out.posted if state is XferState.PROC and isinstance(got, int)]
    deadline = time.monotonic() + plan.follow
    while running and time.monotonic() < deadline and not plan.queued(plan.follow_poll):
        running = _check(door, running, out)


def _linger(door: Door, plan: TickPlan, running: list[XferId], out: TickOutcome) -> None:
    deadline = time.monotonic() + plan.linger
    fine = plan.fine
    while True:
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            return
        wait = min(fine.poll if fine is not None and now < fine.until else plan.poll, left)
        if plan.interrupt is not None:
            if plan.interrupt.wait(wait):
                post_late(door, plan, out)  # the loop's new work may be posts: post them now
                return
        else:
            time.sleep(wait)
        running = _check(door, running, out)
        out.notifs = door.notifs()
        if out.checked:
            return
        if out.notifs and fine is not None:
            fine.until = 0.0  # the news polled for finely came: the usual cadence again
        _hand_over_notifs(plan, out)
        if out.notifs:
            return


class DoorThread:
    """Runs door calls, in order, on one dedicated thread.

    A caller cancelled while its call runs does not stop the call: it finishes
    on the thread, and whatever it created stays in the door's tables, where
    ``Door.close()`` (queued behind it) finds and releases it.

    A call is one queue put and one ``call_soon_threadsafe`` back: about half
    the cost of a ``ThreadPoolExecutor`` round trip, which the watchdog pays on
    every tick.

    ``interrupt`` ends a lingering watchdog tick (see ``run_tick``): every call
    queued with ``call``/``call_sync`` sets it, so no door call waits behind a
    tick that is only polling.
    """

    def __init__(self, name: str = "kvservice-nixl") -> None:
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.interrupt = threading.Event()
        #: set by ``submit`` while the door thread waits in ``wait_queued`` (``_watching``)
        self._watched = threading.Event()
        self._watching = False
        self._thread = start_thread(self._run, name=name)

    def wait_queued(self, timeout: float) -> bool:
        """On the door thread: wait up to ``timeout`` seconds for a call to be queued for it;
        True once one is (at once if one is already), False after the wait."""
        self._watched.clear()
        self._watching = True  # from here on ``submit`` sets ``_watched``
        try:
            return not self._queue.empty() or self._watched.wait(timeout)
        finally:
            self._watching = False

    @property
    def thread_ident(self) -> int | None:
        return self._thread.ident

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job.run()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        self.interrupt.set()
        return await self.call_lingering(fn, *args)

    async def call_lingering(self, fn: Callable[..., T], *args: Any) -> T:
        """Like ``call`` but leaves ``interrupt`` alone: for the watchdog's own ticks."""
        return await self.submit(fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue ``fn(*args)`` now (without touching ``interrupt``); await the future
        later.  Cancelling the future does not stop the call."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._put(_Job(fn, args, loop, future))
        return future

    def _put(self, job: _Job | None) -> None:
        self._queue.put(job)
        if self._watching:  # after the put: ``wait_queued`` looks at the queue after raising it
            self._watched.set()

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """For use off the event loop (shutdown paths, tests)."""
        self.interrupt.set()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._put(_Job(fn, args, None, future))
        return future.result()

    def shutdown(self) -> None:
        self.interrupt.set()
        if self._thread.is_alive():
            self._put(None)
            self._thread.join()


@dataclass(slots=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    loop: asyncio.AbstractEventLoop | None  # None: ``future`` is a concurrent one
    future: asyncio.Future[Any] | concurrent.futures.Future[Any]

    def run(self) -> None:
        try:
            result, error = self.fn(*self.args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who re-raises it
            result, error = None, exc
        if self.loop is None:
            assert isinstance(self.future, concurrent.futures.Future)
            if error is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(error)
            return
        assert isinstance(self.future, asyncio.Future)
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result, error)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():  # the caller was cancelled; the call ran all the same
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
