"""One worker's connection to the sidecar, and the server's counters."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import anyio
import anyio.abc

from .._log import Throttle
from .._transfer.requests import Recent, TransferHandle
from .._trust.peercred import PeerCred
from .wire import SIDECAR_PROTOCOL_VERSION, ClientMessage, SocketFrames

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
    watching: int = 0
    idle: anyio.Event = field(default_factory=anyio.Event)
    closed: bool = False

    @property
    def pid(self) -> int | None:
        return self.cred.pid if self.cred else None

    def handle(self, request_id: str) -> TransferHandle | None:
        return self.sending.get(request_id) or self.sent.get(request_id)

    def close(self) -> None:
        self.closed = True
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
