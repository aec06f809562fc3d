"""Settlement: when a failed request's pages are safe to reuse.

A WRITE already posted keeps copying after the receiver gives up on a request;
nothing on the receiving side can recall it.  So a receiver's failed request is
*unsettled* until one of these proves no WRITE of it can land any more:

* the sender's *fence* arrives: after its door released every handle of the
  request, the sender posts one more page WRITE to us on the same NIXL endpoint
  with a ``FENCE`` notification.  NIXL sends a WRITE's notification only after
  flushing the endpoint, so every earlier WRITE, released or not, has landed by
  then (a release alone proves nothing: it does not stop a zero-copy WRITE
  already under way, measured here);
* the sender says ``Settled`` over the control link when nothing of the request
  was ever posted (unknown there, refused, or not sent yet), or when it had
  completed it (then the receiver's result becomes that ``SUCCESS``);
* the sender's process is gone: its link closed and NIXL reports its endpoint
  disconnected, or its address refuses connections, or a new incarnation
  holds its address.

A sender that hangs (SIGSTOP) and later resumes settles nothing by re-linking:
its released WRITE may still be running on the old endpoint, and nothing in
NIXL's API shows when it stops.  What it held settles when its process exits.

A successful arrival is settled by definition.  On the sending side a failure
is settled once the watchdog has seen the door release every handle of it.
This module keeps the receiving side's unsettled requests, counts their pages,
and wakes ``await_settled`` callers; the service decides when to settle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import anyio

from ._requests import Recent
from ._results import FailureReason, TransferResult, TransferStatus


@dataclass(slots=True)
class _Held:
    agent: str  # the sender that may still write
    pages: int


class Settlement:
    def __init__(self, recvs_done: Recent[str, TransferResult], sends_done: Recent[str, TransferResult]) -> None:
        self._recvs_done = recvs_done
        self._sends_done = sends_done
        self._held: dict[str, _Held] = {}  # receiver request id -> who may still write
        self._waiters: dict[tuple[str, str], anyio.Event] = {}  # (side, request id)
        self.unsettled_pages = 0

    # -- receiving side ------------------------------------------------------------------
    def hold(self, request_id: str, agent: str, pages: int) -> None:
        """A receiver's request failed while ``agent`` may still be writing into ``pages`` pages."""
        self._held[request_id] = _Held(agent, pages)
        self.unsettled_pages += pages

    def held_by(self, agent: str) -> bool:
        return any(h.agent == agent for h in self._held.values())

    def settle_recv(self, request_id: str, agent: str | None = None, *, sender_ok: bool = False) -> bool:
        """Settle a held request (only if ``agent`` is its sender, when given).  With
        ``sender_ok`` the sender completed it: an abort here lost the race with the last
        chunk, every page landed, and the result becomes SUCCESS so both sides agree.  A
        refusal of what arrived (``INCOMPATIBLE``: a payload over ``max_payload_bytes``)
        stands: the sender's request completed, this side's did not."""
        held = self._held.get(request_id)
        if held is None or (agent is not None and held.agent != agent):
            return False
        del self._held[request_id]
        self.unsettled_pages -= held.pages
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
        return True

    def settle_agent(self, agent: str) -> int:
        """Settle everything ``agent`` held; how many requests."""
        rids = [rid for rid, held in self._held.items() if held.agent == agent]
        for rid in rids:
            self.settle_recv(rid)
        return len(rids)

    def settle_all(self) -> int:
        """Settle everything held (this service is leaving and its NIXL agent is gone)."""
        return sum(self.settle_agent(agent) for agent in sorted({h.agent for h in self._held.values()}))

    # -- sending side ---------------------------------------------------------------------
    def settled_send(self, result: TransferResult) -> TransferResult:
        """The sender's failed ``result``, now that the door released every handle of it."""
        settled = dataclasses.replace(result, settled=True)
        if self._sends_done.get(result.request_id) is not None:
            self._sends_done.put(result.request_id, settled)
        self._wake("send", result.request_id)
        return settled

    # -- waiting ----------------------------------------------------------------------------
    async def wait(self, side: str, request_id: str, timeout: float | None) -> None:
        """Until ``request_id`` (on ``side``) settles, or ``timeout`` passes."""
        key = (side, request_id)
        event = self._waiters.get(key)
        if event is None:
            event = self._waiters[key] = anyio.Event()
        try:
            with anyio.move_on_after(timeout):
                await event.wait()
        finally:
            if self._waiters.get(key) is event and not event.is_set():
                del self._waiters[key]

    def _wake(self, side: str, request_id: str) -> None:
        event = self._waiters.pop((side, request_id), None)
        if event is not None:
            event.set()
