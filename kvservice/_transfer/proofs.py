"""Proofs: what a sender can prove to a receiver that asks, after a new link, about the
requests it still holds.

A receiver's failed request stays *unsettled* while its sender may still write into
its pages (``settle``).  When the link to that sender comes back (the same agent, so
the same process), the receiver asks (``Ask``) which of them can no WRITE reach any
more, and the sender answers ``Settled`` for each one it can prove:

* every WRITE it posted for the request reached ``DONE`` (``check_xfer_state``)
  before its handle was released: NIXL flushes a WRITE's endpoint before it sends
  the WRITE's notification, and every WRITE here carries one, so ``DONE`` means
  every byte of it has landed; or
* it never posted any WRITE of the request to that receiver, which includes a
  request this process never saw.

Everything else is *unproven* and recorded here, per receiver agent, when it
happens: a handle released while NIXL still said ``PROC`` (an abort, a deadline,
a lost link's drain that ran out, a peer unloaded under it: NIXL's release does not
stop a zero-copy WRITE under way, and over TCP the kernel still delivers what UCX
queued, measured in ``tests/faults/test_network_cut.py``), a handle that ended in
an error (UCX gave up on it; it does not say that none of its bytes is still
queued on the way), and a post that failed (the same).  A request unknown to this
process is proven only while this ledger is complete for that agent: it keeps up
to ``per_agent`` request ids per agent and ``agents`` agents, and once it has had to
forget one it answers no unknown request of that agent (or of any agent it holds
nothing for) any more: such pages stay held until this process exits, as before.

So that a lost receiver's WRITEs in flight can still end ``DONE``, a lost link's
handles are not released at once: the watchdog keeps checking them (it *drains*
them) until each ends, ``DONE`` or an error, or ``drain_limit`` passes
(``Watchdog.drain``), and the control plane unloads that agent from NIXL only then.
The limit is far longer than ``peer_timeout_s``: a receiver stopped (SIGSTOP, a host
swapping) past its loss still progresses those WRITEs once it resumes (it keeps this
sender's endpoint while it holds pages for it: ``_control.departures``), and its
pages settle on its next ``Ask`` then, not at this process's exit.  What it costs
meanwhile: the lost agent stays loaded and its handles in flight stay live.

An agent's entries are forgotten (``forget``) once it is gone for good: unloaded, and
its process proven gone, replaced at its address, or shut down (its ``Bye``).  Agent
names are unique per service incarnation, so such an agent never links again and
never asks: nothing it could be answered about needs proof any more.
"""

from __future__ import annotations

import collections

from .._log import get_logger

log = get_logger("kvservice")

#: the longest a lost receiver's WRITEs in flight are drained (``drain_limit``): a receiver
#: stopped for longer holds the pages they reach until this process exits
DRAIN_S = 120.0


def drain_limit(peer_timeout_s: float) -> float:
    """How long a lost receiver's handles in flight are checked before they are let go."""
    return max(DRAIN_S, peer_timeout_s)


class Proofs:
    """The unproven requests of this sender, per receiver agent; see the module docstring."""

    def __init__(self, *, per_agent: int = 4096, agents: int = 1024) -> None:
        self._per_agent = per_agent
        self._agents = agents
        #: receiver agent -> its unproven request ids (insertion-ordered, bounded)
        self._unproven: collections.OrderedDict[str, dict[str, None]] = collections.OrderedDict()
        #: agents for which some unproven id had to be forgotten
        self._incomplete: set[str] = set()
        #: an agent's whole entry had to be forgotten: an agent without one proves nothing unknown
        self._lossy = False

    def unproven(self, agent: str | None, request_id: str, why: str) -> None:
        """A WRITE of ``request_id`` to ``agent`` ended without proof that it is over (``why``)."""
        if agent is None:
            return
        log.debug("transfer.unproven", request_id=request_id, peer=agent, why=why)
        ids = self._unproven.get(agent)
        if ids is None:
            ids = self._unproven[agent] = {}
            while len(self._unproven) > self._agents:
                self._unproven.popitem(last=False)
                self._lossy = True
        self._unproven.move_to_end(agent)
        ids[request_id] = None
        if len(ids) > self._per_agent:
            del ids[next(iter(ids))]
            self._incomplete.add(agent)

    def forget(self, agent: str) -> None:
        """``agent`` is gone for good (see the module docstring): drop its entries."""
        self._unproven.pop(agent, None)
        self._incomplete.discard(agent)

    def may_prove(self, agent: str, request_id: str) -> bool:
        """Whether nothing recorded here stands against proving ``request_id`` to ``agent``
        (the caller checks that it is not live or still being released)."""
        ids = self._unproven.get(agent)
        if ids is None:
            return not self._lossy
        return request_id not in ids and agent not in self._incomplete

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._unproven.values())
