"""The interface every layer above NIXL speaks, and the one thread it runs on.

``Door`` is a small synchronous interface over a NIXL agent.  ``_nixl.NixlDoor``
implements it with the real library; unit tests script a fake.  Whatever the
implementation, three rules hold and are enforced by the door itself:

* **One thread.**  Every door method runs on the single ``DoorThread``.  NIXL
  calls can block for the whole copy (a post on the default transport copies
  before it returns), so none runs on the event loop, and since they all run
  on one thread no two of them ever race on a handle.
* **Handles are released exactly once.**  The door owns every transfer handle in
  a table keyed by an integer ``XferId``.  A handle leaves the table, and is
  released, when it reaches a terminal state (``DONE`` or an error) or on
  ``release()``.  Any later use of that id is answered from the table
  (``GONE``) without touching NIXL, which would segfault on a released handle.
* **Failures are values.**  NIXL exceptions become ``DoorError`` carrying a
  ``FailureReason`` and the original exception; nothing else is caught.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from ._results import FailureReason

XferId = int
T = TypeVar("T")


class XferState(enum.Enum):
    DONE = "DONE"  # complete; the handle has been released
    PROC = "PROC"  # in flight
    GONE = "GONE"  # not in the door's table (already released)


class DoorError(Exception):
    """A NIXL call failed.  ``reason`` classifies it; ``original`` is NIXL's exception."""

    def __init__(self, reason: FailureReason, original: BaseException, op: str) -> None:
        super().__init__(f"{op}: {type(original).__name__}: {original}")
        self.reason = reason
        self.original = original
        self.op = op


class Door(Protocol):
    """What kvservice needs from NIXL.  All methods run on the door thread."""

    agent_name: str

    def metadata(self) -> bytes: ...

    def register_pool(self, tensor: Any, table: npt.NDArray[np.uint64]) -> None:
        """Register the KV pool and prepare its descriptor table as the local side."""

    def add_peer(self, name: str, metadata: bytes, table: npt.NDArray[np.uint64]) -> None:
        """Load a peer agent (replacing one of that name) and prepare its pool table."""

    def remove_peer(self, name: str) -> list[XferId]:
        """Release every handle to ``name``, then unload it.  Returns the released ids."""

    def post(
        self, peer: str, local_idx: npt.NDArray[np.int32], remote_idx: npt.NDArray[np.int32],
        notif: bytes,
    ) -> tuple[XferId, XferState]:
        """Create and post a WRITE.  Raises ``DoorError`` (nothing left behind)."""

    def check(self, xfer: XferId) -> XferState:
        """State of a handle; raises ``DoorError`` (and releases it) on failure."""

    def release(self, xfer: XferId) -> bool:
        """Release an in-flight handle (cancels it).  False if it was already gone."""

    def notifs(self) -> Mapping[str, list[bytes]]:
        """Drain notifications received since the last call, by sender agent name."""

    def send_notif(self, peer: str, message: bytes) -> None: ...

    def live_xfers(self) -> int: ...

    def close(self) -> None:
        """Release everything and drop the agent.  Idempotent."""


@dataclass(slots=True)
class PostOp:
    key: Any  # the caller's token, echoed in the outcome
    peer: str
    local_idx: npt.NDArray[np.int32]
    remote_idx: npt.NDArray[np.int32]
    notif: bytes


@dataclass(slots=True)
class TickPlan:
    posts: list[PostOp] = field(default_factory=list)
    checks: list[XferId] = field(default_factory=list)
    releases: list[XferId] = field(default_factory=list)


@dataclass(slots=True)
class TickOutcome:
    posted: list[tuple[Any, XferId | DoorError, XferState | None]] = field(default_factory=list)
    checked: list[tuple[XferId, XferState | DoorError]] = field(default_factory=list)
    notifs: Mapping[str, list[bytes]] = field(default_factory=dict)
    live: int = 0


def run_tick(door: Door, plan: TickPlan) -> TickOutcome:
    """One watchdog round trip: releases, then posts, then checks, then notifications.

    Runs on the door thread, so the event loop pays one thread hop per tick
    however many handles it covers.
    """
    out = TickOutcome()
    for xfer in plan.releases:
        door.release(xfer)
    for op in plan.posts:
        try:
            xid, state = door.post(op.peer, op.local_idx, op.remote_idx, op.notif)
        except DoorError as err:
            out.posted.append((op.key, err, None))
        else:
            out.posted.append((op.key, xid, state))
    for xfer in plan.checks:
        try:
            out.checked.append((xfer, door.check(xfer)))
        except DoorError as err:
            out.checked.append((xfer, err))
    out.notifs = door.notifs()
    out.live = door.live_xfers()
    return out


class DoorThread:
    """Runs door calls, in order, on one dedicated thread.

    A caller cancelled while its call runs does not stop the call: it finishes
    on the thread, and whatever it created stays in the door's tables, where
    ``Door.close()`` (queued behind it) finds and releases it.
    """

    def __init__(self, name: str = "kvservice-nixl") -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._thread_ident: int | None = None
        self._pool.submit(self._remember_thread).result()

    def _remember_thread(self) -> None:
        self._thread_ident = threading.get_ident()

    @property
    def thread_ident(self) -> int | None:
        return self._thread_ident

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """For use off the event loop (shutdown paths, tests)."""
        return self._pool.submit(fn, *args).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
