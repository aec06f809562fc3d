"""``Matching``: sends meet the receivers' Expects that came before them.

A receiver's Expect may reach the sender before the ``send()`` of its id: the plane holds
it (``early.EarlyExpects``) until the first send, which binds to the first Expect from a
peer that may receive it (any peer, or for a pinned send the agent proven to answer at
its address), refuses those from peers proven not to, and waits for the proof of the
rest.  An Expect dropped before any send (its peer lost, it timed out, the receiver
aborted or declined it) is remembered in the plane's ``dropped`` table, and the send
that comes later fails at once with its reason.

The tables and the transitions (``bind``, ``fail``) stay the plane's: this module holds
the rules of the meeting, and reaches the plane through ``Plane``, the part of
``plane.RequestPlane`` it uses.  Everything here runs on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import anyio.abc
import numpy as np
import numpy.typing as npt

from .._control.plane import ControlPlane
from .._control.protocol import Failed, Message, Settled, text
from .._log import get_logger
from .._results import FailureReason
from .._stats import Stats
from ..memory._layout import PageIndex
from .early import EarlyExpects
from .requests import Recent, SendRequest

log = get_logger("kvservice")

#: the "agent" of a dropped-expect record made by this service's own ``abort()``
LOCAL = ""

#: request id -> {agent: (why its expect was dropped, the addresses it was proven at, the
#: original error of that drop: a lost link's, when there was one)}
Dropped = Recent[str, dict[str, tuple[FailureReason, frozenset[str], BaseException | None]]]


class Plane(Protocol):
    """What matching uses of the request plane (``plane.RequestPlane``)."""

    @property
    def stats(self) -> Stats: ...
    @property
    def tg(self) -> anyio.abc.TaskGroup: ...
    @property
    def control(self) -> ControlPlane: ...
    @property
    def closing(self) -> bool: ...
    @property
    def sends(self) -> dict[str, SendRequest]: ...
    @property
    def early(self) -> EarlyExpects: ...
    @property
    def dropped(self) -> Dropped: ...
    def bind(self, req: SendRequest, peer: str, pages: npt.NDArray[np.int32], verify: bool = False) -> None: ...
    def fail(self, req: SendRequest, reason: FailureReason, message: str, *, error: BaseException | None) -> None: ...
    def send_to(self, agent: str, msg: Message) -> None: ...


class Matching:
    """The plane's rules for sends meeting early Expects; see the module docstring."""

    def __init__(self, plane: Plane) -> None:
        self._p = plane

    # -- what the service asks -------------------------------------------------------------
    def early_pages(self, request_id: str) -> PageIndex | None:
        """The pages the first early Expect for ``request_id`` reserved, if one waits."""
        early = self._p.early
        agents = early.agents(request_id)
        return early.pages_of(request_id, agents[0]) if agents else None

    def dropped_expect(self, request_id: str) -> tuple[FailureReason, str] | None:
        """Why an expect for ``request_id`` was dropped before any send, and whose (the
        addresses its peer was proven at, else its agent); None when none was."""
        dropped = self._p.dropped.get(request_id)
        if not dropped:
            return None
        agent, (reason, proven, _) = next(iter(dropped.items()))
        return reason, _whose(agent, proven)

    # -- sends meet receivers ----------------------------------------------------------------
    def may_receive(self, req: SendRequest, agent: str) -> bool | None:
        """Whether ``agent`` may receive ``req``: any peer unless it is pinned; then only
        the agent proven to answer at that address (None: not proven either way yet)."""
        if req.receiver is None:
            return True
        return self._p.control.at_address(agent, req.receiver)

    def refuse_receiver(self, req: SendRequest, agent: str) -> None:
        """``agent`` is not the receiver ``req`` is pinned to: it is told (``REFUSED``) and it is counted."""
        if (unlogged := self._p.stats.refuse("receiver_mismatch")) is not None:
            log.warning("transfer.expect_refused", request_id=req.request_id, agent=agent, receiver=req.receiver,
                        unlogged=unlogged)
        self.refuse_expect(agent, req.request_id, FailureReason.REFUSED, "the request is pinned to another receiver")

    def refuse_expect(self, agent: str, rid: str, reason: FailureReason, message: str) -> None:
        """Tell ``agent`` its Expect for ``rid`` is refused; nothing of ours was or will be
        written there for it, so it is settled too (unless ``rid`` is bound to that agent)."""
        p = self._p
        p.send_to(agent, Failed(rid, reason.value, text(message)))
        bound = p.sends.get(rid)
        if bound is None or bound.peer != agent:
            p.send_to(agent, Settled(rid))

    def after_proof(self, agent: str, canon: str, then: Callable[[], None],
                    finally_: Callable[[], None] | None = None) -> None:
        """Prove whether ``agent`` answers at ``canon`` (one probe, shared), then call
        ``then`` if its link is still the one that asked; ``finally_`` in any case."""
        p = self._p
        control = p.control
        generation = control.generation_of(agent)

        async def prove() -> None:
            try:
                await control.prove_address(agent, canon)
            finally:
                if finally_ is not None:
                    finally_()
            if control.generation_of(agent) == generation and not p.closing:
                then()

        p.tg.start_soon(prove)

    def early_dest(self, rid: str, receiver: str | None) -> npt.NDArray[np.int32] | None:
        """The pages of the early Expect that a send of ``rid`` (pinned to ``receiver``) would bind."""
        early, control = self._p.early, self._p.control
        for agent in early.agents(rid):
            if receiver is None or control.at_address(agent, receiver):
                return early.pages_of(rid, agent)
        return None

    def match_early(self, req: SendRequest) -> None:
        """A new (or still unbound) send meets the Expects that came before it: the first
        from a peer that may receive it binds it; those from peers proven not to are
        refused; an Expect such a peer dropped fails it; the rest wait for their proof."""
        if req.result is not None or req.peer is not None:
            return
        p = self._p
        rid = req.request_id
        unknown: list[str] = []
        for agent in p.early.agents(rid):
            ok = self.may_receive(req, agent)
            if ok is None:
                unknown.append(agent)
                continue
            verify = p.early.verifies(rid, agent)
            pages = p.early.pop(rid, agent)
            assert pages is not None
            if ok:
                p.bind(req, agent, pages, verify)
                return
            self.refuse_receiver(req, agent)
        dropped = p.dropped.get(rid) or {}
        for agent, (reason, proven, cause) in list(dropped.items()):
            if agent == LOCAL or req.receiver is None or req.receiver in proven:
                del dropped[agent]
                why = f"the receiver's expect was dropped before this send ({_whose(agent, proven)})"
                if agent != LOCAL:  # the result names the receiver
                    req.peer_address = min(proven) if proven else agent
                p.fail(req, reason, f"{why}: {cause!r}" if cause is not None else why, error=cause)
                return
        for agent in unknown:
            assert req.receiver is not None
            self.after_proof(agent, req.receiver, lambda: self.match_early(req))

    def drop_expect(self, rid: str, agent: str, why: FailureReason, cause: BaseException | None = None,
                    proven: frozenset[str] | None = None) -> None:
        """Remember that ``agent``'s Expect for ``rid`` (not sent yet) was dropped (``cause``:
        the original error, a lost link's, which the send that comes later fails with;
        ``proven``: the addresses it was proven at, when its link is gone already)."""
        p = self._p
        dropped = p.dropped.get(rid)
        if dropped is None:
            dropped = {}
            p.dropped.put(rid, dropped)
        dropped[agent] = (why, p.control.proven_addresses(agent) if proven is None else proven, cause)


def _whose(agent: str, proven: frozenset[str]) -> str:
    """Whose dropped expect it was, as a send's failure names it."""
    return "this service's abort()" if agent == LOCAL else ", ".join(sorted(proven)) or agent
