"""``inside(svc)``: what a test sees of a running ``TransferService`` beyond its API.

A service keeps its planes private: its public face is ``KVTransfer`` (``send``,
``expect``, ``status()``, ...).  A test of a failure path sometimes has to see more (is
the receiver's early expect held yet? which link does the sender hold to that peer?)
or push on it (drop a link as a reset would, hear what a peer was told).  Such a test
reads it here rather than through the service's private attributes: this module lives
next to the code it reads and changes with it, so a renamed table breaks one file, not
sixty tests.

What is here, all of it on a started service (``async with``):

* the tables: ``plane`` (the request plane: ``sends``, ``recvs``, ``sends_done``,
  ``recvs_done``, ``ends.outcomes``), ``early`` (expects held before any ``send()``;
  ``in`` and ``len``), ``control`` (the control plane: links and their keys);
* a peer: ``link(agent)``, ``drop_link(agent, cause)`` (as a reset of the connection
  ends it), ``notif_key_to``/``notif_keys_from`` (the keys its notifications are
  sealed with);
* the service itself: ``started``, ``door`` (its NIXL door, or the fake's), ``vetter``
  (the child that vets peers' NIXL metadata), ``metadata`` (its own, as every peer holds
  it), ``task_group`` (to crash it: cancel and exit the group);
* pushes: ``heard()`` records every control message the service hears from then on;
  ``advertise(address)`` and ``join_with(metadata=...)`` make it claim what a
  misconfigured or hostile service claims.

``inside_engine(engine)`` is the same for the engine facade (``kvservice.engine``): its
loop, its thread, the service it runs, and where each of its transfers stands.

The names and what they return may change with the service (``kvservice.testing``'s
stable part is its ``__all__``); the point is that they change here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio.abc
import msgspec

from .._results import KVServiceError
from .._transfer.inbound import Inbound

if TYPE_CHECKING:
    from .._control.handshakes import Handshakes
    from .._control.links import PeerLink
    from .._control.plane import ControlPlane
    from .._nixl.door import Door
    from .._service import TransferService
    from .._transfer.early import EarlyExpects
    from .._transfer.plane import RequestPlane
    from .._trust.vetting import MetadataVetter
    from ..engine import KVReceiver, KVSender, KVTransferEngine

__all__ = ["EngineInside", "Inside", "inside", "inside_engine"]


def inside(svc: TransferService) -> Inside:
    """The view of ``svc``'s insides a test may read (``svc`` started)."""
    return Inside(svc)


