"""One worker's connection to the sidecar, and the server's counters."""

from __future__ import annotations

import asyncio
import collections
import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import anyio.abc

from .._log import Throttle
from .._results import TransferResult
from .._transfer.requests import Recent, TransferHandle
from .._trust.peercred import PeerCred
from .frames import SocketFrames
from .owners import Key
from .wire import SIDECAR_PROTOCOL_VERSION, ClientMessage, Finished

#: refusal kinds that end a connection before its Welcome, and kinds that are a bad frame:
#: ``kvservice_sidecar_connections_refused_total`` and ``..._frames_rejected_total``
CONNECTION_REFUSALS = ("uid", "too_many_workers", "draining", "hello_invalid", "hello_timeout", "hello_incomplete")
FRAME_REFUSALS = ("hello_invalid", "frame")


@dataclass(eq=False)
class Connection:
    number: int
    framed: SocketFrames[ClientMessage]
    #: who connected (SO_PEERCRED); None where the kernel could not say (then refused)
    cred: PeerCred | None
    #: this worker's send handles: ended ones while results are kept (unfinished: ``sending``)
    sent: Recent[str, TransferHandle]
    #: the name the worker gave in its Hello, for logs
    client: str = ""
    #: the protocol version agreed in the Welcome
    version: int = SIDECAR_PROTOCOL_VERSION
    tg: anyio.abc.TaskGroup | None = None
    calls: dict[int, anyio.CancelScope] = field(default_factory=dict)
    sending: dict[str, TransferHandle] = field(default_factory=dict)
    #: the service's futures of the requests this worker sent or expected that have not
    #: ended, by owner key (``WorkerCalls.watch``); cancelled when the worker goes
    watched: dict[Key, asyncio.Future[TransferResult]] = field(default_factory=dict)
    #: the watched futures' done callbacks, one per side (a callable each, not one per request)
    on_end: dict[str, Callable[[asyncio.Future[TransferResult]], None]] = field(default_factory=dict)
    #: the context those callbacks run in (one for all: none copied per request)
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    #: Finished frames for the pusher (``SidecarServer._pusher``) to write, in the order
    #: their requests ended.  Bounded as the watched requests are: one frame per request
    #: this worker started that ended since the pusher's last write (a request is watched
    #: once, when ``owners.claim`` makes it the worker's; the service holds at most
    #: ``max_live_requests``), no more than a waiting task per request held before; a
    #: worker that does not take them within ``PUSH_TIMEOUT_S`` is dropped, outbox and all
    outbox: list[Finished] = field(default_factory=list)
    #: set by ``finish`` when the pusher waits on an empty outbox
    wake: anyio.Event | None = None
    #: requests watched whose Finished frame is not written yet (``idle`` set at 0)
    watching: int = 0
    idle: anyio.Event = field(default_factory=anyio.Event)
    closed: bool = False

    @property
    def pid(self) -> int | None:
        return self.cred.pid if self.cred else None

    def handle(self, request_id: str) -> TransferHandle | None:
        return self.sending.get(request_id) or self.sent.get(request_id)

    def finish(self, msg: Finished) -> None:
        """Queue a Finished frame for the pusher, and wake it."""
        self.outbox.append(msg)
        wake = self.wake
        if wake is not None:
            self.wake = None
            wake.set()

    def unwatched(self, n: int) -> None:
        """``n`` watched requests are done with: their frames written, or nobody to tell."""
        self.watching -= n
        if not self.watching:
            self.idle.set()

    def unwatch_all(self) -> None:
        """The worker is gone: cancel the futures still watched, so nothing of the service
        keeps this connection (their callbacks only count them off).  One already done
        keeps its entry: its callback, due to run, ends its request's bookkeeping."""
        for key, future in list(self.watched.items()):
            if future.cancel():
                del self.watched[key]

    def close(self) -> None:
        self.closed = True
        self.idle.set()  # nothing more to flush: ``SidecarServer.close`` moves on
        if self.tg is not None:
            self.tg.cancel_scope.cancel()


@dataclass
class ServerCounters:
    connections_total: int = 0
    aborted_on_disconnect_total: int = 0
    #: what workers tried and were refused, by kind (docs/sidecar.md, "Security")
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    calls: collections.Counter[str] = field(default_factory=collections.Counter)
    #: refusals are all counted, logged at most ``Throttle``'s burst per kind and window
    log_throttle: Throttle = field(default_factory=Throttle)

    @property
    def connections_refused_total(self) -> int:
        return sum(self.refused[k] for k in CONNECTION_REFUSALS)

    @property
    def frames_rejected_total(self) -> int:
        return sum(self.refused[k] for k in FRAME_REFUSALS)
