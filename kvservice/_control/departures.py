"""What becomes of a lost agent after its requests failed: unloading it from NIXL (once
its drain ended) and, once it is known gone for good, forgetting it.

Unloading.  A lost receiver's WRITEs in flight are drained (``_transfer.proofs``): its
agent stays loaded until the watchdog says nothing of it drains any more (bounded by
the watchdog's ``drain_limit``, and here by that and ``peer_timeout_s`` more), unless
it linked again meanwhile (its new link's loading replaced the old agent).  A peer
linking again waits for the drain first (``let_drain_end``, up to twice
``peer_timeout_s``: it is alive, so its WRITEs end soon).  The mirror: a lost sender
not known gone, for which this side holds pages, stays loaded until nothing is held
for it, it links again, or ``drain_limit`` passes (``_unload_when_settled``).  If this
side was the one stopped past the loss, the sender's WRITEs still in flight end only
while this side's endpoint stays open; unloading it would fail them, and the sender
could never prove them over: the pages would stay held until it exits.

Gone for good.  An agent name is unique per service incarnation, so an agent whose
process is gone, whose address another agent now answers at, or that said ``Bye``
never links again.  The tables kept per agent after its link ended (the inbound
notification keys here; the proofs ledger and the heal's records in ``_transfer``)
serve only an agent that may come back: once it is unloaded and known gone for good,
its entries are dropped (``PeerEvents.on_peer_gone``).  What proves it: NIXL reports
its endpoint disconnected when it is lost, a dial found a new agent at its address,
its ``Bye``, or, for a lost agent, probes where it was proven, else where it claimed to be
(its link lost before the proof ended, or the proof unanswered: stopped or cut off then)
unless another agent answered there: a few, backing off, then a slow one for as long
as any table here remembers the agent.  It is gone when the
address refuses connections (a service closes its port only after its NIXL agent) or
another agent proves itself there.  An agent that answers there itself is alive, and
one that answers nothing (stopped, cut off) may be: both stay, and are probed on, since
either may die later without linking again; the tables' own bounds hold what stays.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc

from .._config import ServiceConfig
from .._log import get_logger
from .._nixl.door import Door, DoorThread
from .._transfer.proofs import drain_limit
from .peers import PeerEvents

log = get_logger("kvservice.control")

#: probes of a lost agent's addresses to find out whether it is gone for good
GONE_PROBES = 8
#: longest wait between two of them
GONE_PROBE_MAX_S = 5.0
#: then, while the service remembers it (``Departures.remembered``), a probe this often
GONE_WATCH_S = 30.0


class Departures:
    """Unloading and forgetting lost agents; see the module docstring."""

    def __init__(
        self, config: ServiceConfig, thread: DoorThread, door: Door, events: PeerEvents, tg: anyio.abc.TaskGroup,
        lock: anyio.Lock, *, linked: Callable[[str], bool], closing: Callable[[], bool],
        probe: Callable[[str], Awaitable[str]], gone: Callable[[str, str], None],
        remembered: Callable[[str], bool],
    ) -> None:
        self._cfg = config
        self._thread = thread
        self._door = door
        self._events = events
        self._tg = tg
        self._lock = lock  # the control plane's table lock: loading and dropping peers
        self._linked = linked  # whether an agent is linked (in the peer table) now
        self._closing = closing
        self._probe = probe  # the agent answering at an address now
        self._gone = gone  # forget an agent gone for good (why)
        self._remembered = remembered  # whether the control plane's tables still hold an agent

    async def left(self, agent: str, gone: str | None, addresses: frozenset[str]) -> None:
        """Called under the table lock once lost ``agent``'s requests failed: unload it now,
        or once its drain ended.  ``gone``: why it is known gone for good, if it is;
        ``addresses``: where to probe it (where it was proven, else where it claimed to be)."""
        drained = self._events.draining(agent)
        if drained is not None and not self._closing():  # its WRITEs in flight may still end DONE
            self._tg.start_soon(self._unload_when_drained, agent, drained, gone, addresses)
            return
        if gone is None and not self._closing() and self._events.holds(agent):
            self._tg.start_soon(self._unload_when_settled, agent, addresses)  # a live sender's WRITEs may end DONE
            return
        await self._unload(agent, gone)
        self._after_unload(agent, gone, addresses)

    async def _unload(self, agent: str, gone: str | None) -> None:
        """Unload ``agent``; one not known gone is kept loaded by the door (bounded), so that
        its link made again reuses its endpoint (``Door.remove_peer``)."""
        released = await self._thread.call(lambda: self._door.remove_peer(agent, keep_loaded=gone is None))
        self._events.released_by_door(released)

    async def _forget(self, agent: str, why: str) -> None:
        """``agent`` is gone for good: forget it here and in the door."""
        self._gone(agent, why)
        await self._thread.call(self._door.forget_peer, agent)

    async def _unload_when_drained(self, agent: str, drained: anyio.Event, gone: str | None,
                                   addresses: frozenset[str]) -> None:
        """Unload a lost ``agent`` from NIXL once its handles in flight ended (the
        watchdog bounds that wait), unless it linked again meanwhile: its new link's
        loading replaced the old agent (releasing what still drained, unproven)."""
        limit = drain_limit(self._cfg.peer_timeout_s)
        with anyio.move_on_after(limit + self._cfg.peer_timeout_s):  # the watchdog's own bound is the limit
            await drained.wait()
        async with self._lock:
            if self._linked(agent) or self._closing():
                return
            await self._unload(agent, gone)
            self._after_unload(agent, gone, addresses)

    async def _unload_when_settled(self, agent: str, addresses: frozenset[str]) -> None:
        """Unload a lost sender, not known gone, once nothing is held for it here (see the
        module docstring), unless it linked again meanwhile; at most ``drain_limit``."""
        wait = self._cfg.heartbeat_interval_s
        for _ in range(int(drain_limit(self._cfg.peer_timeout_s) / wait) + 1):
            if not self._events.holds(agent) or self._linked(agent) or self._closing():
                break
            await anyio.sleep(wait)
        async with self._lock:
            if self._linked(agent) or self._closing():
                return
            await self._unload(agent, None)
            self._after_unload(agent, None, addresses)

    def _after_unload(self, agent: str, gone: str | None, addresses: frozenset[str]) -> None:
        if self._closing():
            return
        if gone is not None:
            self._gone(agent, gone)  # (unloaded for good already: gone is not None)
        elif addresses:
            self._tg.start_soon(self._find_out_gone, agent, addresses)

    async def _find_out_gone(self, agent: str, addresses: frozenset[str]) -> None:
        """Probe unloaded ``agent`` at ``addresses`` until it is known gone for good (then
        forget it) or linked again: ``GONE_PROBES`` probes backing off to
        ``GONE_PROBE_MAX_S``, then one every ``GONE_WATCH_S`` for as long as it is
        remembered (``remembered``, or the door keeps it loaded: ``Door.kept``).  A peer found
        alive, stopped or cut off may still die without linking again, and what is kept of it
        would stay until evicted: its kept agent's connection, and its entries in the tables
        kept per agent (a decode cut off, then killed and restarted while cut off, was found
        not gone by every early probe and its agent was not kept, NIXL having reported it
        disconnected: the soak's per-agent tables crept up by such agents)."""
        wait = self._cfg.heartbeat_interval_s
        for probes in itertools.count(1):
            await anyio.sleep(wait)
            wait = min(2 * wait, GONE_PROBE_MAX_S) if probes < GONE_PROBES else GONE_WATCH_S
            if self._linked(agent) or self._closing():
                return
            if probes > GONE_PROBES and not self._remembered(agent) \
                    and not await self._thread.call(self._door.kept, agent):
                return  # forgotten meanwhile (evicted, or found gone another way)
            why = await self._gone_why(agent, addresses)
            if why is None:
                continue
            async with self._lock:
                if self._linked(agent):
                    return
                if self._events.draining(agent) is None:  # else: once its drain ended
                    await self._forget(agent, why)
                    return

    async def _gone_why(self, agent: str, addresses: frozenset[str]) -> str | None:
        """Why ``agent`` is gone for good, by one probe of each of its addresses; None while
        it answers there itself (alive) or nothing answers (stopped, cut off: not known yet)."""
        for address in sorted(addresses):
            try:
                answered = await self._probe(address)
            except ConnectionRefusedError:
                return "its address refuses connections"
            except Exception as exc:  # noqa: BLE001 - not known yet (stopped, cut off): later
                log.debug("peer.gone_probe_failed", agent=agent, address=address, error=repr(exc))
                continue
            if answered != agent:
                return f"another agent ({answered}) proved itself at its address"
            log.debug("peer.gone_probe_alive", agent=agent, address=address)
        return None

    async def let_drain_end(self, agent: str) -> None:
        """A lost peer linking again: let the handles still draining to it end first, as
        loading it afresh would release them unproven (``_transfer.proofs``)."""
        drained = self._events.draining(agent)
        if drained is not None:
            with anyio.move_on_after(2 * self._cfg.peer_timeout_s):  # the watchdog's own bound is one
                await drained.wait()
