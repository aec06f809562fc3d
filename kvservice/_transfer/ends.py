"""``SendEnds``: how a failed send ends on the sending side.

A send that failed after posting may still have delivered every page: its receiver's
``Outcome`` (the answer to our ``Failed``) decides whether it ends ``SUCCESS`` after
all, so both sides agree.  Independently, the watchdog lets go of its handles (checked
until they end: ``drain``) and releases the request; only then is the failure
*settled* here (the caller may reuse the source pages) and
is the receiver told it may settle too: ``Settled`` when nothing was ever posted,
else a settle fence on the link the request was bound on.  A failed send is *done*
(its waiters wake) once settled and once its Outcome came, was lost with the link,
or is older than ``heartbeat_interval_s``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from .._config import ServiceConfig
from .._control.plane import ControlPlane
from .._control.protocol import Message, Settled
from .._log import get_logger
from .._nixl.door import DoorError
from .._results import TransferStatus
from .history import Results
from .requests import SendRequest
from .settle import Settlement
from .watchdog import Watchdog

log = get_logger("kvservice")

#: settle fences posted for one request before giving up (each failed one is a NIXL error)
FENCE_TRIES = 3


class SendEnds:
    """Failed sends between their failure and their end; see the module docstring."""

    def __init__(self, config: ServiceConfig, settlement: Settlement, sends_done: Results,
                 watchdog: Watchdog, control: ControlPlane, send_to: Callable[[str, Message], None]) -> None:
        self._heartbeat = config.heartbeat_interval_s
        self._settlement = settlement
        self._sends_done = sends_done
        self._watchdog = watchdog
        self._control = control
        self._send_to = send_to
        #: failed sends whose receiver's Outcome is awaited
        self.outcomes: dict[str, SendRequest] = {}
        #: failed sends not settled yet (their handles are being released): a send() of
        #: the same id meanwhile returns the request itself, done once it has settled
        self.unsettled: dict[str, SendRequest] = {}

    def await_outcome(self, req: SendRequest) -> None:
        """``req`` told its receiver it failed after posting: its Outcome is awaited."""
        req.outcome_due = time.monotonic()
        self.outcomes[req.request_id] = req

    def released(self, req: SendRequest) -> None:
        """Nothing of ``req`` holds it any more.  A failure is settled now: its caller
        may reuse the source pages, and the receiver is told (``_tell_settled``)."""
        result = req.result
        if self.unsettled.get(req.request_id) is req:
            del self.unsettled[req.request_id]
        if result is None or result.settled:
            return
        # A failure, or one the receiver's Outcome has already turned into SUCCESS.
        req.result = self._settlement.settled_send(result)
        self._maybe_done(req)
        if req.outcome_due is None:
            self._tell_settled(req)
        # else: the receiver's Outcome comes first (on_outcome, outcomes_lost).  If it
        # had every page, its request succeeded and may already be reused there: no
        # fence may land in it.

    def fence_failed(self, req: SendRequest, err: DoorError | None) -> None:
        """A fence did not land.  Post another on the same link (a transient NIXL
        error); once the link is gone or after ``FENCE_TRIES``, the receiver settles
        by this process's end."""
        log.warning("transfer.fence_failed", request_id=req.request_id, peer=req.peer, tries=req.fences,
                    error=repr(err.original) if err is not None else "handle released")
        if req.peer is not None:
            self._fence(req)

    def on_outcome(self, agent: str, rid: str, ok: bool) -> None:
        """The receiver of a send that failed here says whether it had every page."""
        req = self.outcomes.get(rid)
        if req is None or req.peer != agent:
            return
        del self.outcomes[rid]
        req.outcome_due = None
        if ok and req.result is not None and not req.result.ok:
            was = req.result.reason.value if req.result.reason else "the failure"
            log.info("transfer.outcome_success", request_id=rid, peer=agent, was=was)
            req.result = dataclasses.replace(
                req.result, status=TransferStatus.SUCCESS, reason=None, error=None,
                message=f"the receiver had every page before {was} took effect",
                bytes=req.pages_queued * (req.kv.out.page_bytes if req.kv and req.kv.out else 0),
                pages=req.pages_queued)
            self._sends_done.put(rid, req.result)
        released = req.result is not None and req.result.settled
        # it failed there, or had every page: no late WRITE of it changes that.  This may
        # release it now (``released`` tells the receiver then)
        self._watchdog.receiver_failed(req)
        self._maybe_done(req)
        if released:  # released already: now tell it
            self._tell_settled(req)

    def outcomes_lost(self, agent: str | None, now: float) -> None:
        """No Outcome will come: from ``agent`` (its link is gone), or any older than
        ``heartbeat_interval_s`` (when ``agent`` is None): a live receiver answers in one
        round trip, and a hung one must not hold the sender's result until its link is
        declared lost.  Their failures stand."""
        if not self.outcomes:
            return
        for rid, req in list(self.outcomes.items()):
            due = req.outcome_due
            if (agent is not None and req.peer == agent) or \
                    (agent is None and due is not None and now - due > self._heartbeat):
                del self.outcomes[rid]
                req.outcome_due = None
                self._maybe_done(req)
                if req.result is not None and req.result.settled:  # released already: now tell it
                    self._tell_settled(req)

    def _maybe_done(self, req: SendRequest) -> None:
        """A failed send is done (its waiters wake) once settled and, if it told the
        receiver, once the receiver's Outcome (or its loss, or a timeout) has come."""
        if req.result is not None and req.result.settled and req.outcome_due is None:
            req.done.set()

    def let_go_ended(self, req: SendRequest) -> None:
        """The WRITEs ``req`` ended with in flight (``drain.Drains.let_go``) have all ended:
        its receiver may be told now, if it waited for that."""
        if req.tell_after_let_go:
            req.tell_after_let_go = False
            self._tell_settled(req)

    def _tell_settled(self, req: SendRequest) -> None:
        """A settled failure: let its receiver settle.  Nothing ever posted: nothing to wait
        for.  WRITEs still in flight (let go when it failed) may yet land, and deliver their
        notifications, so the receiver may still succeed: told once they ended.  Then, if
        every WRITE of it ended ``DONE`` (``proofs``) and none still drains with a lost link
        (let go at that drain's ``until``), nothing of it can land any more: ``Settled``, and no page is
        written (a fence landing in a request the receiver completed would overwrite pages
        it may reuse already).  Else a released handle's bytes may still be on the wire (a
        TCP stream, a queue pair): the receiver settles on the fence's notification, which
        NIXL sends only after flushing the endpoint (and a released WRITE sends no
        notification, so that receiver cannot have completed the request)."""
        if req.peer is None or req.result is None or req.result.ok:  # it has every page: nothing to fence
            return
        if req.let_go:
            req.tell_after_let_go = True
            return
        if not req.posted or (self._watchdog.proofs.may_prove(req.peer, req.request_id)
                              and req.request_id not in self._watchdog.draining_requests(req.peer)):
            self._send_to(req.peer, Settled(req.request_id))
        else:
            self._fence(req)

    def _fence(self, req: SendRequest) -> None:
        """Post ``req``'s settle fence, on the link it was bound on only: a fence on a
        newer link (endpoint) proves nothing about the old one, whose receiver settles
        when this process is gone."""
        assert req.peer is not None
        if self._control.generation_of(req.peer) == req.link_generation and req.fences < FENCE_TRIES:
            req.fences += 1
            self._watchdog.fence(req)
