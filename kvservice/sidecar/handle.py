"""Client-side request state, and ``SidecarHandle``: what ``SidecarClient.send`` returns."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import anyio

from .._results import KVPoll, TransferResult
from .._transfer.requests import HandleBase
from .wire import ServerMessage


@dataclass(eq=False)
class RequestState:
    request_id: str
    side: str  # "send" | "recv"
    created: float = field(default_factory=time.monotonic)
    poll: KVPoll = KVPoll.Bootstrapping
    result: TransferResult | None = None
    done: anyio.Event = field(default_factory=anyio.Event)


class CallSlot:
    """One call in flight: ``done`` resolves when its reply came (``reply``) or the
    connection ended (``reply`` still None).  A bare loop future: a call is awaited once,
    by its caller, and a future is one object where an ``anyio.Event`` is three."""

    __slots__ = ("done", "reply")

    def __init__(self) -> None:
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.reply: ServerMessage | None = None

    def answer(self, reply: ServerMessage | None) -> None:
        """Wake the caller (a caller cancelled meanwhile has gone: nothing to wake)."""
        if not self.done.done():
            self.reply = reply
            self.done.set_result(None)


class SidecarHandle(HandleBase):
    """The sending side's view of one request through the sidecar; the same
    interface as ``TransferHandle``.  ``poll()`` shows the state the daemon
    reported with the latest ``send()`` until the request ends."""

    __slots__ = ("_req",)

    def __init__(self, req: RequestState) -> None:
        self._req = req

    @property
    def request_id(self) -> str:
        return self._req.request_id

    @property
    def result(self) -> TransferResult | None:
        return self._req.result

    def _pending_poll(self) -> KVPoll:
        return self._req.poll

    def _done(self) -> anyio.Event:
        return self._req.done
