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
from collections.abc import Callable, Mapping

import anyio
import anyio.abc
import numpy as np
import numpy.typing as npt

from .._config import ServiceConfig
from .._control.plane import ControlPlane
from .._control.protocol import FENCE, FORGED, Abort, Expect, Failed, Message, Outcome, Settled, decode_notif, text
from .._log import get_logger
from .._nixl.door import DoorError, DoorThread
from .._results import FailureReason, Overloaded, TransferResult, TransferStatus
from .._stats import Stats
from .deadlines import Deadlines
from .requests import EarlyExpects, Recent, RecvRequest, SendRequest, make_result
from .settle import Settlement
from .staging import Stager
from .watchdog import Watchdog

log = get_logger("kvservice")

#: longest wait between two dials that try to settle a lost sender's requests
PROBE_MAX_S = 5.0
#: settle fences posted for one request before giving up (each failed one is a NIXL error)
FENCE_TRIES = 3
#: the "agent" of a dropped-expect record made by this service's own ``abort()``
LOCAL = ""
#: the "agent" a receiver's request is held for while its scatter copies (``memory._staging``)
SCATTERING = ""


class ServiceCore:
    """Request tables and transitions; see the module docstring.  ``TransferService``
    creates the state (``_init_state``) and the collaborators."""

    config: ServiceConfig
    stats: Stats
    _tg: anyio.abc.TaskGroup | None
    _watchdog: Watchdog | None
    _control: ControlPlane | None
    _closing: bool
    _thread: DoorThread | None
    _stager: Stager | None = None  # memory._staging: this service's staging and its requests

    def _init_state(self) -> None:
        results_kept = self.config.results_kept
        self._sends: dict[str, SendRequest] = {}
        self._recvs: dict[str, RecvRequest] = {}
        # Ended requests keep only their result: one object each for the cyclic GC
        # to walk, not the request's events, queues and sets.
        self._sends_done: Recent[str, TransferResult] = Recent(results_kept)
        self._recvs_done: Recent[str, TransferResult] = Recent(results_kept)
        self._deadlines: Deadlines[SendRequest | RecvRequest] = Deadlines()
        cfg = self.config
        # Expects that arrived before the matching send()
        self._early = EarlyExpects(cfg.max_unknown_expects, cfg.unknown_expect_ttl_s,
                                   cfg.max_unknown_expect_pages, cfg.max_unknown_expect_pages_total)
        # Expects dropped (peer lost / aborted) before any send(), per peer, with the
        # addresses it was proven at: a later send that peer may receive fails at once.
        self._dropped: Recent[str, dict[str, tuple[FailureReason, frozenset[str]]]] = Recent(results_kept)
        # the peer an ended request was bound to ((side, id) -> agent): only it hears of it
        self._done_peers: Recent[tuple[str, str], str] = Recent(2 * results_kept)
        # (agent, id) of Expects waiting for the proof of the agent's address
        self._proving: set[tuple[str, str]] = set()
        self._settlement = Settlement(self._recvs_done, self._sends_done)
        # Failed sends whose receiver's Outcome is awaited (see _fail)
        self._outcomes: dict[str, SendRequest] = {}
        # Failed sends not settled yet (their handles are being released): a send() of
        # the same id meanwhile returns the request itself, done once it has settled
        self._unsettled_sends: dict[str, SendRequest] = {}
        self._idle = anyio.Event()

    def _check_capacity(self) -> None:
        live = len(self._sends) + len(self._recvs)
        if live >= self.config.max_live_requests:
            self.stats.refuse("live_request_limit")
            raise Overloaded(f"{live} requests alive, the limit (max_live_requests) is "
                             f"{self.config.max_live_requests}")

    def _may_receive(self, req: SendRequest, agent: str) -> bool | None:
        """Whether ``agent`` may receive ``req``: any peer unless it is pinned; then only
        the agent proven to answer at that address (None: not proven either way yet)."""
        if req.receiver is None:
            return True
        assert self._control is not None
        return self._control.at_address(agent, req.receiver)

    def _refuse_receiver(self, req: SendRequest, agent: str) -> None:
        """``agent`` is not the receiver ``req`` is pinned to: it is told (``REFUSED``) and it is counted."""
        if (unlogged := self.stats.refuse("receiver_mismatch")) is not None:
            log.warning("transfer.expect_refused", request_id=req.request_id, agent=agent, receiver=req.receiver,
                        unlogged=unlogged)
        self._refuse_expect(agent, req.request_id, FailureReason.REFUSED, "the request is pinned to another receiver")

    def _after_proof(self, agent: str, canon: str, then: Callable[[], None],
                     finally_: Callable[[], None] | None = None) -> None:
        """Prove whether ``agent`` answers at ``canon`` (one probe, shared), then call
        ``then`` if its link is still the one that asked; ``finally_`` in any case."""
        assert self._control is not None and self._tg is not None
        control = self._control
        generation = control.generation_of(agent)

        async def prove() -> None:
            try:
                await control.prove_address(agent, canon)
            finally:
                if finally_ is not None:
                    finally_()
            if control.generation_of(agent) == generation and not self._closing:
                then()

        self._tg.start_soon(prove)

    def _early_dest(self, rid: str, receiver: str | None) -> npt.NDArray[np.int32] | None:
        """The pages of the early Expect that a send of ``rid`` (pinned to ``receiver``) would bind."""
        assert self._control is not None
        for agent in self._early.agents(rid):
            if receiver is None or self._control.at_address(agent, receiver):
                return self._early.pages_of(rid, agent)
        return None

    def _match_early(self, req: SendRequest) -> None:
        """A new (or still unbound) send meets the Expects that came before it: the first
        from a peer that may receive it binds it; those from peers proven not to are
        refused; an Expect such a peer dropped fails it; the rest wait for their proof."""
        if req.result is not None or req.peer is not None:
            return
        rid = req.request_id
        unknown: list[str] = []
        for agent in self._early.agents(rid):
            ok = self._may_receive(req, agent)
            if ok is None:
                unknown.append(agent)
                continue
            pages = self._early.pop(rid, agent)
            assert pages is not None
            if ok:
                self._bind(req, agent, pages)
                return
            self._refuse_receiver(req, agent)
        dropped = self._dropped.get(rid)
        for agent, (reason, proven) in list((dropped or {}).items()):
            if agent == LOCAL or req.receiver is None or req.receiver in proven:
                del dropped[agent]  # type: ignore[union-attr]
                self._fail(req, reason, "the receiver's expect was dropped before this send")
                return
        for agent in unknown:
            assert req.receiver is not None
            self._after_proof(agent, req.receiver, lambda: self._match_early(req))

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
        req.notif_key = self._control.notif_key_to(peer) or b""
        req.kv = kv
        req.dest = pages
        filed = req.bootstrap_deadline  # its entry in the deadlines (due_at() until now)
        req.deadline = time.monotonic() + (req.timeout or self.config.transfer_timeout_s)
        if req.deadline < filed:  # a later deadline is filed again when the old entry pops
            self._deadlines.push(req)
        if req.pending:
            self._watchdog.schedule(req)  # type: ignore[union-attr]

    def _finish(self, req: SendRequest | RecvRequest, result: TransferResult) -> None:
        if isinstance(req, RecvRequest) and not result.ok and (req.peer is None or req.fenced):
            # no sender ever had these pages, or its fence has landed already
            result = dataclasses.replace(result, settled=True)
        req.result = result
        if req.peer is not None:
            self._done_peers.put(("send" if isinstance(req, SendRequest) else "recv", req.request_id), req.peer)
        if isinstance(req, SendRequest):
            self._sends.pop(req.request_id, None)
            self._sends_done.put(req.request_id, result)
            if result.ok:
                req.done.set()
            else:  # done once the door released every handle of it (released())
                self._unsettled_sends[req.request_id] = req
            self._watchdog.forget(req)  # type: ignore[union-attr]
        else:
            req.done.set()
            self._recvs.pop(req.request_id, None)
            self._recvs_done.put(req.request_id, result)
            if not result.settled:
                assert req.peer is not None and req.pages is not None
                self._settlement.hold(req.request_id, req.peer, int(req.pages.size))
            elif self._stager is not None:
                self._stager.received(req.request_id)
        side = "send" if isinstance(req, SendRequest) else "recv"
        self.stats.record(side, result, req.peer)
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
            keys = self._control.notif_keys_from(agent) if self._control is not None else []
            for raw in messages:
                n = decode_notif(raw, keys)
                if n is FORGED:  # ours by its magic, but not sealed by this agent's link
                    if (unlogged := self.stats.refuse("notif_forged")) is not None:
                        log.warning("transfer.notif_forged", agent=agent, unlogged=unlogged)
                    continue
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
        if self._stager is not None and self._stager.scatters(req.request_id) and self._tg is not None:
            self._tg.start_soon(self._scatter, req, agent)  # its pages are in staging yet
            return
        self._arrived_now(req, agent)

    async def _scatter(self, req: RecvRequest, agent: str) -> None:
        """Copy an arrived request from staging into its pages (door thread), then finish it.
        Held meanwhile: a failure now is not settled before the copy ends."""
        assert self._stager is not None and self._thread is not None
        rid = req.request_id
        self._settlement.hold(rid, SCATTERING, 0)
        try:
            await self._thread.call(self._stager.scatter, rid)
        except (RuntimeError, ValueError) as exc:
            self._fail(req, FailureReason.BACKEND, f"staging scatter failed: {exc}", error=exc)
        else:  # (cancelled: the service is closing, which fails it)
            if req.result is None:
                self._arrived_now(req, agent)
        finally:
            self._settlement.settle_recv(rid, SCATTERING)

    def _arrived_now(self, req: RecvRequest, agent: str) -> None:
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
            rid = msg.request_id
            rreq = self._recvs.get(rid)
            if rreq is not None and rreq.peer == agent:
                self._fail(rreq, _reason(msg.reason), f"sender reported: {msg.message}", from_peer=True)
            if (rreq.peer if rreq is not None else self._done_peers.get(("recv", rid))) != agent:
                self._foreign(agent, rid, "failed")  # not its request: it learns nothing of it
                return
            done = self._recvs_done.get(rid)
            self._send_to(agent, Outcome(rid, ok=done is not None and done.ok))
        elif isinstance(msg, Outcome):
            self._on_outcome(agent, msg)
        elif isinstance(msg, Settled):
            self._settlement.settle_recv(msg.request_id, agent, sender_ok=msg.ok)

    def _foreign(self, agent: str, rid: str, what: str) -> None:
        """``agent`` spoke of a request that is not bound (or pinned) to it: ignored, counted."""
        if (unlogged := self.stats.refuse("foreign_request")) is not None:
            log.warning("transfer.foreign_request", agent=agent, request_id=rid, message=what, unlogged=unlogged)

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
        if self._stager is not None and (why := self._stager.expected(agent, rid, kv, msg.staging,
                                                                      int(pages.size))) is not None:
            self._refuse_expect(agent, rid, FailureReason.INCOMPATIBLE, why)  # memory._staging
            return
        req = self._sends.get(rid)
        if req is not None:
            if req.peer is not None:
                self._refuse_expect(agent, rid, FailureReason.INCOMPATIBLE, "request already bound to a receiver")
                return
            ok = self._may_receive(req, agent)
            if ok:
                self._bind(req, agent, pages)
            elif ok is False:
                self._refuse_receiver(req, agent)
            elif (agent, rid) in self._proving:
                self._refuse_expect(agent, rid, FailureReason.INCOMPATIBLE, "duplicate expect")
            else:
                assert req.receiver is not None
                self._proving.add((agent, rid))
                self._after_proof(agent, req.receiver, lambda: self._on_expect(agent, msg),
                                  lambda: self._proving.discard((agent, rid)))
        elif rid in self._sends_done:
            done = self._sends_done.get(rid)
            assert done is not None
            self._refuse_expect(agent, rid, done.reason or FailureReason.INCOMPATIBLE,
                                "request already ended on the sender")
        elif self._early.has(rid, agent):
            self._refuse_expect(agent, rid, FailureReason.INCOMPATIBLE, "duplicate expect")
        elif (why := self._early.add(rid, agent, pages, time.monotonic())) is not None:
            self.stats.refuse("unknown_expect_limit")
            self._refuse_expect(agent, rid, FailureReason.REFUSED, f"too many expects for requests not sent yet: {why}")

    def _on_peer_abort(self, agent: str, rid: str, reason: str, message: str) -> None:
        why = _reason(reason)  # the peer's own reason: ABORTED, SHUTDOWN, TIMEOUT, ...
        sreq = self._sends.get(rid)
        rreq = self._recvs.get(rid)
        if sreq is not None:
            # Its own (bound to it, or pinned to its proven address), or nobody's yet and
            # not pinned: then, as with an Expect, the first peer to speak of it decides.
            if sreq.peer == agent or (sreq.peer is None and self._may_receive(sreq, agent)):
                # Its release, then a Settled to the receiver, follow (released()).
                self._fail(sreq, why, f"receiver aborted ({reason}): {message}", from_peer=True)
            elif rreq is None or rreq.peer != agent:
                self._foreign(agent, rid, "abort")
        elif (done := self._sends_done.get(rid)) is not None:
            # Ended: settled once released.  Only its receiver hears how it ended.
            if self._done_peers.get(("send", rid)) == agent:
                if done.ok:  # every WRITE landed (a failure settles by its fence, or said Settled)
                    self._send_to(agent, Settled(rid, ok=True))
            elif rreq is None or rreq.peer != agent:
                self._foreign(agent, rid, "abort")
        else:
            # Not sent yet: this peer's Expect (if any) is dropped, and a later send() it
            # may receive fails at once.  Nothing of it is or will be in flight to it.
            self._early.pop(rid, agent)
            self._drop_expect(rid, agent, why)
            self._send_to(agent, Settled(rid))
        if rreq is not None and rreq.peer == agent:
            self._fail(rreq, why, f"sender aborted ({reason}): {message}", from_peer=True)

    def _drop_expect(self, rid: str, agent: str, why: FailureReason) -> None:
        """Remember that ``agent``'s Expect for ``rid`` (not sent yet) was dropped."""
        assert self._control is not None
        dropped = self._dropped.get(rid)
        if dropped is None:
            dropped = {}
            self._dropped.put(rid, dropped)
        dropped[agent] = (why, self._control.proven_addresses(agent))

    def on_peer_lost(self, agent: str, address: str, cause: BaseException | None, graceful: bool,
                     gone: bool, proven: frozenset[str]) -> None:
        reason = FailureReason.SHUTDOWN if graceful else FailureReason.PEER_LOST
        what = "peer shut down" if graceful else f"lost peer {address}: {cause!r}"
        for sreq in [r for r in self._sends.values() if r.peer == agent]:
            self._fail(sreq, reason, what, error=cause, from_peer=True)
        for rreq in [r for r in self._recvs.values() if r.peer == agent]:
            self._fail(rreq, reason, what, error=cause, from_peer=True)
        for rid in self._early.drop_peer(agent):
            self._drop_expect(rid, agent, reason)
        self._outcomes_lost(agent, time.monotonic())
        if self._watchdog is not None:
            self._watchdog.forget_fences(agent)  # its unloading releases them
        if gone:  # its process is gone (ours leaving settles all once our agent is gone: __aexit__)
            if self._settlement.settle_agent(agent):
                log.info("transfer.settled_by_loss", peer=address, agent=agent,
                         why="NIXL reports its endpoint disconnected")
        elif self._settlement.held_by(agent) and proven and self._tg is not None and not self._closing:
            self._tg.start_soon(self._settle_by_probing, agent, proven)

    def on_peer_linked(self, agent: str) -> None:
        """A new link with ``agent`` settles nothing it held: its peer table dropped the
        old link (releasing every handle to us) before admitting this one, but NIXL's
        release does not stop a zero-copy WRITE already under way (measured: a resumed
        SIGSTOPped sender's released WRITE still landed after it re-linked).  What it
        held settles when its process is gone."""

    async def _settle_by_probing(self, agent: str, addresses: frozenset[str]) -> None:
        """``agent``'s link was lost but not proven gone (hung, or cut off): probe the
        addresses it was proven at until that settles what it held (see ``_settle``):
        nobody listens there any more, or another agent proves itself there (a service
        closes its port only after its NIXL agent).  A claim never counts: only what
        answers where this service itself found ``agent``.  Ends when nothing of
        ``agent`` is held any more, or with the service."""
        assert self._control is not None
        wait = self.config.heartbeat_interval_s
        while self._settlement.held_by(agent) and not self._closing:
            await anyio.sleep(wait)
            wait = min(wait * 2, PROBE_MAX_S)
            for address in sorted(addresses):
                try:
                    answered = await self._control.probe(address)
                except ConnectionRefusedError:  # nobody listens there any more: the process is gone
                    why = "its address refuses connections"
                except Exception as exc:  # noqa: BLE001 - still unknown (hung, cut off): try again later
                    log.debug("peer.settle_probe_failed", agent=agent, address=address, error=repr(exc))
                    continue
                else:
                    if answered == agent:  # the same process, alive: keep probing for its exit
                        continue
                    why = f"another agent ({answered}) proved itself at its address"
                log.info("transfer.settled_by_loss", peer=address, agent=agent, why=why)
                self._settlement.settle_agent(agent)
                return

    def on_incompatible(self, agent: str, address: str, proven: bool, why: str) -> None:
        """A peer's KV memory did not pair with ours: sends pinned to it fail now, with
        the reason, rather than wait for their bootstrap deadline."""
        if self._tg is not None and not self._closing and any(
                r.peer is None and r.receiver is not None for r in self._sends.values()):
            self._tg.start_soon(self._fail_incompatible, agent, address, proven, why)

    async def _fail_incompatible(self, agent: str, address: str, proven: bool, why: str) -> None:
        assert self._control is not None
        try:
            canon = await self._control.canonical(address)
            if not proven and await self._control.probe(address) != agent:
                return  # it claimed an address that is not its own: nothing of ours is its
        except Exception as exc:  # noqa: BLE001 - unproven: its sends wait as before
            log.debug("peer.incompatible_unproven", agent=agent, address=address, error=repr(exc))
            return
        for req in [r for r in self._sends.values() if r.peer is None and r.receiver == canon]:
            self._fail(req, FailureReason.INCOMPATIBLE, f"receiver {address} cannot pair with this service: {why}")

    def released(self, req: SendRequest) -> None:
        """Watchdog: the door released every handle of ``req``.  A failure is settled
        now: its caller may reuse the source pages, and the receiver is told."""
        result = req.result
        if self._unsettled_sends.get(req.request_id) is req:
            del self._unsettled_sends[req.request_id]
        if result is None or result.settled:
            return
        # A failure, or one the receiver's Outcome has already turned into SUCCESS.
        req.result = self._settlement.settled_send(result)
        self._maybe_done(req)
        if req.outcome_due is None:
            self._tell_settled(req)
        # else: the receiver's Outcome comes first (_on_outcome, _outcomes_lost).  If it
        # had every page, its request succeeded and may already be reused there: no
        # fence may land in it.

    def _tell_settled(self, req: SendRequest) -> None:
        """A released failure: let its receiver settle.  A released handle's bytes may
        still be on the wire (a TCP stream, a queue pair): the receiver settles on the
        fence's notification, which NIXL sends only after flushing the endpoint.
        Nothing ever posted: nothing to wait for."""
        if req.peer is None or req.result is None or req.result.ok:  # it has every page: nothing to fence
            return
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
        if req.result is not None and req.result.settled:  # released already: now tell it
            self._tell_settled(req)

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
                if req.result is not None and req.result.settled:  # released already: now tell it
                    self._tell_settled(req)



def _reason(value: str) -> FailureReason:
    try:
        return FailureReason(value)
    except ValueError:
        return FailureReason.PEER_REPORTED

