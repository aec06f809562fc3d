"""``Heal``: settling what a lost link left held, once a link to the same sender is back.

A receiver's request that failed while its sender may have been writing stays held
(``settle``).  When the sender's process is alive and a new link with the same
agent comes up (it resumed from a stall, or the network healed), the receiver asks
(``Ask``) about what it holds for that agent, and the sender answers ``Settled`` for
each request it can prove no WRITE of can land any more (``proofs``).  The rest
stays held: asked again a few times (a lost link's WRITEs may still be draining on
the sender until each ends, bounded by ``proofs.drain_limit``), then until the next
link or the sender's exit.

Receiver side: ``linked`` starts one asking task per agent; it asks at most
``MAX_ASK`` ids per ``Ask``, rotating through what is held, ``ASK_ROUNDS`` times with
back-off, only while that link lives and only to a peer that speaks version 6.  It
asks only once the agent on the new link is proven at an address where the lost one
was proven (this service dialled it there and it proved itself): a key holder that
links under a stalled sender's name cannot listen on that sender's port while the
sender lives, so it is never asked (its unasked ``Settled`` would settle as before).

Sender side: ``on_ask`` answers only about requests that are not bound to the
asker and live, or still being released or drained, and not unproven for it (a
live request bound to nobody yet has posted nothing).  A request
bound to another receiver is not the asker's: ignored and counted
(``foreign_request``).  One ``Ask`` per agent per half ``heartbeat_interval_s`` is
answered; more are ignored and counted (``ask_flood``): the work per ``Ask`` is
bounded by ``MAX_ASK`` lookups and answers.
"""

from __future__ import annotations

import time

import anyio

from .._control.protocol import MAX_ASK, Ask, Settled
from .._log import get_logger
from .plane import RequestPlane
from .requests import Recent

log = get_logger("kvservice")

#: the protocol version that knows ``Ask`` (a peer of 5 closes the link on its tag)
ASK_VERSION = 6
#: times a receiver asks on one link (with back-off from heartbeat_interval_s to ASK_MAX_WAIT_S)
ASK_ROUNDS = 8
#: longest wait between two Asks on one link
ASK_MAX_WAIT_S = 5.0


class Heal:
    """Both sides of the ``Ask``; see the module docstring."""

    def __init__(self, plane: RequestPlane) -> None:
        self._plane = plane
        self._asking: dict[str, int] = {}  # agent -> the link generation its asking task serves
        self._answered: Recent[str, float] = Recent(2 * plane.config.max_peers)  # agent -> last answered Ask
        #: agent -> the addresses it was proven at when its link was lost
        self._lost_at: Recent[str, frozenset[str]] = Recent(2 * plane.config.max_peers)

    def lost(self, agent: str, proven: frozenset[str]) -> None:
        """``agent``'s link was lost while it was proven at ``proven``."""
        if proven:
            self._lost_at.put(agent, proven)

    def forget(self, agent: str) -> None:
        """``agent`` is gone for good (``_transfer.proofs``): it never links or asks again."""
        self._lost_at.pop(agent)
        self._answered.pop(agent)

    # -- receiver side -------------------------------------------------------------------
    def linked(self, agent: str) -> None:
        """A new link with ``agent``: ask about what this side holds for it."""
        p = self._plane
        generation = p.control.generation_of(agent)
        if generation is None or self._asking.get(agent) == generation or p.closing or agent not in self._lost_at \
                or not p.settlement.held_by(agent) or not p.control.speaks(agent, ASK_VERSION):
            return
        self._asking[agent] = generation
        p.tg.start_soon(self._ask, agent, generation)

    async def _ask(self, agent: str, generation: int) -> None:
        p = self._plane
        wait = p.config.heartbeat_interval_s
        offset = 0
        try:
            for _ in range(ASK_ROUNDS):
                if p.closing or p.control.generation_of(agent) != generation:
                    return
                held = p.settlement.held_ids(agent)
                if not held:
                    return
                offset = offset % len(held)
                ids = (held[offset:] + held[:offset])[:MAX_ASK]
                offset += MAX_ASK
                if p.control.speaks(agent, ASK_VERSION) and self._same_sender(agent):
                    log.debug("transfer.ask", agent=agent, requests=len(ids), held=len(held))
                    p.send_to(agent, Ask(ids))
                    p.settle_poll()  # its WRITEs let go may still be on the way: they need our progress
                await anyio.sleep(wait)
                wait = min(2 * wait, ASK_MAX_WAIT_S)
        finally:
            if self._asking.get(agent) == generation:
                del self._asking[agent]

    def _same_sender(self, agent: str) -> bool:
        """Whether linked ``agent`` is proven where the lost one was (the same listener)."""
        return bool(self._plane.control.proven_addresses(agent) & (self._lost_at.get(agent) or frozenset()))

    # -- sender side ---------------------------------------------------------------------
    def on_ask(self, agent: str, request_ids: list[str]) -> None:
        """Answer ``Settled`` for each of ``request_ids`` proven over to ``agent``."""
        p = self._plane
        now = time.monotonic()
        last = self._answered.get(agent)
        if last is not None and now - last < p.config.heartbeat_interval_s / 2:
            if (unlogged := p.stats.refuse("ask_flood")) is not None:
                log.warning("transfer.ask_flood", agent=agent, unlogged=unlogged)
            return
        self._answered.put(agent, now)
        proofs = p.watchdog.proofs
        proven = 0
        draining = p.watchdog.draining_requests(agent)
        for rid in dict.fromkeys(request_ids):
            if rid in draining:
                continue  # a WRITE of it is still in flight (its link was lost): later
            # bound and live, or still being released (an unbound one never posted anything)
            bound = [r.peer for r in (p.sends.get(rid), p.ends.unsettled.get(rid)) if r is not None and r.peer]
            if bound:
                if agent not in bound:
                    self._foreign(agent, rid)
                continue  # it may still write, or its handles are still being released: later
            done_with = p.done_peers.get(("send", rid))
            if done_with is not None and done_with != agent:
                self._foreign(agent, rid)
                continue
            if not proofs.may_prove(agent, rid):
                continue  # a WRITE of it was let go before NIXL said DONE: held until we exit
            done = p.sends_done.get(rid) if done_with == agent else None
            p.send_to(agent, Settled(rid, ok=done is not None and done.ok))
            proven += 1
        log.info("transfer.asked", agent=agent, requests=len(request_ids), proven=proven)

    def _foreign(self, agent: str, rid: str) -> None:
        if (unlogged := self._plane.stats.refuse("foreign_request")) is not None:
            log.warning("transfer.foreign_request", agent=agent, request_id=rid, message="ask", unlogged=unlogged)
