"""The request state machine behind ``TransferService``: its tables, its transitions
(bind, finish, fail), and the callbacks of its collaborators.

``TransferService`` (``_service``) is the public API and the service's lifetime;
this base class is what the watchdog (``Owner``) and the control plane
(``PeerEvents``) call into, and what settles failed requests (``_settle``).
Everything here runs on the event loop.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping

import anyio
import anyio.abc
import numpy as np
import numpy.typing as npt

from ._config import ServiceConfig
from ._control import ControlPlane
from ._deadlines import Deadlines
from ._door import DoorError
from ._log import get_logger
from ._protocol import FENCE, Abort, Expect, Failed, Message, Outcome, Settled, decode_notif, text
from ._requests import EarlyExpects, Recent, RecvRequest, SendRequest, make_result
from ._results import FailureReason, Overloaded, TransferResult, TransferStatus
from ._settle import Settlement
from ._stats import Stats
from ._watchdog import Watchdog

log = get_logger("kvservice")

#: longest wait between two dials that try to settle a lost sender's requests
PROBE_MAX_S = 5.0
#: settle fences posted for one request before giving up (each failed one is a NIXL error)
FENCE_TRIES = 3


class ServiceCore:
    """Request tables and transitions; see the module docstring.  ``TransferService``
    creates the state (``_init_state``) and the collaborators."""

    config: ServiceConfig
    stats: Stats
    _tg: anyio.abc.TaskGroup | None
    _watchdog: Watchdog | None
    _control: ControlPlane | None
    _closing: bool

    def _init_state(self) -> None:
        results_kept = self.config.results_kept
        self._sends: dict[str, SendRequest] = {}
        self._recvs: dict[str, RecvRequest] = {}
        # Ended requests keep only their result: one object each for the cyclic GC
        # to walk, not the request's events, queues and sets.
        self._sends_done: Recent[str, TransferResult] = Recent(results_kept)
        self._recvs_done: Recent[str, TransferResult] = Recent(results_kept)
        self._deadlines: Deadlines[SendRequest | RecvRequest] = Deadlines()
        # Expects that arrived before the matching send()
        self._early = EarlyExpects(self.config.max_unknown_expects, self.config.unknown_expect_ttl_s)
        # Expects dropped (peer lost / aborted) before any send(): a later send fails at once.
        self._dropped: Recent[str, FailureReason] = Recent(results_kept)
        self._settlement = Settlement(self._recvs_done, self._sends_done)
        # Failed sends whose receiver's Outcome is awaited (see _fail)
        self._outcomes: dict[str, SendRequest] = {}
        self._idle = anyio.Event()

    def _check_capacity(self) -> None:
        live = len(self._sends) + len(self._recvs)
        if live >= self.config.max_live_requests:
            self.stats.refuse("live_request_limit")
            raise Overloaded(f"{live} requests alive, the limit (max_live_requests) is "
                             f"{self.config.max_live_requests}")

    def _receiver_ok(self, req: SendRequest, agent: str) -> bool:
        """Whether ``agent`` may receive ``req``; if not, it is told (``REFUSED``) and it is counted."""
        if req.receiver is None:
            return True
        assert self._control is not None
        if req.receiver in self._control.addresses_of(agent):
            return True
        if (unlogged := self.stats.refuse("receiver_mismatch")) is not None:
            log.warning("transfer.expect_refused", request_id=req.request_id, agent=agent, receiver=req.receiver,
                        unlogged=unlogged)
        self._refuse_expect(agent, req.request_id, FailureReason.REFUSED, "the request is pinned to another receiver")
        return False

    # -- state changes (event loop; called by API, watchdog and control plane) ---------
    def _bind(self, req: SendRequest, peer: str, pages: npt.NDArray[np.int32]) -> None:
        if req.pages_queued > pages.size or (req.last and req.pages_queued != pages.size):
            self._fail(req, FailureReason.INCOMPATIBLE,
                       f"sender has {req.pages_queued} pages, receiver expects {pages.size}", peer=peer)
            return
        assert self._control is not None
        kv = self._control.peer_kv(peer)
        if kv is None:  # the peer is gone (its loss fails what was bound to it)
            self._fail(req, FailureReason.PEER_LOST, "receiver lost before the request was bound", peer=peer)
            return
        if kv.out is None:  # e.g. tensor-parallel ranks that hold none of each other's KV heads
            self._fail(req, FailureReason.INCOMPATIBLE, f"nothing to send to this receiver: {kv.why}", peer=peer)
            return
        req.peer = peer
        req.link_generation = self._control.generation_of(peer)
        req.kv = kv
        req.dest = pages
        req.deadline = time.monotonic() + (req.timeout or self.config.transfer_timeout_s)
        self._deadlines.push(req)  # due_at() is now the transfer deadline
        if req.pending:
            self._watchdog.schedule(req)  # type: ignore[union-attr]

    def _finish(self, req: SendRequest | RecvRequest, result: TransferResult) -> None:
        if isinstance(req, RecvRequest) and not result.ok and (req.peer is None or req.fenced):
            # no sender ever had these pages, or its fence has landed already
            result = dataclasses.replace(result, settled=True)
        req.result = result
        if isinstance(req, SendRequest):
            self._sends.pop(req.request_id, None)
            self._sends_done.put(req.request_id, result)
            if result.ok:
                req.done.set()
            # else: done once the door released every handle of it (released())
            self._watchdog.forget(req)  # type: ignore[union-attr]
        else:
            req.done.set()
            self._recvs.pop(req.request_id, None)
            self._recvs_done.put(req.request_id, result)
            if not result.settled:
                assert req.peer is not None and req.pages is not None
                self._settlement.hold(req.request_id, req.peer, int(req.pages.size))
        side = "send" if isinstance(req, SendRequest) else "recv"
        self.stats.record(side, result)
        if result.ok:
            log.debug("transfer.completed", request_id=req.request_id, side=side, bytes=result.bytes)
        else:
            assert result.reason is not None
            log.warning("transfer.failed", request_id=req.request_id, side=side,
                        peer=req.peer, reason=result.reason.value, message=result.message,
                        error=repr(result.error) if result.error else None)
        if not self._sends and not self._recvs:
            self._idle.set()

    def _fail(self, req: SendRequest | RecvRequest, reason: FailureReason, message: str, *,
              error: BaseException | None = None, from_peer: bool = False, peer: str | None = None) -> None:
        """End ``req`` as Failed and, unless the peer told us, tell the peer."""
        if req.result is not None:
            return
        message = text(message)  # it travels to the peer, whose frames bound text
        target = peer or req.peer
        if not from_peer and target is not None:  # first: a Settled the finish may send follows it
            if isinstance(req, SendRequest):
                self._send_to(target, Failed(req.request_id, reason.value, message))
                if req.chunks_posted and req.peer == target:
                    # Its last WRITE may have landed, and the receiver succeeded, before it
                    # hears this: its Outcome decides how the request ended (both sides agree).
                    req.outcome_due = time.monotonic()
                    self._outcomes[req.request_id] = req
            else:
                self._send_to(target, Abort(req.request_id, reason.value, message))
        self._finish(req, make_result(req, TransferStatus.FAILED, reason=reason, error=error,
                                      message=message))

    def _send_to(self, agent: str, msg: Message) -> None:
        if self._control is not None:
            self._control.send_to(agent, msg)

    # -- watchdog callbacks (Owner) ---------------------------------------------------
    def chunk_done(self, req: SendRequest, nbytes: int) -> None:
        req.chunks_done += 1
        req.bytes_done += nbytes
        if req.complete and req.result is None:
            self._finish(req, make_result(req, TransferStatus.SUCCESS, nbytes=req.bytes_done,
                                          pages=req.pages_queued))

    def chunk_failed(self, req: SendRequest, err: DoorError) -> None:
        peer = req.peer
        self._fail(req, err.reason, str(err), error=err.original)
        if err.reason is FailureReason.REMOTE_DISCONNECT and peer is not None and self._control is not None:
            # NIXL keeps a disconnected agent loaded and fails every later post to
            # it; drop the peer now so its other requests fail at once (PEER_LOST)
            # and a reconnect loads it afresh.
            self._control.drop_peer(peer, err.original)

    def on_notifs(self, notifs: Mapping[str, list[bytes]]) -> None:
        for agent, messages in notifs.items():
            for raw in messages:
                n = decode_notif(raw)
                if n is not None and n.chunk == FENCE:
                    if not self._settlement.settle_recv(n.request_id, agent):
                        live = self._recvs.get(n.request_id)
                        if live is not None and live.peer == agent:
                            live.fenced = True  # its Failed is still on the control link: settled then
                    continue
                req = self._recvs.get(n.request_id) if n else None
                if n is None or req is None or req.peer != agent:
                    self.stats.stale_notifs += 1
                    continue
                req.chunks_seen += 1
                if n.total:
                    req.total_chunks = n.total
                    if n.payload is not None and len(n.payload) > self.config.max_payload_bytes:
                        self.stats.refuse("payload_limit")
                        self._fail(req, FailureReason.INCOMPATIBLE, (
                            f"payload of {len(n.payload)} bytes exceeds max_payload_bytes "
                            f"({self.config.max_payload_bytes})"))
                        continue
                    req.payload = n.payload
                if req.total_chunks is not None and req.chunks_seen >= req.total_chunks:
                    self._arrived(req, agent)

    def _arrived(self, req: RecvRequest, agent: str) -> None:
        assert req.pages is not None and self._control is not None
        kv = self._control.peer_kv(agent)
        npages = int(req.pages.size)
        self._finish(req, make_result(
            req, TransferStatus.SUCCESS, nbytes=npages * (kv.inbound_page_bytes if kv else 0), pages=npages,
            payload=req.payload))

    def check_deadlines(self, now: float) -> None:
        for req in self._deadlines.pop_due(now):
            if isinstance(req, RecvRequest):
                why = "arrival deadline passed"
            elif req.peer is None:
                why = f"no expect from a receiver within {self.config.bootstrap_timeout_s}s"
            else:
                why = "transfer deadline passed"
            self._fail(req, FailureReason.TIMEOUT, why)
        for rid, agent in self._early.expire(now):
            self.stats.refuse("unknown_expect_expired")
            self._refuse_expect(agent, rid, FailureReason.TIMEOUT,
                                f"no send() for this request within {self.config.unknown_expect_ttl_s}s")
        if self._outcomes:
            self._outcomes_lost(None, now)
        live = len(self._sends) + len(self._recvs)
        self._deadlines.compact(itertools.chain(self._sends.values(), self._recvs.values()), live)

    def busy(self) -> bool:
        # Receivers keep the watchdog polling: with NIXL's progress thread off, a
        # sender's WRITE completes only while this side calls into NIXL.
        return bool(self._recvs) or bool(self._sends)

    # -- control-plane callbacks ------------------------------------------------------
    def on_message(self, agent: str, msg: Message) -> None:
        if isinstance(msg, Expect):
            self._on_expect(agent, msg)
        elif isinstance(msg, Abort):
            self._on_peer_abort(agent, msg.request_id, msg.reason, msg.message)
        elif isinstance(msg, Failed):
            rreq = self._recvs.get(msg.request_id)
            if rreq is not None and rreq.peer == agent:
                self._fail(rreq, _reason(msg.reason), f"sender reported: {msg.message}", from_peer=True)
            done = self._recvs_done.get(msg.request_id)
            self._send_to(agent, Outcome(msg.request_id, ok=done is not None and done.ok))
        elif isinstance(msg, Outcome):
            self._on_outcome(agent, msg)
        elif isinstance(msg, Settled):
            self._settlement.settle_recv(msg.request_id, agent, sender_ok=msg.ok)

    def _refuse_expect(self, agent: str, rid: str, reason: FailureReason, message: str) -> None:
        """Tell ``agent`` its Expect for ``rid`` is refused; nothing of ours was or will be
        written there for it, so it is settled too (unless ``rid`` is bound to that agent)."""
        self._send_to(agent, Failed(rid, reason.value, text(message)))
        bound = self._sends.get(rid)
        if bound is None or bound.peer != agent:
            self._send_to(agent, Settled(rid))

    def _on_expect(self, agent: str, msg: Expect) -> None:
        assert self._control is not None
        rid = msg.request_id
        kv = self._control.peer_kv(agent)
        if kv is None:
            return  # its link is being dropped
        try:
            pages = kv.memory.check_pages(msg.pages)
        except ValueError as exc:
            self._refuse_expect(agent, rid, FailureReason.INCOMPATIBLE, str(exc))
            return
        req = self._sends.get(rid)
        if req is not None:
            if req.peer is None:
                if self._receiver_ok(req, agent):
                    self._bind(req, agent, pages)
            else:
                self._refuse_expect(agent, rid, FailureReason.INCOMPATIBLE, "request already bound to a receiver")
        elif rid in self._sends_done:
            done = self._sends_done.get(rid)
            assert done is not None
            self._refuse_expect(agent, rid, done.reason or FailureReason.INCOMPATIBLE,
                                "request already ended on the sender")
        elif rid in self._early:
            self._refuse_expect(agent, rid, FailureReason.INCOMPATIBLE, "duplicate expect")
        elif not self._early.add(rid, agent, pages, time.monotonic()):
            self.stats.refuse("unknown_expect_limit")
            self._refuse_expect(agent, rid, FailureReason.REFUSED, (
                f"too many expects for requests not sent yet (max_unknown_expects = "
                f"{self.config.max_unknown_expects})"))

    def _on_peer_abort(self, agent: str, rid: str, reason: str, message: str) -> None:
        why = _reason(reason)  # the peer's own reason: ABORTED, SHUTDOWN, TIMEOUT, ...
        sreq = self._sends.get(rid)
        if sreq is not None and (sreq.peer == agent or (sreq.peer is None and self._receiver_ok(sreq, agent))):
            # Its release, then a Settled to the receiver, follow (released()).
            self._fail(sreq, why, f"receiver aborted ({reason}): {message}", from_peer=True)
        elif sreq is None:
            # Not live here: ended already (settled once released), or not sent yet (a
            # later send() fails at once).  Either way nothing of it is or will be in flight.
            done = self._sends_done.get(rid)
            if done is None:
                if self._early.peer_of(rid) in (agent, None):
                    self._early.pop(rid)
                    self._dropped.put(rid, why)
                self._send_to(agent, Settled(rid))
            elif done.ok:  # completed: every WRITE landed (a failure settles by its fence, or
                self._send_to(agent, Settled(rid, ok=True))  # said Settled if nothing was posted)
        rreq = self._recvs.get(rid)
        if rreq is not None and rreq.peer == agent:
            self._fail(rreq, why, f"sender aborted ({reason}): {message}", from_peer=True)

    def on_peer_lost(self, agent: str, address: str, cause: BaseException | None, graceful: bool,
                     gone: bool) -> None:
        reason = FailureReason.SHUTDOWN if graceful else FailureReason.PEER_LOST
        what = "peer shut down" if graceful else f"lost peer {address}: {cause!r}"
        for sreq in [r for r in self._sends.values() if r.peer == agent]:
            self._fail(sreq, reason, what, error=cause, from_peer=True)
        for rreq in [r for r in self._recvs.values() if r.peer == agent]:
            self._fail(rreq, reason, what, error=cause, from_peer=True)
        for rid in self._early.drop_peer(agent):
            self._dropped.put(rid, reason)
        self._outcomes_lost(agent, time.monotonic())
        if self._watchdog is not None:
            self._watchdog.forget_fences(agent)  # its unloading releases them
        if gone:  # its process is gone (ours leaving settles all once our agent is gone: __aexit__)
            if self._settlement.settle_agent(agent):
                log.info("transfer.settled_by_loss", peer=address, agent=agent,
                         why="NIXL reports its endpoint disconnected")
        elif self._settlement.held_by(agent) and self._tg is not None and not self._closing:
            self._tg.start_soon(self._settle_by_probing, agent, address)

    def on_peer_linked(self, agent: str) -> None:
        """A new link with ``agent`` settles nothing it held: its peer table dropped the
        old link (releasing every handle to us) before admitting this one, but NIXL's
        release does not stop a zero-copy WRITE already under way (measured: a resumed
        SIGSTOPped sender's released WRITE still landed after it re-linked).  What it
        held settles when its process is gone."""

    async def _settle_by_probing(self, agent: str, address: str) -> None:
        """``agent``'s link was lost but not proven gone (hung, or cut off): dial its
        address until that settles what it held (see ``_settle``).  Ends when nothing
        of ``agent`` is held any more, or with the service."""
        assert self._control is not None
        wait = self.config.heartbeat_interval_s
        while self._settlement.held_by(agent) and not self._closing:
            await anyio.sleep(wait)
            wait = min(wait * 2, PROBE_MAX_S)
            try:
                link = await self._control.link_to(address)
            except ConnectionRefusedError:  # nobody listens there any more: the process is gone
                log.info("transfer.settled_by_loss", peer=address, agent=agent, why="its address refuses connections")
                self._settlement.settle_agent(agent)
            except Exception as exc:  # noqa: BLE001 - still unknown (hung, cut off): try again later
                log.debug("peer.settle_probe_failed", agent=agent, address=address, error=repr(exc))
            else:
                if link.agent != agent:  # a new incarnation holds the address: the old one is gone
                    log.info("transfer.settled_by_loss", peer=address, agent=agent, why="a new incarnation holds it")
                    self._settlement.settle_agent(agent)
                    return
                # The same process, alive: keep probing for its exit.

    def released(self, req: SendRequest) -> None:
        """Watchdog: the door released every handle of ``req``.  A failure is settled
        now: its caller may reuse the source pages, and the receiver is told."""
        result = req.result
        if result is None or result.settled:
            return
        # A failure, or one the receiver's Outcome has already turned into SUCCESS.
        req.result = self._settlement.settled_send(result)
        self._maybe_done(req)
        if req.peer is None or req.result.ok:  # the receiver has every page: nothing to fence
            return
        # A released handle's bytes may still be on the wire (a TCP stream, a queue
        # pair): the receiver settles on the fence's notification, which NIXL sends only
        # after flushing the endpoint.  Nothing ever posted: nothing to wait for.
        assert self._watchdog is not None and self._control is not None
        if not req.posted:
            self._send_to(req.peer, Settled(req.request_id))
        else:
            self._fence(req)

    def _fence(self, req: SendRequest) -> None:
        """Post ``req``'s settle fence, on the link it was bound on only: a fence on a
        newer link (endpoint) proves nothing about the old one, whose receiver settles
        when this process is gone."""
        assert self._watchdog is not None and self._control is not None and req.peer is not None
        if self._control.generation_of(req.peer) == req.link_generation and req.fences < FENCE_TRIES:
            req.fences += 1
            self._watchdog.fence(req)

    def fence_failed(self, req: SendRequest, err: DoorError | None) -> None:
        """Watchdog: a fence did not land.  Post another on the same link (a transient
        NIXL error); once the link is gone or after ``FENCE_TRIES``, the receiver settles
        by this process's end."""
        log.warning("transfer.fence_failed", request_id=req.request_id, peer=req.peer, tries=req.fences,
                    error=repr(err.original) if err is not None else "handle released")
        if req.peer is not None:
            self._fence(req)

    def released_by_door(self, xids: list[int]) -> None:
        self.stats.forced_releases += len(xids)

    # -- a sender's failure against the receiver's outcome ---------------------------------
    def _maybe_done(self, req: SendRequest) -> None:
        """A failed send is done (its waiters wake) once settled and, if it told the
        receiver, once the receiver's Outcome (or its loss, or a timeout) has come."""
        if req.result is not None and req.result.settled and req.outcome_due is None:
            req.done.set()

    def _on_outcome(self, agent: str, msg: Outcome) -> None:
        req = self._outcomes.get(msg.request_id)
        if req is None or req.peer != agent:
            return
        del self._outcomes[msg.request_id]
        req.outcome_due = None
        if msg.ok and req.result is not None and not req.result.ok:
            was = req.result.reason.value if req.result.reason else "the failure"
            log.info("transfer.outcome_success", request_id=req.request_id, peer=agent, was=was)
            req.result = dataclasses.replace(
                req.result, status=TransferStatus.SUCCESS, reason=None, error=None,
                message=f"the receiver had every page before {was} took effect",
                bytes=req.pages_queued * (req.kv.out.page_bytes if req.kv and req.kv.out else 0),
                pages=req.pages_queued)
            self._sends_done.put(req.request_id, req.result)
        self._maybe_done(req)

    def _outcomes_lost(self, agent: str | None, now: float) -> None:
        """No Outcome will come: from ``agent`` (its link is gone), or any older than
        ``heartbeat_interval_s`` (when ``agent`` is None): a live receiver answers in one
        round trip, and a hung one must not hold the sender's result until its link is
        declared lost.  Their failures stand."""
        bound = self.config.heartbeat_interval_s
        for rid, req in list(self._outcomes.items()):
            due = req.outcome_due
            if (agent is not None and req.peer == agent) or (agent is None and due is not None and now - due > bound):
                del self._outcomes[rid]
                req.outcome_due = None
                self._maybe_done(req)



def _reason(value: str) -> FailureReason:
    try:
        return FailureReason(value)
    except ValueError:
        return FailureReason.PEER_REPORTED

