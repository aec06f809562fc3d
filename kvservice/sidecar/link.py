"""``WorkerLink``: a ``SidecarClient``'s connection to its daemon, below the API.

It numbers calls and matches each reply to its caller (``call``), reads every frame the
daemon sends (``read``: replies, ``Finished`` frames that end requests, ``Bye``), and
keeps what the client knows of this worker's requests: the live ones by (side, id) and
the ``results_kept`` most recent ended ones.  When the connection ends, every unfinished
request ends ``Failed`` (``SHUTDOWN`` after a Bye, else ``PEER_LOST``) and every waiting
call wakes; later calls raise ``KVServiceError``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import anyio

from .._control.links import CONNECTION_ERRORS
from .._control.protocol import FrameError
from .._results import FailureReason, KVServiceError, ProtocolError, TransferResult, TransferStatus, UnknownRequestError
from .._transfer.requests import Recent
from .frames import SocketFrames
from .handle import CallSlot, RequestState
from .owners import NotOwnerError
from .wire import (
    Bye,
    Call,
    Cancel,
    Error,
    Finished,
    ServerMessage,
    Welcome,
    call_refusal,
    result_from_wire,
)

#: the exceptions a daemon's ``Error`` reply names, raised here as themselves
_ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "UnknownRequestError": UnknownRequestError,
    "KVServiceError": KVServiceError,
    "ProtocolError": ProtocolError,
    "NotOwnerError": NotOwnerError,
}

_READ_ERRORS: tuple[type[BaseException], ...] = (FrameError, *CONNECTION_ERRORS)
_SEND_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, *CONNECTION_ERRORS)
#: a daemon that does not take a frame within this long is treated as gone
SEND_TIMEOUT_S = 30.0

Key = tuple[str, str]  # (side, request id): side "send" or "recv"


class Lost(KVServiceError):
    """The connection to the sidecar is gone (the daemon exited or closed it).

    Raised by every call made after the loss; the waits answer the result they already
    hold instead.  Not exported: callers catch ``KVServiceError`` and reconnect."""


class WorkerLink:
    """One worker's connection: ``framed`` once connected (``SidecarClient.__aenter__``)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.framed: SocketFrames[ServerMessage] | None = None
        self.welcome: Welcome | None = None
        self.live: dict[Key, RequestState] = {}
        self.done: Recent[Key, RequestState] = Recent(10_000)  # results_kept, once welcomed
        self.lost: str | None = None  #: why the connection ended (None while it lasts)
        self.lost_event: anyio.Event | None = None
        self._calls: dict[int, CallSlot] = {}
        self._ids = itertools.count(1)
        self._graceful = False

    def connected(self, framed: SocketFrames[ServerMessage], welcome: Welcome) -> None:
        self.framed, self.welcome = framed, welcome
        self.done = Recent(welcome.results_kept)
        self.lost_event = anyio.Event()

    async def call(self, make: Callable[[int], Call]) -> ServerMessage:
        """Send the call ``make(number)`` and return its reply (an ``Error`` reply raised)."""
        if self.framed is None:
            raise KVServiceError("not connected (use 'async with SidecarClient(...)')")
        if self.lost is not None:
            raise Lost(f"sidecar connection lost: {self.lost}")
        n = next(self._ids)
        msg = make(n)
        if self.welcome is not None and (why := call_refusal(msg, self.welcome.version)) is not None:
            raise KVServiceError(f"the sidecar at {self.socket_path}: {why}: upgrade the daemon")  # nothing sent
        slot = self._calls[n] = CallSlot()
        try:
            await self.framed.send(msg, SEND_TIMEOUT_S, shield=True)  # never half a frame on the socket
            await slot.done
        except anyio.get_cancelled_exc_class():
            if slot.reply is None and self.lost is None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                    await self.framed.send(Cancel(n))
            raise
        except _SEND_ERRORS as exc:  # the reader may not have seen the end yet
            self.on_lost(f"connection error: {exc!r}", FailureReason.PEER_LOST)
            raise Lost(f"sidecar connection lost: {exc!r}") from exc
        finally:
            self._calls.pop(n, None)
        reply = slot.reply
        if reply is None:
            raise Lost(f"sidecar connection lost: {self.lost}")
        if isinstance(reply, Error):
            raise _ERRORS.get(reply.kind, KVServiceError)(reply.message)
        return reply

    async def read(self) -> None:
        """Read the daemon's frames until the connection ends (the client's reader task)."""
        assert self.framed is not None
        why = "the sidecar closed the connection"
        try:
            while True:
                msg = await self.framed.recv()
                if isinstance(msg, Finished):
                    self._on_finished(msg)
                elif isinstance(msg, Bye):
                    self._graceful = True
                    why = f"the sidecar shut down: {msg.message}"
                    return
                elif isinstance(msg, Error) and msg.call == 0:
                    why = f"the sidecar dropped us: {msg.kind}: {msg.message}"
                    return
                elif not isinstance(msg, Welcome):
                    slot = self._calls.get(msg.call)
                    if slot is not None:
                        slot.answer(msg)
        except _READ_ERRORS as exc:
            why = f"connection error: {exc!r}"
        finally:
            self.on_lost(why, FailureReason.SHUTDOWN if self._graceful else FailureReason.PEER_LOST)

    def _on_finished(self, msg: Finished) -> None:
        result = result_from_wire(msg.result)
        key = (msg.side, result.request_id)
        req = self.live.get(key)
        if req is None:
            req = RequestState(result.request_id, msg.side)
            self.done.put(key, req)
        self.finish(req, result)

    def finish(self, req: RequestState, result: TransferResult) -> None:
        """``req`` ended with ``result`` (the first result it gets stays)."""
        if req.result is not None:
            return
        req.result = result
        req.done.set()
        key = (req.side, req.request_id)
        if self.live.get(key) is req:
            del self.live[key]
        self.done.put(key, req)

    def on_lost(self, why: str, reason: FailureReason) -> None:
        """The connection ended: fail what is unfinished, wake every waiting call."""
        if self.lost is not None:
            return
        self.lost = why
        now = time.monotonic()
        for req in list(self.live.values()):
            self.finish(req, TransferResult(
                request_id=req.request_id, status=TransferStatus.FAILED, reason=reason,
                message=why, created_at=req.created, finished_at=now))
        for slot in self._calls.values():
            slot.answer(None)
        if self.lost_event is not None:
            self.lost_event.set()
