"""The drain: a lost receiver's WRITEs, checked until each ends rather than let go at once.

The rule.  When the link to a receiver is lost while WRITEs of this sender are in
flight to it, those handles are not released: a released handle does not stop a
WRITE already under way, and only a WRITE seen to end ``DONE`` proves that nothing of
its request can land any more (``proofs``).  So they *drain*: the watchdog keeps
checking them, one bounded check per tick like any other handle, until each ends.

Two deadlines per receiver, both set by whoever reports the loss (``Inbound``):

- ``until``: its requests count as released (``SendRequest.releasing`` drops) once all
  of each has ended, or at ``until``, whichever comes first; from then on a handle
  still draining (*let go*) is checked only for the proof, as a handle released in
  flight would go on too.
- ``keep_until`` (at most ``proofs.drain_limit``): past it, what still drains is
  released, unproven.  A receiver NIXL reported disconnected since its last loss keeps
  nothing past ``until``: its WRITEs cannot end ``DONE`` any more.

The same holds for a request that ends (an abort, a deadline, a failed chunk) while
WRITEs of it are in flight to a receiver whose link lives: they are *let go* at once
(``let_go``: the request is done with them) and checked for the proof alone, until each
ends or ``DRAIN_S`` passes.  A receiver that asks about it (``heal``) is answered once
they ended ``DONE``: a receiver stalled or cut off while they were in flight settles
within seconds of coming back, instead of at this process's exit.

A handle that ends in anything but ``DONE``, or is given up, makes its request unproven
to its receiver.  Once nothing of a receiver drains (and no post handed over to the
door thread may still be to it), its event is set: the control plane may unload its
agent then.

Everything here runs on the event loop, called by the watchdog (``watchdog``), which
owns the handles before and after: it moves a lost receiver's handles in (``start``,
``add_posted``) and an ended request's (``let_go``), hands in each check's outcome
(``ended``), and plans what ``expire`` gives up into its next tick's releases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import anyio

from .._nixl.door import DoorError, XferId
from .._results import FailureReason
from .proofs import DRAIN_S, Proofs
from .requests import SendRequest

#: handles let go and still checked, at most (past it the oldest is released, unproven)
MAX_LET_GO = 4096


class Drains:
    """The handles of lost receivers still draining, and each receiver's deadlines."""

    def __init__(self, proofs: Proofs, *, settle_if_released: Callable[[SendRequest], None],
                 release: Callable[[XferId], None], posts_pending: Callable[[], bool],
                 let_go_ended: Callable[[SendRequest], None]) -> None:
        self._proofs = proofs
        self._settle_if_released = settle_if_released  # the watchdog's: a request's last handle went
        self._let_go_ended = let_go_ended  # an ended request's handles let go have all ended
        self._release = release  # queue a handle for the next tick's releases
        self._posts_pending = posts_pending  # posts handed over and not yet digested (to any peer)
        #: handles of lost receivers checked until they end: id -> (request, fence?)
        self.handles: dict[XferId, tuple[SendRequest, bool]] = {}
        self.until: dict[str, float] = {}  # receiver agent -> when its requests are let go
        self._keep_until: dict[str, float] = {}  # receiver agent -> when its drained handles are released
        #: draining chunk handles whose request was let go already (insertion-ordered)
        self._let_go: dict[XferId, None] = {}
        #: of those, the ones an ended request let go while its link lived (``let_go``)
        self._ended_with: set[XferId] = set()
        #: of those, the ones whose request is not released yet: its receiver may not know it
        #: failed, so their late notifications could still complete it there (``let_go``)
        self._holding: set[XferId] = set()
        #: receivers NIXL reported disconnected (a post or check failed so) since their last loss:
        #: their WRITEs cannot end DONE any more, so a drain of theirs is not kept past ``until``
        self._disconnected: set[str] = set()
        self.drained: dict[str, anyio.Event] = {}  # receiver agent -> set once nothing of it drains

    def __bool__(self) -> bool:
        return bool(self.handles)

    def start(self, peer: str, moved: Iterable[tuple[XferId, SendRequest, bool]], until: float,
              keep_until: float, *, posting: bool) -> anyio.Event | None:
        """``peer`` is lost: drain ``moved`` (its handles in flight: id, request, fence?).
        ``posting``: a tick on the door thread may be posting to it (what it posts drains
        too: ``add_posted``).  Returns the event set once nothing of ``peer`` drains, or
        None if nothing does."""
        for xid in [x for x in self._holding if self.handles[x][0].peer == peer]:
            # the receiver is lost too: held like the rest of this drain, let go at ``until``
            # (by then the receiver has found the link lost and failed the request there)
            self._holding.discard(xid)
            del self._let_go[xid]
        for xid, req, fence in moved:
            self.handles[xid] = (req, fence)
            if not fence:
                req.releasing += 1  # released, as far as its request knows, once it ends
                if req.inflight is not None:
                    req.inflight.discard(xid)
        if not posting and not any(req.peer == peer for req, _ in self.handles.values()):
            return None
        self.until[peer] = until
        self._keep_until[peer] = until if peer in self._disconnected else max(until, keep_until)
        return self.drained.setdefault(peer, anyio.Event())

    def add_posted(self, xid: XferId, req: SendRequest, now: float) -> None:
        """A chunk of an ended ``req`` was posted (``PROC``) by a tick: if its receiver is
        being drained, it drains with the rest; else it is let go (``let_go``)."""
        if req.peer not in self.until:
            self.let_go(req, [xid], now)
            return
        self.handles[xid] = (req, False)
        req.releasing += 1

    def let_go(self, req: SendRequest, xids: Iterable[XferId], now: float) -> None:
        """``req`` ended (an abort, a deadline, a failed chunk) with ``xids`` still in flight
        to a receiver whose link lives: they are checked until each ends, for the proof
        (``proofs``), at most ``DRAIN_S``; a drain of that receiver already under way keeps
        its own deadlines.  While its receiver may not know yet that it failed (it was
        told, its ``Outcome`` is awaited: ``outcome_due``), a WRITE ending now still delivers its
        notification there, so the request is released (its source pages free) only once
        they ended, or once the receiver is known to have failed (``free``, ``start``)."""
        peer, held = req.peer, req.outcome_due is not None
        for xid in xids:
            self.handles[xid] = (req, False)
            self._let_go[xid] = None
            self._ended_with.add(xid)
            req.let_go += 1
            if held:
                self._holding.add(xid)
                req.releasing += 1
        # bounded: a receiver that keeps its link but never lets a WRITE end (its loop
        # stuck, its progress thread off) must not pile handles up; the oldest go first
        while len(self._let_go) > MAX_LET_GO:
            oldest = next(iter(self._let_go))
            self._release(oldest)
            self.ended(oldest, proven=False)
        if peer is None or peer in self.until:
            return
        self.until[peer] = now
        self._keep_until[peer] = now + DRAIN_S

    def free(self, req: SendRequest) -> None:
        """``req``'s receiver is known to have failed it (its ``Outcome``, its link lost): no
        late notification can complete it there any more, so the handles it let go no longer
        hold it (they are still checked, for the proof)."""
        held = [x for x in self._holding if self.handles[x][0] is req]
        if held:
            self._holding.difference_update(held)
            req.releasing -= len(held)
            self._settle_if_released(req)

    def give_up(self, peer: str) -> None:
        """``peer`` is unloaded now, with no drain of it to wait for (its process is gone, or
        this service is leaving): its handles still checked are released, unproven."""
        for xid in [x for x, (req, _) in self.handles.items() if req.peer == peer]:
            self._release(xid)
            self.ended(xid, proven=False)

    def event(self, peer: str) -> anyio.Event | None:
        """Set once nothing of ``peer`` drains any more; None if nothing does now."""
        return self.drained.get(peer)

    def requests(self, peer: str) -> set[str]:
        """The requests with a handle to ``peer`` still draining: none of them is proven yet."""
        return {req.request_id for req, _ in self.handles.values() if req.peer == peer}

    def lost_handled(self, peer: str) -> None:
        """``peer``'s loss is handled (``start`` has read whether it was disconnected)."""
        self._disconnected.discard(peer)

    def note_disconnect(self, req: SendRequest, err: DoorError) -> None:
        if err.reason is FailureReason.REMOTE_DISCONNECT and req.peer is not None:
            self._disconnected.add(req.peer)

    def ended(self, xid: XferId, proven: bool) -> None:
        """The draining handle ``xid`` ended (``proven``: ``DONE``), or is given up."""
        req, fence = self.handles.pop(xid)
        if not proven:
            self._proofs.unproven(req.peer, req.request_id, "drain ended unfinished")
        if xid in self._ended_with:
            self._ended_with.discard(xid)
            req.let_go -= 1
            if xid in self._holding:
                self._holding.discard(xid)
                req.releasing -= 1
                self._settle_if_released(req)
            if req.let_go == 0:
                self._let_go_ended(req)
        if xid in self._let_go:
            del self._let_go[xid]
        elif not fence:
            req.releasing -= 1
            self._settle_if_released(req)
        if req.peer is not None:
            self.check(req.peer)

    def check(self, peer: str) -> None:
        """Set ``peer``'s event if nothing of it drains any more."""
        # Posts handed over and not yet digested may be to ``peer``: they drain too.
        if not self._posts_pending() and not any(r.peer == peer for r, _ in self.handles.values()):
            self.until.pop(peer, None)
            self._keep_until.pop(peer, None)
            event = self.drained.pop(peer, None)
            if event is not None:
                event.set()

    def check_all(self) -> None:
        """After a tick's posts are digested: drains, and receivers with handles let go, that
        waited only for them (a let-go receiver has deadlines and no event: without this its
        entry would stay once its last handle ended while posts were pending)."""
        for peer in list(self.until.keys() | self.drained.keys()):
            self.check(peer)

    def expire(self, now: float) -> None:
        """Let go of the requests of drains past ``until`` (their handles still checked), and
        give up on the handles of drains past ``keep_until``: released, unproven."""
        late = {peer for peer, until in self.until.items() if now >= until}
        if not late:
            return
        for xid, (req, fence) in list(self.handles.items()):
            if req.peer in late and not fence and xid not in self._let_go:
                self._let_go[xid] = None
                req.releasing -= 1
                self._settle_if_released(req)
        over = {peer for peer in late if now >= self._keep_until.get(peer, now)}
        for xid in [x for x, (req, _) in self.handles.items() if req.peer in over]:
            self._release(xid)
            self.ended(xid, proven=False)
