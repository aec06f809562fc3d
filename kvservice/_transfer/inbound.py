"""``Inbound``: what peers say, turned into the request plane's transitions.

The control plane (``_control.ControlPlane``) calls it (``_control.peers.PeerEvents``)
with every authenticated message, the NIXL notifications it drained, a peer's loss,
a new link and a peer whose memory cannot pair with ours; the watchdog hands it the
notifications of its ticks.  A peer is believed about its own requests only: what it
says of a request bound (or pinned) to another agent is ignored and counted
(``foreign_request``).  Everything here runs on the event loop.

A sender's ``Posted`` (protocol 7) turns its request *warm* here: the receiver held it
cold (the watchdog at its idle cadence once ``EXPECT_GRACE_S`` after its Expect had
passed), and polls NIXL for it from now until it ends.  Any other sign that its WRITEs
are under way (one of its notifications, taken by an idle tick) does the same; its end
(a Failed, an Abort, a lost link, a deadline) ends it as for any request.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import anyio

from .._control.protocol import (
    FENCE,
    FORGED,
    Abort,
    Ask,
    Expect,
    Failed,
    LandingSum,
    Message,
    Outcome,
    Posted,
    Settled,
    decode_notif,
)
from .._log import get_logger
from .._results import FailureReason, TransferStatus
from . import landing
from .heal import Heal
from .landing import Landing
from .plane import RequestPlane, peer_lost_message
from .proofs import drain_limit
from .requests import RecvRequest, SendRequest, make_result

log = get_logger("kvservice")

#: longest wait between two dials that try to settle a lost sender's requests
PROBE_MAX_S = 5.0
#: the "agent" a receiver's request is held for while its scatter copies (``_transfer.staging``)
SCATTERING = ""


class Inbound:
    """The plane's side of ``PeerEvents``; see the module docstring."""

    def __init__(self, plane: RequestPlane) -> None:
        self._plane = plane
        self._heal = Heal(plane)

    # -- messages --------------------------------------------------------------------------
    def on_message(self, agent: str, msg: Message) -> None:
        p = self._plane
        if isinstance(msg, Expect):
            self._on_expect(agent, msg)
        elif isinstance(msg, Abort):
            self._on_abort(agent, msg.request_id, msg.reason, msg.message)
        elif isinstance(msg, Failed):
            rid = msg.request_id
            rreq = p.recvs.get(rid)
            if rreq is not None and rreq.peer == agent:
                p.fail(rreq, _reason(msg.reason), f"sender reported: {msg.message}", from_peer=True, error=None)
            if (rreq.peer if rreq is not None else p.done_peers.get(("recv", rid))) != agent:
                self._foreign(agent, rid, "failed")  # not its request: it learns nothing of it
                return
            done = p.recvs_done.get(rid)
            p.send_to(agent, Outcome(rid, ok=done is not None and done.ok))
        elif isinstance(msg, Outcome):
            p.ends.on_outcome(agent, msg.request_id, msg.ok)
        elif isinstance(msg, Settled):
            p.settlement.settle_recv(msg.request_id, agent, sender_ok=msg.ok)
        elif isinstance(msg, Posted):
            for rid in msg.request_ids:
                self._on_posted(agent, rid)
        elif isinstance(msg, Ask):
            self._heal.on_ask(agent, msg.request_ids)

    def _foreign(self, agent: str, rid: str, what: str) -> None:
        """``agent`` spoke of a request that is not bound (or pinned) to it: ignored, counted."""
        if (unlogged := self._plane.stats.refuse("foreign_request")) is not None:
            log.warning("transfer.foreign_request", agent=agent, request_id=rid, message=what, unlogged=unlogged)

    def _on_posted(self, agent: str, rid: str) -> None:
        """``agent`` has posted the first WRITE of ``rid``: poll NIXL for it from now on, finely
        for a while (``Watchdog.poll_finely``): a WRITE its post left in flight ends at this
        side's next poll.  Each id costs a lookup or two (a frame names ``MAX_POSTED`` at most);
        only a request's first ``Posted`` wakes the watchdog (if it held the request cold) or
        opens the fine window, so a flood of them costs what reading and decoding the frames
        does."""
        p = self._plane
        req = p.recvs.get(rid)
        if req is not None and req.peer == agent:
            if not req.posted:
                req.posted = True
                p.warm(req)
                p.watchdog.poll_finely()
            return
        ended_with = p.done_peers.get(("recv", rid))
        if req is None and ended_with == agent:
            return  # ended here first (a notification or its end overtook the frame): nothing to do
        if req is not None or ended_with is not None:
            self._foreign(agent, rid, "posted")  # another sender's: it changes nothing
            return
        if (unlogged := p.stats.refuse("posted_unknown")) is not None:
            log.warning("transfer.posted_unknown", agent=agent, request_id=rid, unlogged=unlogged)

    def _on_expect(self, agent: str, msg: Expect) -> None:
        p = self._plane
        rid = msg.request_id
        kv = p.control.peer_kv(agent)
        if kv is None:
            return  # its link is being dropped
        try:
            pages = kv.memory.check_pages(msg.pages)
        except ValueError as exc:
            p.matching.refuse_expect(agent, rid, FailureReason.INCOMPATIBLE, str(exc))
            return
        if (why := p.stager.expected(agent, rid, kv, msg.staging, int(pages.size))) is not None:
            p.matching.refuse_expect(agent, rid, FailureReason.INCOMPATIBLE, why)  # _transfer.staging
            return
        req = p.sends.get(rid)
        if req is not None:
            if req.peer is not None:
                p.matching.refuse_expect(agent, rid, FailureReason.INCOMPATIBLE, "request already bound to a receiver")
                return
            ok = p.matching.may_receive(req, agent)
            if ok:
                p.bind(req, agent, pages, msg.verify)
            elif ok is False:
                p.matching.refuse_receiver(req, agent)
            elif (agent, rid) in p.proving:
                p.matching.refuse_expect(agent, rid, FailureReason.INCOMPATIBLE, "duplicate expect")
            else:
                assert req.receiver is not None
                p.proving.add((agent, rid))
                p.matching.after_proof(agent, req.receiver, lambda: self._on_expect(agent, msg),
                              lambda: p.proving.discard((agent, rid)))
        elif rid in p.sends_done:
            done = p.sends_done.get(rid)
            assert done is not None
            p.matching.refuse_expect(agent, rid, done.reason or FailureReason.INCOMPATIBLE,
                            "request already ended on the sender")
        elif p.early.has(rid, agent):
            p.matching.refuse_expect(agent, rid, FailureReason.INCOMPATIBLE, "duplicate expect")
        elif (refused := p.early.add(rid, agent, pages, time.monotonic(), p.control.source_of(agent),
                                     msg.verify)) is not None:
            if (unlogged := p.stats.refuse(refused.kind)) is not None:
                log.warning("expect.refused", peer=agent, source=p.control.source_of(agent), kind=refused.kind,
                            error=refused.why, unlogged=unlogged)
            p.matching.refuse_expect(agent, rid, FailureReason.REFUSED,
                            f"too many expects for requests not sent yet: {refused.why}")

    def _on_abort(self, agent: str, rid: str, reason: str, message: str) -> None:
        p = self._plane
        why = _reason(reason)  # the peer's own reason: ABORTED, SHUTDOWN, TIMEOUT, ...
        sreq = p.sends.get(rid)
        rreq = p.recvs.get(rid)
        if sreq is not None:
            # Its own (bound to it, or pinned to its proven address), or nobody's yet and
            # not pinned: then, as with an Expect, the first peer to speak of it decides.
            if sreq.peer == agent or (sreq.peer is None and p.matching.may_receive(sreq, agent)):
                # Its release, then a Settled to the receiver, follow (released()).
                p.fail(sreq, why, f"receiver aborted ({reason}): {message}", from_peer=True, error=None)
            elif rreq is None or rreq.peer != agent:
                self._foreign(agent, rid, "abort")
        elif (done := p.sends_done.get(rid)) is not None:
            # Ended: settled once released.  Only its receiver hears how it ended.
            if p.done_peers.get(("send", rid)) == agent:
                if done.ok:  # every WRITE landed (a failure settles by its fence, or said Settled)
                    p.send_to(agent, Settled(rid, ok=True))
            elif rreq is None or rreq.peer != agent:
                self._foreign(agent, rid, "abort")
        else:
            # Not sent yet: this peer's Expect (if any) is dropped, and a later send() it
            # may receive fails at once.  Nothing of it is or will be in flight to it.
            p.early.pop(rid, agent)
            p.matching.drop_expect(rid, agent, why)
            p.send_to(agent, Settled(rid))
        if rreq is not None and rreq.peer == agent:
            p.fail(rreq, why, f"sender aborted ({reason}): {message}", from_peer=True, error=None)

    # -- notifications -----------------------------------------------------------------------
    def on_notifs(self, notifs: Mapping[str, list[bytes]]) -> None:
        p = self._plane
        for agent, messages in notifs.items():
            keys = p.control.notif_keys_from(agent)
            for raw in messages:
                n = decode_notif(raw, keys)
                if n is FORGED:  # ours by its magic, but not sealed by this agent's link
                    if (unlogged := p.stats.refuse("notif_forged")) is not None:
                        log.warning("transfer.notif_forged", agent=agent, unlogged=unlogged)
                    continue
                if n is not None and n.chunk == FENCE:
                    if not p.settlement.settle_recv(n.request_id, agent):
                        live = p.recvs.get(n.request_id)
                        if live is not None and live.peer == agent:
                            live.fenced = True  # its Failed is still on the control link: settled then
                    continue
                req = p.recvs.get(n.request_id) if n else None
                if n is None or req is None or req.peer != agent:
                    p.stats.stale_notifs += 1
                    continue
                req.chunks_seen += 1
                if req.cold:  # its WRITEs are under way before its sender's Posted came
                    p.warm(req)
                if n.landing is not None and req.verify and not self._landing_sum(req, n.landing):
                    continue
                if n.total:
                    req.total_chunks = n.total
                    if n.payload is not None and len(n.payload) > p.config.max_payload_bytes:
                        p.stats.refuse("payload_limit")
                        p.fail(req, FailureReason.INCOMPATIBLE, (
                            f"payload of {len(n.payload)} bytes exceeds max_payload_bytes "
                            f"({p.config.max_payload_bytes})"), error=None)
                        continue
                    req.payload = n.payload
                if req.total_chunks is not None and req.chunks_seen >= req.total_chunks:
                    self._arrived(req, agent)

    def _arrived(self, req: RecvRequest, agent: str) -> None:
        if self._plane.stager.scatters(req.request_id):
            self._plane.tg.start_soon(self._scatter, req, agent)  # its pages are in staging yet
            return
        self._arrived_now(req, agent)

    async def _scatter(self, req: RecvRequest, agent: str) -> None:
        """Copy an arrived request from staging into its pages (door thread), then finish it.
        Held meanwhile: a failure now is not settled before the copy ends."""
        p = self._plane
        rid = req.request_id
        p.settlement.hold(rid, SCATTERING, 0)
        try:
            await p.thread.call(p.stager.scatter, rid)
        except (RuntimeError, ValueError) as exc:
            p.fail(req, FailureReason.BACKEND, f"staging scatter failed: {exc}", error=exc)
        else:  # (cancelled: the service is closing, which fails it)
            if req.result is None:
                self._arrived_now(req, agent)
        finally:
            p.settlement.settle_recv(rid, SCATTERING)

    def _landing_sum(self, req: RecvRequest, s: LandingSum) -> bool:
        """Keep a chunk's landing sum; False (the request failed) if it does not fit the request."""
        assert req.pages is not None
        if req.landing is None:
            req.landing = Landing()
        why = req.landing.add(s, int(req.pages.size), self._plane.memory.layers)
        if why is not None:
            self._plane.fail(req, FailureReason.INCOMPATIBLE, f"the sender's landing checksums do not fit: {why}",
                             error=None)
        return why is None

    def _arrived_now(self, req: RecvRequest, agent: str) -> None:
        if req.verify:
            self._plane.tg.start_soon(self._check_landing, req, agent)  # CPU work over every byte
        else:
            self._succeed(req, agent)

    async def _check_landing(self, req: RecvRequest, agent: str) -> None:
        """Succeed ``req`` only if its pages hold what the sender checksummed (``landing``);
        the CRCs run on a worker thread."""
        p = self._plane
        assert req.pages is not None
        kept = req.landing or Landing()
        sums = kept.sums
        if len(sums) != req.total_chunks:
            p.stats.landings["unchecked"] += 1
            log.warning("transfer.landing_unchecked", request_id=req.request_id, peer=agent,
                        chunks=req.total_chunks, sums=len(sums))
            p.fail(req, FailureReason.INCOMPATIBLE, (
                f"landing checks were asked, but the sender does not check landings: {len(sums)} of "
                f"{req.total_chunks} chunks carried a checksum (a sender of a version without them?)"), error=None)
            return
        if left := kept.uncovered(int(req.pages.size), p.memory.layers):
            p.fail(req, FailureReason.INCOMPATIBLE,
                   f"the sender's landing sums leave {left} (page, layer) cells of the request unchecked", error=None)
            return
        kv = p.control.peer_kv(agent)
        back = kv.back if kv is not None else None
        if back is None:  # its link is gone: its loss fails the request
            return
        bad = await anyio.to_thread.run_sync(landing.mismatches, back, req.pages, sums)
        if req.result is not None:  # failed meanwhile (timeout, abort, the sender lost)
            return
        if not bad:
            p.stats.landings["checked"] += 1
            self._succeed(req, agent)
            return
        p.stats.landings["mismatched"] += 1
        first, found = bad[0]
        where = f"pages {first.pos}..{first.pos + first.pages - 1} of the request, layers {first.lo}..{first.hi - 1}"
        log.error("transfer.landing_mismatch", request_id=req.request_id, peer=agent, chunks=len(bad),
                  of=len(sums), first=where, expected=f"{first.crc:08x}", found=f"{found:08x}")
        p.fail(req, FailureReason.CORRUPTED, (
            f"landing check failed: {len(bad)} of {len(sums)} chunks differ from what the sender wrote "
            f"(first: {where}, crc32c {found:08x}, sender's {first.crc:08x})"), error=None)

    def _succeed(self, req: RecvRequest, agent: str) -> None:
        assert req.pages is not None
        kv = self._plane.control.peer_kv(agent)
        npages = int(req.pages.size)
        self._plane.finish(req, make_result(
            req, TransferStatus.SUCCESS, nbytes=npages * (kv.inbound_page_bytes if kv else 0), pages=npages,
            payload=req.payload))

    # -- links ---------------------------------------------------------------------------------
    def on_peer_lost(self, agent: str, address: str, cause: BaseException | None, graceful: bool,
                     gone: bool, proven: frozenset[str]) -> None:
        p = self._plane
        reason = FailureReason.SHUTDOWN if graceful else FailureReason.PEER_LOST
        what = "peer shut down" if graceful else peer_lost_message(address, cause)
        if not gone and not p.closing:  # its WRITEs in flight may still end DONE: checked, not let go (proofs)
            now = time.monotonic()
            # (a peer that said Bye never asks: no proof is worth keeping its WRITEs for)
            keep = p.config.peer_timeout_s if graceful else drain_limit(p.config.peer_timeout_s)
            p.watchdog.drain(agent, now + p.config.peer_timeout_s, now + keep)
        self._heal.lost(agent, proven)
        for sreq in [r for r in p.sends.values() if r.peer == agent or self._orphaned(r, proven)]:
            p.fail(sreq, reason, what, error=cause, from_peer=True)
        for rreq in [r for r in p.recvs.values() if r.peer == agent]:
            p.fail(rreq, reason, what, error=cause, from_peer=True)
        for rid in p.early.drop_peer(agent):
            p.matching.drop_expect(rid, agent, reason, cause, proven)
        p.ends.outcomes_lost(agent, time.monotonic())
        p.watchdog.forget_fences(agent)  # its unloading releases them
        if gone:  # its process is gone (ours leaving settles all once our agent is gone: __aexit__)
            if p.settlement.settle_agent(agent):
                log.info("transfer.settled_by_loss", peer=address, agent=agent,
                         why="NIXL reports its endpoint disconnected")
        elif p.settlement.held_by(agent) and proven and not p.closing:
            p.tg.start_soon(self._settle_by_probing, agent, proven)

    def _orphaned(self, req: SendRequest, proven: frozenset[str]) -> bool:
        """Whether ``req`` is a send waiting for its Expect, pinned to an address where the
        lost agent was proven (``proven``), and where no other agent is proven now: the
        receiver it was pinned to is gone before it asked, and fails now, not at its
        ``bootstrap_timeout_s``.  A decode restarted there is a new agent that never
        expected it; one already proven there may have been sent it, and is left to ask."""
        return (req.peer is None and req.receiver is not None and req.receiver in proven
                and self._plane.control.proven_at(req.receiver) is None)

    def on_peer_linked(self, agent: str) -> None:
        """A new link with ``agent`` settles nothing by itself: NIXL's release of a
        handle does not stop a zero-copy WRITE already under way (measured: a resumed
        SIGSTOPped sender's released WRITE still landed after it re-linked).  So this
        side asks the sender which of the requests it holds for ``agent`` it can prove
        over (``heal``); what it cannot settles when its process is gone."""
        self._heal.linked(agent)

    def draining(self, agent: str) -> anyio.Event | None:
        return self._plane.watchdog.draining(agent)

    def holds(self, agent: str) -> bool:
        return self._plane.settlement.held_by(agent)

    def on_peer_gone(self, agent: str) -> None:
        self._plane.watchdog.proofs.forget(agent)
        self._heal.forget(agent)

    async def _settle_by_probing(self, agent: str, addresses: frozenset[str]) -> None:
        """``agent``'s link was lost but not proven gone (hung, or cut off): probe the
        addresses it was proven at until that settles what it held (see ``settle``):
        nobody listens there any more, or another agent proves itself there (a service
        closes its port only after its NIXL agent).  A claim never counts: only what
        answers where this service itself found ``agent``.  Ends when nothing of
        ``agent`` is held any more, or with the service."""
        p = self._plane
        wait = p.config.heartbeat_interval_s
        while p.settlement.held_by(agent) and not p.closing:
            await anyio.sleep(wait)
            wait = min(wait * 2, PROBE_MAX_S)
            for address in sorted(addresses):
                try:
                    answered = await p.control.probe(address)
                except ConnectionRefusedError:  # nobody listens there any more: the process is gone
                    why = "its address refuses connections"
                except Exception as exc:  # noqa: BLE001 - still unknown (hung, cut off): try again later
                    log.debug("peer.settle_probe_failed", agent=agent, address=address, error=repr(exc))
                    continue
                else:
                    if answered == agent:  # the same process, alive: link again (then ask), keep probing
                        await self._relink(agent, address)
                        continue
                    why = f"another agent ({answered}) proved itself at its address"
                log.info("transfer.settled_by_loss", peer=address, agent=agent, why=why)
                p.settlement.settle_agent(agent)
                return

    def on_incompatible(self, agent: str, address: str, proven: bool, why: str) -> None:
        """A peer's KV memory did not pair with ours: sends pinned to it fail now, with
        the reason, rather than wait for their bootstrap deadline."""
        p = self._plane
        if not p.closing and any(r.peer is None and r.receiver is not None for r in p.sends.values()):
            p.tg.start_soon(self._fail_incompatible, agent, address, proven, why)

    async def _fail_incompatible(self, agent: str, address: str, proven: bool, why: str) -> None:
        p = self._plane
        try:
            canon = await p.control.canonical(address)
            if not proven and await p.control.probe(address) != agent:
                return  # it claimed an address that is not its own: nothing of ours is its
        except Exception as exc:  # noqa: BLE001 - unproven: its sends wait as before
            log.debug("peer.incompatible_unproven", agent=agent, address=address, error=repr(exc))
            return
        for req in [r for r in p.sends.values() if r.peer is None and r.receiver == canon]:
            p.fail(req, FailureReason.INCOMPATIBLE, f"receiver {address} cannot pair with this service: {why}",
                   error=None)

    async def _relink(self, agent: str, address: str) -> None:
        """Link to a live lost sender again, at the address it was proven at, so that
        this side can ask it what it can prove (``on_peer_linked``)."""
        p = self._plane
        if p.control.generation_of(agent) is not None:
            return
        try:
            await p.control.link_to(address)
        except Exception as exc:  # noqa: BLE001 - not linked now: the next probe tries again
            log.debug("peer.relink_failed", agent=agent, address=address, error=repr(exc))

    def released_by_door(self, xids: list[int]) -> None:
        self._plane.stats.forced_releases += len(xids)
        self._plane.watchdog.forced(xids)


def _reason(value: str) -> FailureReason:
    try:
        return FailureReason(value)
    except ValueError:
        return FailureReason.PEER_REPORTED
