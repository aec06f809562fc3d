"""``RequestPlane``: the request tables, the entry points the service hands work to, the
transitions (bind, finish, fail), and what the watchdog calls back.

What peers say (the control plane's callbacks) is turned into these transitions by
``inbound.Inbound``; how a send meets the Expects that came before it, by
``matching.Matching``.  The plane builds them (the first from the factory it is given),
the watchdog and the control plane, so none of them is ever missing once the plane exists.
Everything here runs on the event loop.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import anyio
import anyio.abc
import numpy as np
import numpy.typing as npt

from .._config import ServiceConfig
from .._control.peers import LocalPeer, PeerEvents
from .._control.plane import ControlPlane
from .._control.protocol import MAX_POSTED, POSTED_VERSION, Abort, Expect, Failed, Message, Posted, Settled, text
from .._control.transport import Transport
from .._log import get_logger
from .._nixl.door import Door, DoorError, DoorThread
from .._results import FailureReason, Overloaded, TransferResult, TransferStatus, UnknownRequestError
from .._stats import Stats
from .._trust.vetting import MetadataVetter
from ..memory._layout import PageIndex
from . import landing
from .cadence import EXPECT_GRACE_S, LIGHT_MAX_BYTES, LIGHT_RECVS, SETTLE_POLL_S, WARM_GRACE_S
from .deadlines import Deadlines
from .early import EarlyExpects
from .ends import SendEnds
from .history import Results
from .matching import LOCAL, Dropped, Matching
from .requests import Chunk, Recent, RecvRequest, SendRequest, fit_tail, make_result, place
from .settle import Settlement
from .staging import NO_CELL, Stager
from .watchdog import Watchdog

log = get_logger("kvservice")


def peer_lost_message(address: str, cause: BaseException | None) -> str:
    """What a request failed by its peer's loss says (``PEER_LOST``)."""
    return f"lost peer {address}: {cause!r}"