@dataclass(frozen=True, slots=True)
class Inside:
    """A started ``TransferService``'s private state, for tests: see the module's doc."""

    svc: TransferService

    @property
    def started(self) -> bool:
        """Whether the service has started (its planes, door and task group exist); they stay
        readable after it ends."""
        return self.svc._plane is not None

    @property
    def task_group(self) -> anyio.abc.TaskGroup:
        """The group every task of the service runs in: a test that crashes the service
        cancels it and exits it, without the service's own shutdown."""
        tg = self.svc._tg
        if tg is None:
            raise KVServiceError("the service has no task group until it has started ('async with')")
        return tg

    # -- tables ------------------------------------------------------------------------------
    @property
    def plane(self) -> RequestPlane:
        """The request plane: every request's table and ledger."""
        plane = self.svc._plane
        if plane is None:
            raise KVServiceError("the service has no request plane until it has started ('async with')")
        return plane

    @property
    def control(self) -> ControlPlane:
        """The control plane: listeners, links, and what each peer was proven to be."""
        return self.plane.control

    @property
    def early(self) -> EarlyExpects:
        """Expects a receiver sent before this side's ``send()``: ``rid in early``, ``len(early)``,
        ``early.pages``."""
        return self.plane.early

    @property
    def handshakes(self) -> Handshakes:
        """The handshakes: what each linked agent was proven to be (its member, with identities)."""
        return self.control._handshakes

    def agents_remembered(self) -> set[str]:
        """Every agent a per-agent table of this service still holds: the notification keys
        kept for agents not linked, the proofs ledger, the heal's records, the door's loaded
        agents, linked or kept after a lost link (what must shrink back once an agent is gone
        for good)."""
        inbound = self.plane.inbound
        assert isinstance(inbound, Inbound)
        heal = inbound._heal
        return (set(self.control._notif_in) | set(self.plane.watchdog.proofs._unproven)
                | set(heal._lost_at) | set(heal._answered) | set(getattr(self.door, "_peers", {}))
                | set(getattr(self.door, "_kept", ())))

    # -- a peer ------------------------------------------------------------------------------
    def link(self, agent: str) -> PeerLink | None:
        """The link this service holds to ``agent`` now, if any."""
        peer = self.control._peers.get(agent)
        return peer.link if peer is not None else None

    def drop_link(self, agent: str, cause: BaseException) -> None:
        """End the link to ``agent`` as a failed connection would, ``cause`` its error."""
        self.control.drop_peer(agent, cause)

    def notif_key_to(self, agent: str) -> bytes | None:
        """The key this service seals its notifications to ``agent`` with (None: not linked)."""
        return self.control.notif_key_to(agent)

    def notif_keys_from(self, agent: str) -> list[bytes]:
        """The keys a notification from ``agent`` may be sealed with."""
        return self.control.notif_keys_from(agent)

    # -- the service itself ------------------------------------------------------------------
    @property
    def door(self) -> Door:
        """The service's door to NIXL (a ``FakeDoor`` under ``door_factory=fabric.factory``)."""
        door = self.svc._door
        if door is None:
            raise KVServiceError("the service has no door until it has started ('async with')")
        return door

    @property
    def vetter(self) -> MetadataVetter:
        """The child process that loads peers' NIXL metadata before the service's agent does."""
        vetter = self.svc._vetter
        if vetter is None:
            raise KVServiceError("this service vets no metadata (not started, or a fake door)")
        return vetter

    @property
    def metadata(self) -> bytes:
        """The service's own NIXL metadata, as every peer it links with is given it."""
        return self.control._local.join.metadata

    # -- pushes ------------------------------------------------------------------------------
    def heard(self) -> list[Any]:
        """Every control message the service hears from now on (each still handled as before):
        what a test's own service was told by the peer under test."""
        heard: list[Any] = []
        inbound = self.plane.inbound
        on_message = inbound.on_message

        def recording(agent: str, msg: Any) -> None:
            heard.append(msg)
            on_message(agent, msg)

        inbound.on_message = recording  # type: ignore[method-assign]  # the one seam for hearing
        return heard

    def advertise(self, address: str) -> None:
        """Make the service claim ``address`` in its Hellos from now on, as a misconfigured or
        hostile service does (its listener stays where it is)."""
        self.control.address = address

    def join_with(self, *, metadata: bytes) -> None:
        """Make the service hand ``metadata`` to peers in its Join from now on, in place of its
        own: a peer that lies about its agent."""
        local = self.control._local
        self.control._local = dataclasses.replace(local, join=msgspec.structs.replace(local.join, metadata=metadata))


def inside_engine(engine: KVTransferEngine) -> EngineInside:
    """The view of a ``KVTransferEngine``'s insides a test may read (its loop thread, the
    service on it, and where each of its transfers stands)."""
    return EngineInside(engine)


@dataclass(frozen=True, slots=True)
class EngineInside:
    """A ``KVTransferEngine``'s private state, for tests: the engine facade's counterpart of
    ``Inside``."""

    engine: KVTransferEngine

    @property
    def service(self) -> TransferService:
        """The service the engine runs (``inside(...)`` reads on into it)."""
        svc = self.engine._svc
        if svc is None:
            raise KVServiceError("the engine runs no service until it has started")
        return svc

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop of the engine's own thread."""
        loop = self.engine._loop
        if loop is None:
            raise KVServiceError("the engine has no loop until it has started")
        return loop

    @property
    def thread(self) -> threading.Thread | None:
        """The engine's loop thread (None before ``start``); it has ended once ``start`` failed
        or the engine closed."""
        return self.engine._thread

    @staticmethod
    def sent(transfer: KVSender) -> bool:
        """Whether the sender's first ``send`` has reached the service (it holds a handle)."""
        return transfer._handle is not None

    @staticmethod
    def handed_over(transfer: KVSender | KVReceiver) -> bool:
        """Whether the service holds the request and no operation of it waits on the loop."""
        return transfer._owned and not transfer._running
