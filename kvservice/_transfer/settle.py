"""Settlement: when a failed request's pages are safe to reuse.

A WRITE already posted keeps copying after the receiver gives up on a request;
nothing on the receiving side can recall it.  So a receiver's failed request is
*unsettled* until one of these proves no WRITE of it can land any more:

* the sender's *fence* arrives: once every WRITE of the request has ended (one of
  them not ``DONE``), the sender posts one more page WRITE to us on the same NIXL endpoint
  with a ``FENCE`` notification.  NIXL sends a WRITE's notification only after
  flushing the endpoint, so every earlier WRITE, released or not, has landed by
  then (a release alone proves nothing: it does not stop a zero-copy WRITE
  already under way, measured here);
* the sender says ``Settled`` over the control link when nothing of the request
  was ever posted (unknown there, refused, or not sent yet), or when it had
  completed it (then the receiver's result becomes that ``SUCCESS``);
* the sender's process is gone: its link closed and NIXL reports its endpoint
  disconnected, or the address this service dialled it at (proven, never one
  it merely claimed) refuses connections or answers as another agent, proven by
  that agent's handshake: a service closes its port only after its NIXL agent.

Every piece of that evidence is the sender's own: a fence or ``Settled`` counts
only from the agent the request is held by (its notification's MAC proves the
link it came on, ``_control.protocol.decode_notif``).

* the sender, linked again after a lost link (the same agent: the same process),
  answers this side's ``Ask`` with ``Settled`` for each request it can prove no
  WRITE of can land any more: every WRITE it posted for it reached ``DONE`` before
  its handle was let go, or it never posted one (``_transfer.proofs``, ``heal``).
  A new link by itself proves nothing: a handle released while in flight does not
  stop its zero-copy WRITE (measured: a resumed SIGSTOPped sender's released WRITE
  still landed after it re-linked), so what the sender cannot prove stays held
  until its process exits.

A successful arrival is settled by definition.  On the sending side a failure
is settled once the watchdog has seen the door release every handle of it.
This module keeps the receiving side's unsettled requests, counts their pages,
and wakes ``await_settled`` callers; the service decides when to settle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import anyio

from .._results import FailureReason, TransferResult, TransferStatus
from .history import Results


class Settlement:
    def __init__(self, recvs_done: Results, sends_done: Results) -> None:
        self._recvs_done = recvs_done
        self._sends_done = sends_done
        # (receiver request id, the sender incarnation that may still write) -> pages
        self._held: dict[tuple[str, str], int] = {}
        self._waiters: dict[tuple[str, str], set[anyio.Event]] = {}  # (side, request id) -> one per waiter
        self.unsettled_pages = 0
        #: called with a receiver's request id once it is settled (frees its staging range)
        self.on_settled: Callable[[str], None] | None = None

    # -- receiving side ------------------------------------------------------------------
    def hold(self, request_id: str, agent: str, pages: int) -> None:
        """A receiver's request failed while ``agent`` may still be writing into ``pages``
        pages.  The same id held again for the same sender adds up: one fence from it
        proves both."""
        key = (request_id, agent)
        self._held[key] = self._held.get(key, 0) + pages
        self.unsettled_pages += pages

    def held_by(self, agent: str) -> bool:
        return any(a == agent for _, a in self._held)

    def held_ids(self, agent: str) -> list[str]:
        """The request ids held for ``agent``, oldest first."""
        return [rid for rid, a in self._held if a == agent]

    def is_held(self, request_id: str) -> bool:
        return any(rid == request_id for rid, _ in self._held)

    def settle_recv(self, request_id: str, agent: str, *, sender_ok: bool = False) -> bool:
        """Settle a request held for sender ``agent``.  With ``sender_ok`` the sender
        completed it: an abort here lost the race with the last chunk, every page
        landed, and the result becomes SUCCESS so both sides agree.  A refusal of what
        arrived (``INCOMPATIBLE``: a payload over ``max_payload_bytes``) stands: the
        sender's request completed, this side's did not."""
        pages = self._held.pop((request_id, agent), None)
        if pages is None:
            return False
        self.unsettled_pages -= pages
        if self.is_held(request_id):  # another incarnation may still write into its pages
            return True
        result = self._recvs_done.get(request_id)
        if result is not None:
            if sender_ok and not result.ok and result.reason is not FailureReason.INCOMPATIBLE:
                result = dataclasses.replace(
                    result, status=TransferStatus.SUCCESS, reason=None, error=None, settled=True,
                    message=f"completed on the sender before {result.reason.value if result.reason else 'the failure'}"
                            " took effect: every page landed")
            else:
                result = dataclasses.replace(result, settled=True)
            self._recvs_done.put(request_id, result)
        self._wake("recv", request_id)
        if self.on_settled is not None:
            self.on_settled(request_id)
        return True

    def settle_agent(self, agent: str) -> int:
        """Settle everything ``agent`` held; how many requests."""
        rids = [rid for rid, a in self._held if a == agent]
        for rid in rids:
            self.settle_recv(rid, agent)
        return len(rids)

    def settle_all(self) -> int:
        """Settle everything held (this service is leaving and its NIXL agent is gone)."""
        return sum(self.settle_agent(agent) for agent in sorted({a for _, a in self._held}))

    # -- sending side ---------------------------------------------------------------------
    def settled_send(self, result: TransferResult) -> TransferResult:
        """The sender's failed ``result``, now that nothing of it holds it (``watchdog``)."""
        settled = dataclasses.replace(result, settled=True)
        if result.request_id in self._sends_done:
            self._sends_done.put(result.request_id, settled)
        self._wake("send", result.request_id)
        return settled

    # -- waiting ----------------------------------------------------------------------------
    async def wait(self, side: str, request_id: str, timeout: float | None) -> None:
        """Until ``request_id`` (on ``side``) settles, or ``timeout`` passes."""
        key = (side, request_id)
        event = anyio.Event()
        self._waiters.setdefault(key, set()).add(event)
        try:
            with anyio.move_on_after(timeout):
                await event.wait()
        finally:
            events = self._waiters.get(key)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiters[key]

    def _wake(self, side: str, request_id: str) -> None:
        for event in self._waiters.pop((side, request_id), ()):
            event.set()
