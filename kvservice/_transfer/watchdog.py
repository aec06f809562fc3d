"""The watchdog: the one task that drives every transfer handle.

Each tick is one round trip to the door thread (``_door.run_tick``) carrying
the releases, posts and state checks due, and bringing back their outcomes and
any NIXL notifications.  Work per tick is bounded (``max_posts_per_tick`` and
``max_post_bytes_per_tick``; ``max_checks_per_tick``, rotating round-robin over
the in-flight set), so the event loop stays responsive with thousands of
transfers in flight and completions come back while later posts still copy.

Cadence.  New work (``schedule``, ``forget``) wakes the watchdog at once.  While
transfers are in flight or expected (an Expect whose sender said ``Posted``, or one of a
sender of protocol 6 or older: ``RequestPlane.busy``), a tick with nothing to post *lingers* on
the door thread, polling NIXL every ``poll_interval`` (that polling is also what
lets peers' WRITEs into this process complete while NIXL's progress thread is
off) and returning at the first news, or after ``LINGER_S``; so the loop pays a
thread hop per event rather than per poll, and the cadence holds on loops
whose timers cannot sleep under a millisecond (uvloop).  Notifications do not
end it: it hands them to the loop as they come (``delivery``) and lingers on, so
a receiver's arrival costs the loop one wake-up and no new tick; one that leaves nothing
to poll for ends it then (``_delivered``).  For ``FINE_WINDOW_S``
after a post that returned in flight it polls every ``FINE_POLL_S`` instead: such a WRITE
ends at its receiver's next poll, and a sender that sees it at once sends its next request
at once (raw NIXL's sender spins on it).  A receiver does the same from a sender's
``Posted`` until the first notification comes (``poll_finely``).  A tick that posted a lone
request to a receiver known to be polling (``cadence.Warmth``), with no other WRITE in flight,
follows the WRITEs it left in flight on the door thread, every ``FINE_POLL_S`` for up to ``FOLLOW_S``
while no other call waits for that thread (``TickPlan.follow``): their ends come back with the
posts, and a hand-off costs the loop one tick instead of two.  Idle, it sleeps
until woken or for a wait that backs off to ``idle_interval`` (``cadence``).
Deadlines are scanned every ``DEADLINE_SCAN_S`` (idle: at each idle tick, and an idle wait
ends by the earliest deadline).

Proofs.  No handle is released while NIXL says ``PROC``: a release does not stop a
WRITE under way.  A lost receiver's handles are *drained*, and an ended request's
handles still in flight are *let go* (``drain``, the rule in ``_transfer.drain``):
checked until each ends, or until a deadline.  Every one that ends otherwise than
``DONE`` (an error, a failed post, given up at its deadline) makes its request
unproven to its receiver (``proofs``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import anyio.abc
import anyio.lowlevel

from .._control.protocol import FENCE
from .._nixl.door import (
    Door,
    DoorError,
    DoorThread,
    FineWindow,
    PostOp,
    TickOutcome,
    TickPlan,
    XferId,
    XferState,
    run_tick,
    take_late,
)
from .._results import FailureReason
from .._stats import Stats
from ..memory._regions import KVMemory
from . import cadence
from .cadence import LIGHT_POLL_S, IdleBackoff, Warmth
from .delivery import Delivery
from .drain import Drains
from .posts import chunk_post, fence_post
from .proofs import Proofs
from .requests import SendRequest
from .staging import Stager

DEADLINE_SCAN_S = 0.01
#: an idle wait ended by a deadline ends this long after it: the deadline has passed then
#: (``Deadlines.pop_due`` takes those before now), and a wait of nothing is no busy loop
DUE_SLACK_S = 0.001
#: longest a tick polls on the door thread before handing control back to the loop
LINGER_S = DEADLINE_SCAN_S


class Owner(Protocol):
    """What the watchdog calls back into (the service)."""

    def chunk_done(self, req: SendRequest, nbytes: int) -> None: ...
    def chunk_failed(self, req: SendRequest, err: DoorError) -> None: ...
    def released(self, req: SendRequest) -> None:
        """``req`` has ended and no handle of it is posted or drained for it any more
        (what of it was let go in flight is checked on for the proof alone)."""
    def fence_failed(self, req: SendRequest, err: DoorError | None) -> None:
        """The settle fence of ``req`` did not land (NIXL error, or its handle went)."""
    def let_go_ended(self, req: SendRequest) -> None:
        """Every handle ended ``req`` let go in flight has ended (each not ``DONE`` made it
        unproven: ``proofs``)."""
    def on_notifs(self, notifs: Mapping[str, list[bytes]]) -> None: ...
    def first_posts(self, peer: str, request_ids: list[str]) -> None:
        """The first WRITEs of these requests to ``peer`` are posted (``peer`` may be told:
        ``Posted``); called as the tick that posted them is digested (``_tell_posted``)."""
    def check_deadlines(self, now: float) -> None: ...
    def next_due(self) -> float | None:
        """When the earliest deadline ``check_deadlines`` acts on passes, if any."""
    def busy(self) -> bool: ...
    def quiet(self) -> bool:
        """Whether no notification can matter here: no request under way or expected, no
        pages held unsettled.  The idle waits then start at their ceiling."""
    def light(self) -> bool:
        """Whether the receiving side holds one hand-off or a few, small (``cadence.LIGHT_RECVS``,
        ``LIGHT_MAX_BYTES``): its lingering ticks then poll at ``LIGHT_POLL_S``."""
    def lone(self) -> bool:
        """Whether the sending side sends one request at most: its posts may be followed
        (``FOLLOW_S``)."""
    @property
    def stats(self) -> Stats: ...


@dataclass(slots=True, eq=False)
class _Tick:
    """A tick on the door thread, not digested yet, with what its digest needs."""

    future: asyncio.Future[TickOutcome]
    #: planned to linger (it has no posts or releases of its own)
    lingering: bool
    #: when it was planned (``_tell_posted``)
    submitted_at: float
    #: the handles it checks: a tick queued behind it checks none of them
    checks: list[XferId]
    #: the requests whose first WRITE it posts, by peer: their receivers are told
    #: (``Owner.first_posts``) once it has posted them (``_tell_posted``)
    first: dict[str, list[SendRequest]]
    #: peers forgotten while it was on the door thread: a fence of theirs it posted is
    #: released by the peer's unloading, never checked
    forgotten: set[str] = field(default_factory=set)


class Watchdog:
    def __init__(
        self, thread: DoorThread, door: Door, memory: KVMemory, owner: Owner, *,
        poll_interval: float, idle_interval: float, max_posts: int, max_checks: int,
        max_post_bytes: int,
        clock: Callable[[], float] | None = None, stager: Stager | None = None,
    ) -> None:
        self._thread = thread
        self._door = door
        self._layer_page_bytes = memory.page_bytes // memory.layers  # read once, not per post
        self._owner = owner
        self._poll = poll_interval
        self._idle = IdleBackoff(idle_interval)
        self._max_posts = max_posts
        self._max_post_bytes = max_post_bytes
        self._max_checks = max_checks
        self._clock = clock or time.monotonic  # looked up now, so the simulation's patched clock applies
        self._stager = stager  # sends through staging hold a range of it until released
        self._ready: dict[str, SendRequest] = {}  # requests with chunks to post
        self._inflight: dict[XferId, tuple[SendRequest, int]] = {}
        self._releases: list[XferId] = []
        #: which requests this sender could not prove over to their receivers
        self.proofs = Proofs()
        #: handles of lost receivers checked until they end (``drain``)
        self._drains = Drains(self.proofs, settle_if_released=self._settle_if_released,
                              release=lambda xid: self._releases.append(xid),
                              posts_pending=lambda: bool(self._late),
                              let_go_ended=owner.let_go_ended)
        self._fences: list[PostOp] = []  # settle fences to post next tick
        self._cursor = 0
        #: where the tick planned last (or lingering now) collects its first posts (``_Tick.first``)
        self._first: dict[str, list[SendRequest]] = {}
        #: which receivers poll now, as far as this sender knows (``_tell_posted``)
        self._warmth = Warmth()
        self._idle_until = 0.0  # when the idle wait under way ends (0: none is)
        #: open: lingering ticks poll every ``FINE_POLL_S`` (``poll_finely``)
        self._fine = FineWindow(poll=min(cadence.FINE_POLL_S, poll_interval))
        self._wake = anyio.Event()
        self._stopping = False
        self._stopped = anyio.Event()
        #: the oldest tick queued on the door thread and not yet digested, if any ...
        self._ahead: _Tick | None = None
        #: ... and one queued behind it while it posts (``_queue_next``), if any
        self._queued: _Tick | None = None
        self._queue_asked = False  # a ``_queue_next`` is scheduled on the loop
        #: posts handed over to the tick ahead (``TickPlan.late``), and how many posts and
        #: bytes it may still be handed (the per-tick limits, counted from its planning)
        self._late: deque[PostOp] = deque()
        self._late_left = (0, 0)
        self.ticks = 0
        #: ticks planned to linger (to poll NIXL on the door thread): none while only cold
        #: Expects are held (``RequestPlane.busy``)
        self.lingered = 0
        #: ticks planned to follow their posts (``FOLLOW_S``), and WRITEs seen ending in them
        self.followed = 0
        self.caught = 0
        self.live_handles = 0  # as the door last reported
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop ``run`` runs on
        #: notifications lingering ticks hand over without ending (``delivery``)
        self._delivery = Delivery(self._delivered)

    # -- called by the service (event loop) -----------------------------------
    def schedule(self, req: SendRequest) -> None:
        """``req`` has a destination and pending chunks: post them next tick.

        With no tick on the door thread, that tick is queued right here: the door
        thread starts the copy while the loop goes on to wake the watchdog task,
        instead of after it (a thread wake-up less on a lone request's path).  With
        a lingering tick there (other transfers in flight or awaited), the posts are
        handed over to it (``TickPlan.late``): it posts them at once and returns with
        their outcome, where ending it first would cost a round trip through the loop
        before the copy starts."""
        self._ready[req.request_id] = req
        if self._ahead is None:
            self._ahead = self._submit(linger=False)
            self._wake.set()  # no tick lingers: the watchdog task only needs to digest this one
            return
        if self._ahead.lingering:
            posts: list[PostOp] = []
            self._late_left = self._take_posts(posts, *self._late_left)
            self._late.extend(posts)  # then wake(): the door thread sees them once woken
            self.wake()
        elif not self._queue_asked and self._loop is not None:
            # a tick that posts is on the door thread: queue the next behind it, once the
            # senders woken with this one have sent too (one tick for them all)
            self._queue_asked = True
            self._loop.call_soon(self._queue_next)

    def forget(self, req: SendRequest) -> None:
        """``req`` ended: drop it and let go of whatever of it is still in flight (checked
        on until it ends, for the proof only: ``drain.Drains.let_go``).  Once nothing of it
        is being posted, or drained with its receiver's lost link, ``Owner.released(req)``
        is called."""
        self._ready.pop(req.request_id, None)
        if req.inflight:
            # not released: a released handle does not stop its WRITE, and only one seen to
            # end DONE proves it over to a receiver that asks
            for xid in req.inflight:
                self._inflight.pop(xid, None)
            self._drains.let_go(req, req.inflight, self._clock())
            req.inflight = None
            self.wake()
        self._settle_if_released(req)

    def fence(self, req: SendRequest) -> bool:
        """Post the settle fence of a failed ``req`` whose handles are all released
        (``posts.fence_post``).  False when ``req`` never posted anything (nothing to fence)."""
        op = fence_post(req)
        if op is None:
            return False
        self._fences.append(op)
        self.wake()
        return True

    def forget_fences(self, peer: str) -> None:
        """``peer`` is about to be unloaded (which releases its handles): stop checking
        the fences posted to it, and, unless its drain waits for them, its handles let go."""
        for xid in [x for x, (req, n) in self._inflight.items() if n == FENCE and req.peer == peer]:
            self.proofs.unproven(peer, self._inflight.pop(xid)[0].request_id, "fence forgotten with its peer")
        self._fences = [op for op in self._fences if op.peer != peer]
        if self._drains.event(peer) is None:  # unloaded without a drain: what was let go goes now
            self._drains.give_up(peer)
        self._warmth.forget(peer)
        self._drains.lost_handled(peer)
        for tick in (self._ahead, self._queued):
            if tick is not None:
                tick.forgotten.add(peer)

    def drain(self, peer: str, until: float, keep_until: float) -> anyio.Event | None:
        """The link to receiver ``peer`` is lost: drain its handles in flight (chunks and
        fences) until each ends or ``keep_until``, its requests let go by ``until`` at the
        latest (the rule: ``_transfer.drain``).  Returns an event set when nothing of
        ``peer`` drains any more (the door may unload it then), or None if nothing does."""
        moved = [(xid, req, n == FENCE) for xid, (req, n) in self._inflight.items() if req.peer == peer]
        for xid, _, _ in moved:
            del self._inflight[xid]
        # A tick on the door thread may be posting to it: what it posts drains too (_digest).
        event = self._drains.start(peer, moved, until, keep_until,
                                   posting=self._ahead is not None or bool(self._late))
        if event is not None:
            self.wake()
        return event

    def draining(self, peer: str) -> anyio.Event | None:
        """Set once nothing of ``peer`` drains any more; None if nothing does now."""
        return self._drains.event(peer)

    def receiver_failed(self, req: SendRequest) -> None:
        """``req``'s receiver has failed it: what ``req`` let go in flight holds it no longer."""
        self._drains.free(req)

    def draining_requests(self, peer: str) -> set[str]:
        """The requests with a handle to ``peer`` still draining: none of them is proven yet."""
        return self._drains.requests(peer)

    def forced(self, xids: list[XferId]) -> None:
        """The door released these handles itself (their peer was unloaded or replaced)."""
        for xid in xids:
            entry = self._inflight.get(xid) or self._drains.handles.get(xid)
            if entry is not None:
                self.proofs.unproven(entry[0].peer, entry[0].request_id, "released by the door")
            if xid in self._drains.handles:  # never checked again: a released handle is gone
                self._drains.ended(xid, proven=False)

    def _settle_if_released(self, req: SendRequest) -> None:
        if req.finished and req.posting == 0 and req.releasing == 0:
            if self._stager is not None:  # nothing of it is posted any more: its range is free
                self._stager.sent(req)
            self._owner.released(req)

    def due(self, at: float) -> None:
        """A deadline at ``at`` was filed: an idle wait that would end later ends now (the
        next one ends by it: ``_idle_wait``)."""
        if at < self._idle_until:
            self.wake()

    def wake(self) -> None:
        self._wake.set()
        self._thread.interrupt.set()  # end a lingering tick: there is work for the loop

    def poll_finely(self) -> None:
        """A WRITE was just posted, by this side or into it (a peer's ``Posted``): one its post
        left in flight ends at the receiver's next poll, and its notification comes at a
        receiver's poll after the sender's next check.  Lingering ticks, the one lingering now
        included, poll every ``FINE_POLL_S`` for ``FINE_WINDOW_S`` or until notifications
        come (``FineWindow``); nothing is woken (ending a lingering tick to plan a finer one
        cost more than it saved: docs/perf/library.md)."""
        self._fine.until = time.monotonic() + cadence.FINE_WINDOW_S  # the door thread's clock

    @property
    def lingering(self) -> bool:
        """Whether a tick polls NIXL on the door thread now (planned to linger, not digested)."""
        return self._ahead is not None and self._ahead.lingering

    @property
    def deliveries(self) -> int:
        """Batches of notifications lingering ticks handed over without ending (``delivery``)."""
        return self._delivery.count

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    @property
    def working(self) -> bool:
        """Whether WRITEs are to post, being posted or in flight (handles this side polls)."""
        return bool(self._ready or self._late or self._inflight or self._drains
                    or (self._ahead is not None and not self._ahead.lingering))

    @property
    def staging_held(self) -> int:
        """Bytes of the staging buffer that sends hold now."""
        return self._stager.held_bytes if self._stager is not None else 0

    # -- the task -------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._loop = asyncio.get_running_loop()
        task_status.started()
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self._delivery.run)
                await self._run()
                tg.cancel_scope.cancel()
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """End ``run`` after the ticks in flight are digested, a tick queued behind the one
        returning included (so that ``tick`` then runs alone: two ticks in flight could check
        one handle twice)."""
        self._stopping = True
        self.wake()
        await self._stopped.wait()
        self._drains.expire(float("inf"))  # what still drains is released (unproven) by the last tick

    async def _run(self) -> None:
        next_scan = 0.0
        while not self._stopping or self._ahead is not None:  # a tick queued is digested first
            if self._ahead is None and not self._polls_for():
                self._wake = anyio.Event()
                wait = self._idle_wait()
                self._idle_until = self._clock() + wait
                with anyio.move_on_after(wait) as idle:
                    await self._wake.wait()
                self._idle_until = 0.0
                if self._stopping:
                    return
                if not idle.cancelled_caught:  # woken: work came
                    self._idle.reset()
            else:
                self._idle.reset()
            if self._ahead is None:
                self._ahead = self._submit(linger=True)
            ahead = self._ahead
            try:
                outcome = await ahead.future
            finally:
                if self._ahead is ahead:  # the one queued behind it is on the door thread now
                    self._ahead, self._queued = self._queued, None
            self._digest(outcome, ahead)
            if outcome.notifs:  # news while idle, maybe more behind it: look again soon
                self._idle.reset()
            if self._stopping:
                continue
            now = self._clock()
            if now >= next_scan:
                self._owner.check_deadlines(now)
                next_scan = now + DEADLINE_SCAN_S
            if self._ahead is None and (self._ready or self._releases or self._late):
                # Queue the next tick before yielding, so the door thread copies while
                # the senders just woken run.  It is planned after the digest and the
                # deadline scan, so it checks no handle they have just let go of.
                self._ahead = self._submit(linger=False)
                continue
            self._queue_next()  # posts the budget left for later, while the tick ahead posts
            # Let the tasks this digest woke run first: a client whose request just
            # ended usually sends its next one in that turn, and schedule() then queues
            # the post straight away rather than after this task has gone idle.
            await anyio.lowlevel.checkpoint()

    def _idle_wait(self) -> float:
        """The next idle wait (``cadence``; its ceiling at once where the owner is quiet),
        ended early by the owner's next deadline (a request that waits with nothing in
        flight, such as a send for its Expect, keeps no tick polling; it still fails on
        time), ``DUE_SLACK_S`` after it."""
        wait = self._idle.ceiling if self._owner.quiet() else self._idle.next()
        due = self._owner.next_due()
        if due is not None:
            wait = min(wait, max(0.0, due - self._clock()) + DUE_SLACK_S)
        return wait

    async def tick(self) -> None:
        """One round trip to the door thread with whatever is due (no lingering)."""
        tick = self._submit(linger=False)
        self._digest(await tick.future, tick)

    def _queue_next(self) -> None:
        """Queue a tick behind the one ahead while that one posts, if posts wait: the door
        thread goes on to it without waiting for the loop to digest the one ahead, nor for
        the GIL, which the loop holds while it digests (docs/perf/library.md: "The NIXL
        thread waited for the loop between ticks").  It checks none of the
        handles the one ahead checks (a handle checked twice may be checked after its
        release), and none is planned while the one ahead has returned undigested."""
        self._queue_asked = False
        ahead = self._ahead
        if (ahead is None or ahead.lingering or ahead.future.done() or self._queued is not None
                or self._stopping or not self._ready):
            return
        self._queued = self._submit(linger=False, skip=ahead.checks, follow=False)

    def _submit(self, *, linger: bool, skip: list[XferId] | None = None, follow: bool = True) -> _Tick:
        """Plan a tick and queue it on the door thread.  With ``linger`` and nothing to
        post or release, it waits there (polling) for news for up to ``LINGER_S``.
        ``skip``: handles it does not check (a tick ahead of it does).  ``follow``: its posts
        may be followed (``FOLLOW_S``); not for one queued behind a tick that posts, whose
        WRITEs, in flight but not digested yet, would wait for the follow's."""
        self._thread.interrupt.clear()  # set again by any wake() from here on
        submitted_at = self._clock()
        first: dict[str, list[SendRequest]] = {}
        self._first = first
        plan = self._plan(skip)
        if self._late:  # handed over to the last tick after it stopped looking: planned first
            plan.posts[:0] = take_late(self._late)
        plan.late = self._late  # what is handed over from now on goes after this plan's posts
        lingering = (linger and not plan.posts and not plan.releases
                     and bool(self._inflight or self._drains or self._owner.busy()))
        if (follow and plan.posts and not (self._inflight or self._drains) and self._owner.lone()
                and self._warmth.all_poll((op.peer for op in plan.posts), self._clock())):
            plan.follow, plan.follow_poll, plan.queued = cadence.FOLLOW_S, self._fine.poll, self._thread.wait_queued
            self.followed += 1
        if lingering:
            self.lingered += 1
            plan.linger, plan.poll, plan.interrupt = LINGER_S, self._linger_poll(), self._thread.interrupt
            plan.fine = self._fine
            if self._delivery.running:
                plan.deliver = self._delivery.put
            self._late_left = (self._max_posts, self._max_post_bytes)
        return _Tick(self._thread.submit(run_tick, self._door, plan), lingering, submitted_at, plan.checks, first)

    def _delivered(self, notifs: Mapping[str, list[bytes]]) -> None:
        """A lingering tick handed these over: the owner takes them, and where they ended the
        last thing polled for (a receiver's one arrival), the tick is ended now rather than at
        its ``LINGER_S``: it would only poll on for nothing, on a core the engine then wants
        (a decode's first forward follows its arrival)."""
        self._owner.on_notifs(notifs)
        if self.lingering and not self._polls_for():
            self._thread.interrupt.set()

    def _polls_for(self) -> bool:
        """Whether anything keeps this side polling NIXL: WRITEs to post, in flight or
        drained, releases or fences due, or the owner's receivers (``Owner.busy``)."""
        return bool(self._ready or self._late or self._inflight or self._drains or self._releases
                    or self._fences or self._owner.busy())

    def _linger_poll(self) -> float:
        """A lingering tick's cadence: ``cadence.LIGHT_POLL_S`` where it polls for no more than
        a receiving side's one request (no WRITE of this side in flight or drained), else
        ``poll_interval``."""
        if self._inflight or self._drains or not self._owner.light():
            return self._poll
        return min(self._poll, LIGHT_POLL_S)

    def _digest(self, outcome: TickOutcome, tick: _Tick) -> None:
        self.ticks += 1
        self._delivery.take()  # handed over by this tick (or one before) while it lingered
        self.live_handles = outcome.live
        if outcome.post_times:
            self._owner.stats.peers.posts(outcome.post_times)
        left: list[XferId] = []  # posts of requests' chunks that returned with their WRITE in flight
        for key, got, state in outcome.posted:
            req, nbytes = key
            if nbytes == FENCE:  # tracked only so its handle is checked until done
                if isinstance(got, int) and state is XferState.PROC and req.peer not in tick.forgotten:
                    self._inflight[got] = (req, FENCE)
                elif isinstance(got, DoorError):
                    self.proofs.unproven(req.peer, req.request_id, "fence post failed")
                    self._owner.fence_failed(req, got)
                elif state is XferState.PROC:  # its peer's unloading releases it, unchecked
                    self.proofs.unproven(req.peer, req.request_id, "fence unloaded with its peer")
                continue
            req.posting -= 1
            if not isinstance(got, DoorError):
                req.posted = True
            if isinstance(got, DoorError):
                self._drains.note_disconnect(req, got)
                self.proofs.unproven(req.peer, req.request_id, "post failed")
                self._owner.chunk_failed(req, got)
            elif req.finished:
                # failed or aborted while posting: drained with its lost receiver's, or let go
                if state is XferState.PROC:
                    self._drains.add_posted(got, req, self._clock())
            elif state is XferState.DONE:
                self._owner.chunk_done(req, nbytes)
            else:
                self._inflight[got] = (req, nbytes)
                left.append(got)
                if req.inflight is None:
                    req.inflight = {got}
                else:
                    req.inflight.add(got)
            if req.finished:
                self._settle_if_released(req)
        self._drains.check_all()  # drains that waited only for this tick's posts
        for xid, state_or_err in outcome.checked:
            if state_or_err is XferState.PROC:
                continue
            if xid in self._drains.handles:
                self._drains.ended(xid, proven=state_or_err is XferState.DONE)
                continue
            entry = self._inflight.pop(xid, None)
            if entry is None:  # released in the meantime
                continue
            req, nbytes = entry
            if state_or_err is not XferState.DONE:  # an error, or released behind our back
                self.proofs.unproven(req.peer, req.request_id, "ended in an error")
            if nbytes == FENCE:
                if state_or_err is not XferState.DONE:  # an error, or released behind our back
                    self._owner.fence_failed(req, state_or_err if isinstance(state_or_err, DoorError) else None)
                continue
            if req.inflight is not None:
                req.inflight.discard(xid)
            if isinstance(state_or_err, DoorError):
                self._drains.note_disconnect(req, state_or_err)
                self._owner.chunk_failed(req, state_or_err)
            elif state_or_err is XferState.DONE:
                self._owner.chunk_done(req, nbytes)
            else:  # GONE: the handle was released behind our back; its WRITE is not done
                self._owner.chunk_failed(req, DoorError(
                    FailureReason.BACKEND, RuntimeError(f"transfer handle {xid} released outside the watchdog"),
                    "check_xfer_state"))
        if left:
            still = sum(xid in self._inflight for xid in left)
            self.caught += len(left) - still  # seen ending within the tick (``_follow``)
            if still:
                self.poll_finely()
        if outcome.notifs:
            self._owner.on_notifs(outcome.notifs)
        if tick.first:
            self._tell_posted(tick)

    def _tell_posted(self, tick: _Tick) -> None:
        """Tell the receivers of the requests whose first WRITE ``tick`` posted that they
        are posted (``Posted``): they poll for them from this word on.

        After the post, not before: writing the frame (and its reading on the receiver)
        would hold up the post, both processes sharing the cores (measured, w2/c1: the post
        started 180 us later).  A WRITE that completed within its post needs the receiver's
        polling only for its notification; one that did not has this word on its way as the
        post returns (one frame per peer per digest, last: the tasks this digest woke, a
        client's next ``send()``, run before its writing).

        Not said at all for a request that completed within this tick (its post, or the
        following of it: ``TickPlan.follow``) when a request to the same peer did so in a
        tick that began less than ``WARM_GRACE_S / 2`` ago (``cadence.Warmth``): its
        receiver saw that one's notification no earlier than that tick began, and polls on
        for ``WARM_GRACE_S`` after it (``RequestPlane.busy``), so it takes this request's
        notification (which turns it warm, and starts that polling again) without the word.
        Hand-offs one after another then cost no frame each.  Should that receiver not poll
        (its loop held past the margin, that request ended there before its notification),
        its idle ticks take the notification, the first ``IDLE_FIRST_S`` after its last work."""
        now = self._clock()
        for peer, reqs in tick.first.items():
            polled = self._warmth.polls(peer, now)
            rids = []
            for req in reqs:
                if req.result is not None and req.result.ok:  # completed within this tick
                    self._warmth.saw(peer, tick.submitted_at)
                    if polled:
                        continue
                rids.append(req.request_id)
            if rids:
                self._owner.first_posts(peer, rids)

    def _plan(self, skip: list[XferId] | None = None) -> TickPlan:
        if self._drains.until:
            self._drains.expire(self._clock())
        plan = TickPlan(releases=self._releases, posts=self._fences)
        self._releases = []
        self._fences = []
        self._take_posts(plan.posts, self._max_posts, self._max_post_bytes)
        xids = list(self._inflight) + list(self._drains.handles)
        if skip:
            ahead = set(skip)
            xids = [xid for xid in xids if xid not in ahead]
        if len(xids) <= self._max_checks:
            plan.checks = xids
        else:
            start = self._cursor % len(xids)
            plan.checks = (xids[start:] + xids[:start])[: self._max_checks]
            self._cursor = start + self._max_checks
        return plan

    def _take_posts(self, posts: list[PostOp], budget: int, byte_budget: int) -> tuple[int, int]:
        """Plan the ready requests' next chunks into ``posts``, within ``budget`` posts and
        ``byte_budget`` bytes; returns what is left of both."""
        for rid in list(self._ready):
            if budget <= 0 or byte_budget <= 0:
                break
            req = self._ready[rid]
            while req.pending and budget > 0 and byte_budget > 0:
                src, _, lo, hi = req.pending[0]
                byte_budget -= int(src.size) * (hi - lo) * self._layer_page_bytes
                posts.append(self._post_op(req))
                budget -= 1
            if not req.pending:
                del self._ready[rid]
        return budget, byte_budget

    def _post_op(self, req: SendRequest) -> PostOp:
        assert req.peer is not None
        if req.chunks_posted == 0:
            self._first.setdefault(req.peer, []).append(req)
        if req.started_at is None:
            req.started_at = self._clock()
        return chunk_post(req, self._stager)