class RequestPlane:
    """The requests of one running service, on both sides; see the module docstring
    and the package's glossary (``kvservice._transfer``)."""

    def __init__(self, config: ServiceConfig, stats: Stats, tg: anyio.abc.TaskGroup, thread: DoorThread,
                 door: Door, local: LocalPeer, stager: Stager, events: Callable[[RequestPlane], PeerEvents], *,
                 transport: Transport | None = None, vetter: MetadataVetter | None = None) -> None:
        """``events`` makes what turns peers' words into this plane's transitions
        (``inbound.Inbound``), given the plane: the control plane is built with it."""
        cfg = self.config = config
        self.stats = stats
        self.tg = tg
        self.thread = thread
        self.stager = stager
        self.memory = local.memory
        self.closing = False
        results_kept = cfg.results_kept
        self.sends: dict[str, SendRequest] = {}
        self.recvs: dict[str, RecvRequest] = {}
        #: how many of ``recvs`` are cold: held without polling NIXL (``_hold_cold``, ``warm``)
        self.cold = 0
        #: until when cold ones are polled all the same: ``WARM_GRACE_S`` after a polled one ended,
        #: ``EXPECT_GRACE_S`` after a cold one's Expect went out
        self._grace_until = 0.0
        #: until when held pages keep NIXL polled: ``SETTLE_POLL_S`` after a request failed holding them
        self._settle_poll_until = 0.0
        # Ended requests keep only their result, as a tuple of plain values: nothing of
        # them for the cyclic GC to walk (``history``).
        self.sends_done = Results(results_kept)
        self.recvs_done = Results(results_kept)
        self.deadlines: Deadlines[SendRequest | RecvRequest] = Deadlines()
        # Expects that arrived before the matching send()
        self.early = EarlyExpects.configured(cfg)
        # Expects dropped (peer lost / aborted) before any send(), per peer, with the
        # addresses it was proven at: a later send that peer may receive fails at once.
        self.dropped: Dropped = Recent(results_kept)
        # the peer an ended request was bound to ((side, id) -> agent): only it hears of it
        self.done_peers: Recent[tuple[str, str], str] = Recent(2 * results_kept)
        self.settlement = Settlement(self.recvs_done, self.sends_done)
        self.settlement.on_settled = stager.received
        # (agent, id) of Expects waiting for the proof of the agent's address
        self.proving: set[tuple[str, str]] = set()
        # the rules by which sends meet the Expects above (and the dropped ones)
        self.matching = Matching(self)
        self._idle = anyio.Event()
        self.watchdog = Watchdog(
            thread, door, local.memory, self,
            poll_interval=cfg.poll_interval_s, idle_interval=cfg.idle_poll_interval_s,
            max_posts=cfg.max_posts_per_tick, max_checks=cfg.max_checks_per_tick,
            max_post_bytes=cfg.max_post_bytes_per_tick, stager=stager,
        )
        self.inbound = events(self)
        self.control = ControlPlane(cfg, thread, door, self.inbound, local, stats, tg, transport, vetter)
        # how a failed send ends: its release, the receiver's Outcome, its settle fence
        # (its messages go through send_to, looked up at each call)
        self.ends = SendEnds(cfg, self.settlement, self.sends_done, self.watchdog, self.control,
                             lambda agent, msg: self.send_to(agent, msg))

    # -- entry points (TransferService has checked the arguments) -------------------------
    def send(self, request_id: str, src: PageIndex, lo: int, hi: int, *, last: bool, timeout: float | None,
             pinned: str | None, unknown: BaseException | None, payload: bytes | None,
             fit_tail: bool = False, member: str | None = None) -> SendRequest:
        """Queue pages ``src`` of layers ``lo:hi`` of ``request_id`` (the first chunk makes
        the request): the request itself, or the ended stand-in of a sticky failure.
        ``ValueError`` for a chunk the request's state refuses (nothing changes then).
        ``fit_tail``: the request's only chunk; its receiver may take its last pages
        (see ``bind``).  ``member``: the discovery member ``pinned`` was resolved from."""
        req = self.sends.get(request_id)
        if fit_tail and (req is not None or not last or lo != 0 or hi != self.memory.layers):
            raise ValueError(f"request {request_id!r}: fit= goes with a request's only chunk "
                             "(its first, whole pages, last=True)")
        if req is None:
            done = self.sends_done.get(request_id)
            if done is not None:
                if done.ok:
                    raise ValueError(f"request {request_id!r} already completed; send after last")
                # sticky failure, not posted; until it has settled, the request itself
                unsettled = self.ends.unsettled.get(request_id)
                return unsettled if unsettled is not None else SendRequest.ended(done)
        elif req.last:
            raise ValueError(f"request {request_id!r}: send after last=True")
        try:
            pos, cursors, queued = place(req.pages_queued if req else 0, req.cursors if req else None,
                                         int(src.size), lo, hi, self.memory.layers)
        except ValueError as exc:
            raise ValueError(f"request {request_id!r}: {exc}") from None
        if last and cursors is not None:
            raise ValueError(f"request {request_id!r}: the last chunk leaves layers at different pages "
                             f"({cursors}); every layer must reach the same page count")
        # a fitted send meets its receiver's pages in bind(), with its chunk queued
        dest = None if fit_tail else req.dest if req else self.matching.early_dest(request_id, pinned)
        if dest is not None:
            if queued > dest.size:
                raise ValueError(f"request {request_id!r}: {queued} pages sent, receiver expects {dest.size}")
            if last and queued != dest.size:
                raise ValueError(
                    f"request {request_id!r}: last chunk ends at {queued} pages, receiver expects {dest.size}")
        if req is None:
            req = self._new_send(request_id, timeout, pinned, unknown, match=not fit_tail, member=member)
            if req.result is not None:
                return req
        chunk: Chunk = (src, pos, lo, hi)
        req.pending = (chunk,) if req.pending is None else (*req.pending, chunk)
        req.pages_queued = queued
        req.cursors = cursors
        req.last = last
        req.payload = payload
        req.fit_tail = fit_tail
        if timeout is not None:
            req.timeout = timeout
            if req.peer is not None:  # bound: from now; else the bind starts it
                req.deadline = time.monotonic() + timeout
                self._file(req)
        if fit_tail:
            self.matching.match_early(req)  # bound now (its chunk fitted, and scheduled) if its Expect came first
            return req
        if req.peer is not None:
            self.watchdog.schedule(req)
        return req

    def sent_before(self, request_id: str) -> bool:
        """Whether a send of ``request_id`` is live or has ended here."""
        return request_id in self.sends or request_id in self.sends_done

    def _new_send(self, request_id: str, timeout: float | None, receiver: str | None,
                  unknown: BaseException | None, *, match: bool = True, member: str | None = None) -> SendRequest:
        self._check_capacity()
        now = time.monotonic()
        cfg = self.config
        req = SendRequest(
            request_id=request_id, created=now,
            deadline=now + (timeout or cfg.transfer_timeout_s) + cfg.bootstrap_timeout_s,
            bootstrap_deadline=now + cfg.bootstrap_timeout_s, receiver=receiver, member=member,
        )
        self.sends[request_id] = req
        self._file(req)
        if unknown is not None:  # failed at once, bound to nobody; sticky like any failure
            self.fail(req, FailureReason.PEER_LOST, str(unknown), error=unknown)
        elif match:
            self.matching.match_early(req)
        return req

    async def expect(self, request_id: str, sender: str, pages: PageIndex, timeout: float | None,
                     unknown: BaseException | None, verify: bool = False) -> None:
        """Register the receiving side of ``request_id`` and queue its Expect on the link
        to ``sender`` (dialled first if needed); a failure ends it.  ``verify``: check its landing."""
        self._check_capacity()
        now = time.monotonic()
        req = RecvRequest(request_id=request_id, created=now, deadline=now + (timeout or self.config.arrival_timeout_s),
                          sender=sender, pages=pages, verify=verify)
        self.recvs[request_id] = req
        self._file(req)
        if unknown is not None:
            self.fail(req, FailureReason.PEER_LOST, str(unknown), error=unknown)
            return
        try:
            link = await self.control.link_to(sender)
        except anyio.get_cancelled_exc_class():
            self.fail(req, FailureReason.ABORTED, "expect() was cancelled", error=None)
            raise
        except Exception as exc:  # noqa: BLE001 - classified in ControlPlane.dial_failure
            reason = self.control.dial_failure(exc)
            original = exc.original if isinstance(exc, DoorError) else exc  # NIXL's own exception
            self.fail(req, reason, f"cannot reach sender {sender}: {exc}", error=original)
            return
        if self.closing:
            self.fail(req, FailureReason.SHUTDOWN, "service shut down before the expect was sent", error=None)
            return
        if req.result is not None:  # aborted (or timed out) while dialling: the sender fails it at once
            assert req.result.reason is not None
            link.send(Abort(request_id, req.result.reason.value, req.result.message))
            return
        req.peer = link.agent
        req.started_at = time.monotonic()
        cold = self.control.speaks(link.agent, POSTED_VERSION)
        if cold:
            self._hold_cold(req)  # before its Expect: no WRITE of it can start earlier
        cell = self.stager.take(request_id, self.control.peer_kv(link.agent), pages) if self.stager else NO_CELL
        link.send(Expect(request_id, pages.tolist(), cell, verify))
        # From now on the sender's WRITEs need this side to poll NIXL (a cold request's for
        # a while: its sender may be waiting for it): wake the watchdog out of its idle wait,
        # after the Expect, so that the link's writer runs first.
        if cold:
            self._poll_for(EXPECT_GRACE_S)
        else:
            self.watchdog.wake()

    def _hold_cold(self, req: RecvRequest) -> None:
        """``req``'s sender says ``Posted`` when it posts its first WRITE: until then (or
        another sign of its WRITEs, ``warm``) nothing of it needs NIXL polled, and the
        watchdog keeps its idle cadence for it (``busy``)."""
        if not req.cold:
            req.cold = True
            self.cold += 1

    def _poll_for(self, seconds: float) -> None:
        """Poll NIXL for cold Expects too, for ``seconds`` from now (``busy``)."""
        self._grace_until = max(self._grace_until, time.monotonic() + seconds)
        if not self.watchdog.lingering:
            self.watchdog.wake()

    def warm(self, req: RecvRequest) -> None:
        """A sign that ``req``'s WRITEs are under way (its sender's ``Posted``, one of its
        notifications): poll NIXL for it from now on, every ``poll_interval_s``, until it
        ends.  Idempotent: a repeated sign costs no wake-up, and so does one while a
        tick lingers (polls) already: ending it early would cost a round trip through the
        loop and change nothing (the watchdog looks at ``busy`` again after it)."""
        if req.cold:
            req.cold = False
            self.cold -= 1
            if not self.watchdog.lingering:
                self.watchdog.wake()

    async def decline(self, request_id: str, sender: str, message: str) -> bool:
        """See ``TransferService.decline``: the receiver's ``Abort``, with no request here."""
        try:
            link = await self.control.link_to(sender)
        except Exception as exc:  # noqa: BLE001 - classified in ControlPlane.dial_failure
            log.warning("transfer.decline_failed", request_id=request_id, sender=sender,
                        reason=self.control.dial_failure(exc).value, error=repr(exc))
            return False
        why = text(f"declined: {message}" if message else "declined")
        link.send(Abort(request_id, FailureReason.ABORTED.value, why))
        return True

    def abort(self, request_id: str) -> TransferResult | None:
        """See ``TransferService.abort``."""
        sreq = self.sends.get(request_id)
        rreq = self.recvs.get(request_id)
        early = self.early.agents(request_id) if sreq is None and rreq is None else []
        if early:
            self.matching.drop_expect(request_id, LOCAL, FailureReason.ABORTED)  # a later send() fails at once
            for peer in early:
                self.early.pop(request_id, peer)
                self.send_to(peer, Abort(request_id, FailureReason.ABORTED.value, "aborted by sender"))
                self.send_to(peer, Settled(request_id))  # never bound, nothing posted: its pages are free
            return None
        if sreq is not None:
            self.fail(sreq, FailureReason.ABORTED, "aborted locally", error=None)
        if rreq is not None:
            self.fail(rreq, FailureReason.ABORTED, "aborted locally", error=None)
        if sreq is None and rreq is None:
            done = self.sends_done.get(request_id) or self.recvs_done.get(request_id)
            if done is None:
                raise UnknownRequestError(f"unknown request {request_id!r}")
            return done
        req = sreq or rreq
        assert req is not None
        return req.result

    async def drain(self, grace: float) -> None:
        """The service is closing: wait up to ``grace`` for what is in flight, fail the
        rest ``SHUTDOWN``, and let the watchdog release every handle (what that settles
        is told before the Bye).  Call shielded."""
        self.closing = True
        with anyio.move_on_after(grace):
            while self.sends or self.recvs:
                self._idle = anyio.Event()
                await self._idle.wait()
        for sreq in list(self.sends.values()):
            self.fail(sreq, FailureReason.SHUTDOWN, "service shut down before completion", error=None)
        for rreq in list(self.recvs.values()):
            self.fail(rreq, FailureReason.SHUTDOWN, "service shut down before arrival", error=None)
        await self.watchdog.stop()
        await self.watchdog.tick()

    # -- what the service asks of it -------------------------------------------------------
    def remembers(self, request_id: str) -> bool:
        """Whether anything of ``request_id`` is still here: a live request on either
        side, either side's result (among the ``results_kept`` most recent of its side),
        or an expect dropped before its send (the failure that send will get)."""
        return (request_id in self.sends or request_id in self.recvs or request_id in self.sends_done
                or request_id in self.recvs_done or request_id in self.dropped)

    def drop_agent(self, agent: str, cause: BaseException, member: str, address: str) -> None:
        """Discovery judged ``member`` (named by the engine; ``agent`` at ``address``) lost:
        the sends named to it and bound to nobody yet fail ``PEER_LOST``, and the link to
        ``agent`` is dropped as lost only if it is proven to answer at ``address``."""
        if self.closing:
            return
        for req in [r for r in self.sends.values() if r.peer is None and r.member == member]:
            self.fail(req, FailureReason.PEER_LOST, f"receiver {member} lost before the request was bound: {cause}",
                      error=cause)
        self.tg.start_soon(self._drop_if_proven, agent, address, cause)

    async def _drop_if_proven(self, agent: str, address: str, cause: BaseException) -> None:
        try:
            canon = await self.control.canonical(address)  # resolved already when it was named
        except (ValueError, OSError):  # nobody can be proven there either
            return
        if self.control.at_address(agent, canon):
            self.control.drop_peer(agent, cause)

    # -- sends meet receivers ------------------------------------------------------------
    def _check_capacity(self) -> None:
        live = len(self.sends) + len(self.recvs)
        if live >= self.config.max_live_requests:
            self.stats.refuse("live_request_limit")
            raise Overloaded(f"{live} requests alive, the limit (max_live_requests) is "
                             f"{self.config.max_live_requests}")

    # -- transitions -----------------------------------------------------------------------
    def bind(self, req: SendRequest, peer: str, pages: npt.NDArray[np.int32], verify: bool = False) -> None:
        if verify and (why := landing.refusal(self.memory)) is not None:
            self.fail(req, FailureReason.INCOMPATIBLE, f"the receiver asked for landing checks: {why}", peer=peer,
                      error=None)
            return
        if req.fit_tail and req.pages_queued > pages.size:
            fit_tail(req, int(pages.size))
        if req.pages_queued > pages.size or (req.last and req.pages_queued != pages.size):
            self.fail(req, FailureReason.INCOMPATIBLE,
                      f"sender has {req.pages_queued} pages, receiver expects {pages.size}", peer=peer, error=None)
            return
        kv = self.control.peer_kv(peer)
        if kv is None:  # its link was lost (and its loss is being handled): as the requests bound to it
            where, cause = self.control.losing(peer) or (None, None)
            req.peer_address = where  # the result names the receiver
            why = f"receiver {where or peer} lost before the request was bound"
            self.fail(req, FailureReason.PEER_LOST, why if cause is None else f"{why}: {cause!r}", peer=peer,
                      error=cause)
            return
        if kv.out is None:  # e.g. tensor-parallel ranks that hold none of each other's KV heads
            self.fail(req, FailureReason.INCOMPATIBLE, f"nothing to send to this receiver: {kv.why}", peer=peer,
                      error=None)
            return
        req.peer = peer
        req.verify = verify
        req.peer_address = self.control.address_of(peer)
        req.link_generation = self.control.generation_of(peer)
        req.notif_key = self.control.notif_key_to(peer) or b""
        req.kv = kv
        req.dest = pages
        filed = req.bootstrap_deadline  # its entry in the deadlines (due_at() until now)
        req.deadline = time.monotonic() + (req.timeout or self.config.transfer_timeout_s)
        if req.deadline < filed:  # a later deadline is filed again when the old entry pops
            self._file(req)
        if req.pending:
            self.watchdog.schedule(req)

    def finish(self, req: SendRequest | RecvRequest, result: TransferResult) -> None:
        if isinstance(req, RecvRequest) and not result.ok and (req.peer is None or req.fenced):
            # no sender ever had these pages, or its fence has landed already
            result = dataclasses.replace(result, settled=True)
        req.result = result
        self.deadlines.discard(req)  # nothing here keeps an ended request alive
        side = "send" if isinstance(req, SendRequest) else "recv"
        if req.peer is not None:
            self.done_peers.put((side, req.request_id), req.peer)
        if isinstance(req, SendRequest):
            self.sends.pop(req.request_id, None)
            self.sends_done.put(req.request_id, result)
            if result.ok:
                req.done.set()
            else:  # done once nothing of it holds it any more (released())
                self.ends.unsettled[req.request_id] = req
            self.watchdog.forget(req)
        else:
            req.done.set()
            self.recvs.pop(req.request_id, None)
            if req.cold:
                req.cold = False
                self.cold -= 1
            else:
                self._grace_until = max(self._grace_until, result.finished_at + WARM_GRACE_S)
            self.recvs_done.put(req.request_id, result)
            if not result.settled:
                assert req.peer is not None and req.pages is not None
                self.settlement.hold(req.request_id, req.peer, int(req.pages.size))
                self.settle_poll()
            else:
                self.stager.received(req.request_id)
        self.stats.record(side, result, req.peer)
        if result.ok:
            log.debug("transfer.completed", request_id=req.request_id, side=side, bytes=result.bytes)
        else:
            assert result.reason is not None
            log.warning("transfer.failed", request_id=req.request_id, side=side,
                        peer=req.peer, reason=result.reason.value, message=result.message,
                        error=repr(result.error) if result.error else None)
        if not self.sends and not self.recvs:
            self._idle.set()

    def fail(self, req: SendRequest | RecvRequest, reason: FailureReason, message: str, *,
             error: BaseException | None, from_peer: bool = False, peer: str | None = None) -> None:
        """End ``req`` as Failed and, unless the peer told us, tell the peer.  Every failure
        says why: ``message`` (never empty: the result refuses to be built without one) and
        ``error``, the original exception, which each caller names (``None`` only where
        there is none: a deadline, an abort, a bad input)."""
        if req.result is not None:
            return
        message = text(message)  # it travels to the peer, whose frames bound text
        target = peer or req.peer
        if not from_peer and target is not None:  # first: a Settled the finish may send follows it
            if isinstance(req, SendRequest):
                self.send_to(target, Failed(req.request_id, reason.value, message))
                if req.chunks_posted and req.peer == target:
                    # Its last WRITE may have landed, and the receiver succeeded, before it
                    # hears this: its Outcome decides how the request ended (both sides agree).
                    self.ends.await_outcome(req)
            else:
                self.send_to(target, Abort(req.request_id, reason.value, message))
        self.finish(req, make_result(req, TransferStatus.FAILED, reason=reason, error=error, message=message))

    def send_to(self, agent: str, msg: Message) -> None:
        self.control.send_to(agent, msg)

    # -- the watchdog's callbacks (watchdog.Owner) -------------------------------------------
    def chunk_done(self, req: SendRequest, nbytes: int) -> None:
        req.chunks_done += 1
        req.bytes_done += nbytes
        if req.complete and req.result is None:
            self.finish(req, make_result(req, TransferStatus.SUCCESS, nbytes=req.bytes_done, pages=req.pages_queued))

    def chunk_failed(self, req: SendRequest, err: DoorError) -> None:
        peer = req.peer
        self.fail(req, err.reason, str(err), error=err.original)
        if err.reason is FailureReason.REMOTE_DISCONNECT and peer is not None:
            # NIXL keeps a disconnected agent loaded and fails every later post to it: the
            # peer is dropped (a reconnect loads it afresh) and its other requests fail at
            # once as its loss fails them, but here, each telling the peer why while the
            # link still takes frames (NIXL may report their own errors a poll later); the
            # link then sends what is queued before it closes (``tell``).
            why = peer_lost_message(self.control.address_of(peer) or peer, err.original)
            for other in [r for r in self.sends.values() if r.peer == peer]:
                self.fail(other, FailureReason.PEER_LOST, why, error=err.original)
            self.control.drop_peer(peer, err.original, tell=True)

    def on_notifs(self, notifs: Mapping[str, list[bytes]]) -> None:
        self.inbound.on_notifs(notifs)

    def check_deadlines(self, now: float) -> None:
        for req in self.deadlines.pop_due(now):
            if isinstance(req, RecvRequest):
                why = "arrival deadline passed"
            elif req.peer is None:
                why = f"no expect from a receiver within {self.config.bootstrap_timeout_s}s"
            else:
                why = "transfer deadline passed"
            self.fail(req, FailureReason.TIMEOUT, why, error=None)
        for rid, agent in self.early.expire(now):
            self.stats.refuse("unknown_expect_expired")
            self.matching.refuse_expect(agent, rid, FailureReason.TIMEOUT,
                               f"no send() for this request within {self.config.unknown_expect_ttl_s}s")
        self.ends.outcomes_lost(None, now)

    def busy(self) -> bool:
        # Receivers keep the watchdog polling: with NIXL's progress thread off, a
        # sender's WRITE completes only while this side calls into NIXL.  A cold one
        # does not (its sender has posted nothing yet): the idle ticks still look.  Right
        # after a polled one ended, they are polled on for a while (``WARM_GRACE_S``), and
        # after one failed holding pages, those are (``SETTLE_POLL_S``).  Sends do not: the
        # watchdog polls for their WRITEs while any is to post or in flight, and one waiting
        # for its Expect (or for more chunks) needs nothing of NIXL until then; what it waits
        # for wakes the watchdog (``schedule``), and its deadline ends the idle wait
        # (``next_due``).
        if len(self.recvs) > self.cold:
            return True
        now = time.monotonic()
        return (self.cold > 0 and now < self._grace_until) or \
            (self.settlement.unsettled_pages > 0 and now < self._settle_poll_until)

    def quiet(self) -> bool:
        """Whether no notification can matter to this side: no request under way, expected
        or waiting for its Expect, and no pages held unsettled (a settle fence, a failed
        request's late WRITE).  A notification that still comes is stale (counted at the
        next idle tick): the watchdog's idle waits start at ``idle_poll_interval_s`` then,
        not ``IDLE_FIRST_S`` (a tick, and the thread hops of it, per hand-off one at a time)."""
        return not self.sends and not self.recvs and self.settlement.unsettled_pages == 0

    def light(self) -> bool:
        """Whether this side holds a receiving request, at most ``LIGHT_RECVS``, each of at
        most ``LIGHT_MAX_BYTES``: the watchdog's lingering ticks then poll at ``LIGHT_POLL_S``
        (``transfer.cadence``)."""
        recvs = self.recvs
        if not 0 < len(recvs) <= LIGHT_RECVS:
            return False
        most = LIGHT_MAX_BYTES // self.memory.page_bytes
        return all(req.pages is None or req.pages.size <= most for req in recvs.values())

    def lone(self) -> bool:
        """Whether this side sends one request at most: the watchdog may follow its WRITEs
        (``cadence.FOLLOW_S``)."""
        return len(self.sends) <= 1

    def _file(self, req: SendRequest | RecvRequest) -> None:
        """File ``req`` at its deadline; an idle wait of the watchdog ending later ends then."""
        self.deadlines.push(req)
        self.watchdog.due(req.due_at())

    def next_due(self) -> float | None:
        """When the earliest live request's deadline passes (``time.monotonic()``), if any:
        the watchdog's idle wait ends by then, so that a request waiting without anything in
        flight (a send for its Expect, a cold Expect) fails on time."""
        return self.deadlines.next_due()

    def moving(self) -> bool:
        """Whether a transfer is under way here: WRITEs to post or in flight, or arrivals
        polled for (``busy``).  The loop-lag monitor samples finely only then."""
        return self.watchdog.working or self.busy()

    def settle_poll(self) -> None:
        """Held pages may be settled soon by what only NIXL progress here completes (a let-go
        WRITE, a fence): poll for ``SETTLE_POLL_S``."""
        self._settle_poll_until = time.monotonic() + SETTLE_POLL_S
        self.watchdog.wake()

    def first_posts(self, peer: str, request_ids: list[str]) -> None:
        """The watchdog has posted these requests' first WRITEs to ``peer`` (the tick that
        posted them is being digested): its receiver (protocol 7) polls for them from this
        ``Posted`` on, finely at first.  One frame for as many as one tick posted
        (``MAX_POSTED`` at most each)."""
        if self.control.speaks(peer, POSTED_VERSION):
            for i in range(0, len(request_ids), MAX_POSTED):
                self.control.send_to(peer, Posted(request_ids[i : i + MAX_POSTED]))

    def released(self, req: SendRequest) -> None:
        """Nothing of ``req`` holds it any more (see ``ends.SendEnds.released``)."""
        self.ends.released(req)

    def fence_failed(self, req: SendRequest, err: DoorError | None) -> None:
        self.ends.fence_failed(req, err)

    def let_go_ended(self, req: SendRequest) -> None:
        self.ends.let_go_ended(req)
