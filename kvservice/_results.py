"""Result values: how every transfer ends, and the exceptions the API raises.

Transport failures never raise out of the service: they end a transfer as a
``TransferResult`` with ``status=FAILED``, a ``FailureReason`` and the original
error.  Programming errors (bad arguments, unknown requests) raise at once.
"""

from __future__ import annotations

import builtins
import enum
from dataclasses import dataclass


class KVPoll(enum.IntEnum):
    """Poll states, numbered as SGLang's ``KVPoll`` so engines can map 1:1."""

    Failed = 0
    Bootstrapping = 1  # destination not known yet (receiver's ``expect`` not arrived)
    WaitingForInput = 2  # destination known, waiting for (more) chunks from the engine
    Transferring = 3  # at least one chunk is in flight
    Success = 4


class TransferStatus(enum.Enum):
    SUCCESS = "SUCCESS"
    FAILED = "FAILED"


class FailureReason(enum.Enum):
    """Why a transfer failed.  Stable names: they appear in logs and metrics."""

    REMOTE_DISCONNECT = "REMOTE_DISCONNECT"  # NIXL: the peer's endpoint went away
    BACKEND = "BACKEND"  # NIXL backend / UCX error
    CANCELLED = "CANCELLED"  # NIXL cancelled the transfer
    TIMEOUT = "TIMEOUT"  # a deadline passed (bootstrap, transfer or arrival)
    PEER_LOST = "PEER_LOST"  # the control connection to the peer died
    ABORTED = "ABORTED"  # ``abort()`` on either side
    SHUTDOWN = "SHUTDOWN"  # the service (either side) shut down first
    INCOMPATIBLE = "INCOMPATIBLE"  # peer speaks another protocol or KV layout
    PEER_REPORTED = "PEER_REPORTED"  # the peer reported a failure it did not classify
    REFUSED = "REFUSED"  # not authorised: authentication failed, pinned to another receiver, over a limit
    CORRUPTED = "CORRUPTED"  # landing check: the pages do not hold the bytes the sender checksummed


class KVServiceError(Exception):
    """The root of every exception kvservice raises: ``except KVServiceError`` catches them all.

    Raised as itself (not a subclass) when a service or sidecar connection is used
    outside its life: not started, shutting down, stopped.  Nothing was done; the
    caller starts one (``async with``) or gives up.  Each subclass is defined beside
    the code that raises it and keeps the builtin base callers caught before it joined
    the family (``ValueError``, ``KeyError``, ``OSError``, ``RuntimeError``)."""


class ConfigError(KVServiceError, ValueError):
    """A configuration value is invalid; the message names the key and what is allowed.

    Raised on creating a ``ServiceConfig`` or loading a config file or environment:
    fix the value, nothing was started."""


class Overloaded(KVServiceError):
    """A bound was reached (``max_live_requests``): the call is refused, nothing changed.

    Retry later, or fail the request upstream."""


class UnknownRequestError(KVServiceError, KeyError):
    """An operation named a request id this service does not know (never started, or
    ended and forgotten).  A programming error on the caller's side: nothing changed."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown request"


class ProtocolError(KVServiceError):
    """A control-channel peer sent something that breaks the protocol, or refused us.

    Kept as a failed result's ``error`` (reason ``INCOMPATIBLE`` or ``REFUSED``), and
    raised by ``SidecarClient`` for a call the daemon found malformed.
    ``kind`` names the refusal for counters and for the ``Reject`` frame
    ("version", "hello_invalid", "incompatible", "agent_live", "peer_limit", ...)."""

    def __init__(self, message: str, kind: str = "protocol") -> None:
        super().__init__(message)
        self.kind = kind


class AuthenticationError(ProtocolError):
    """A peer could not prove it holds the cluster's key (or we could not prove it to the peer).

    Kept as a failed result's ``error`` (reason ``REFUSED``): give both services the
    same ``auth_key_file``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "auth")


class NixlUnavailable(KVServiceError, RuntimeError):
    """NIXL could not be imported, or no agent with a UCX backend could be created.

    Raised on starting a service: install NIXL with UCX, or run where it is."""


def failure_text(request_id: str, reason: FailureReason, peer: str | None, message: str,
                 error: BaseException | None = None) -> str:
    """The one sentence every failed request is told by: the request, the reason, the peer
    and what happened.  A scheduler often logs only ``str()`` of what
    ``failure_exception()`` raises, and an exception of the transport (anyio's
    ``BrokenResourceError()``) may have no message at all: this one never says nothing."""
    message = message.rstrip().removesuffix(":")  # "...: " + an error whose str() is empty
    detail = message or "no detail"
    if error is not None:
        said = str(error)
        named = f"{type(error).__name__}: {said}" if said else repr(error)
        if not message:
            detail = named
        elif type(error).__name__ not in message and (not said or said not in message):
            detail = f"{message} ({named})"
    where = f"peer {peer}" if peer else "no peer known yet"
    return f"request {request_id!r} failed {reason.value} ({where}): {detail}"


class TransferFailed(KVServiceError):
    """What ``failure_exception()`` raises for every failed request, in-process, through
    the facade and in the engine integrations: its message names the request, the reason
    and the peer (``failure_text``), and the original error (NIXL's exception, the lost
    connection's, a refused call's ``ValueError``) is its ``__cause__``.

    One type whatever went wrong, so that a caller tells a disconnect from a backend
    fault by ``reason`` (a stable name) instead of by a third party's exception class."""

    def __init__(self, request_id: str, reason: FailureReason, message: str, *, peer: str | None = None,
                 error: BaseException | None = None, result: TransferResult | None = None) -> None:
        super().__init__(failure_text(request_id, reason, peer, message, error))
        self.request_id = request_id
        self.reason = reason
        self.message = message
        self.peer = peer
        #: the failed result this was raised for (``None`` when raised before any existed)
        self.result = result
        self.__cause__ = error

    def __reduce__(self) -> tuple[object, ...]:  # pickle rebuilds it from __init__'s arguments
        return _transfer_failed, (self.request_id, self.reason, self.message, self.peer, self.__cause__,
                                  self.result), self.__dict__


def _transfer_failed(request_id: str, reason: FailureReason, message: str, peer: str | None,
                     error: BaseException | None, result: TransferResult | None) -> TransferFailed:
    """Unpickles a ``TransferFailed`` (its ``__init__`` takes keyword-only arguments)."""
    return TransferFailed(request_id, reason, message, peer=peer, error=error, result=result)


@dataclass(frozen=True, slots=True)
class TransferResult:
    """How one request's transfer ended, on either side.

    ``error`` is the original exception (for example the very
    ``nixlRemoteDisconnectError`` instance NIXL raised) when there was one.
    Times are ``time.monotonic()`` seconds; ``None`` when a phase never began.
    A success is settled by definition; a failure is settled once nothing of the
    request can still be written (docs/settle.md).
    """

    request_id: str
    status: TransferStatus
    reason: FailureReason | None = None
    error: BaseException | None = None
    message: str = ""
    #: who the request was with: the peer's control address (a sender bound to a receiver it
    #: was not pinned to knows its agent name), ``None`` while none was known
    peer: str | None = None
    bytes: int = 0
    pages: int = 0
    created_at: float = 0.0
    started_at: float | None = None  # first chunk posted (sender) / expect sent (receiver)
    finished_at: float = 0.0
    #: no WRITE of this request can land any more: on the receiver its pages may be
    #: reused (see ``TransferService.await_settled``); on the sender its source pages
    #: may be overwritten
    settled: bool = False
    #: on the receiver of a successful request, the sender's ``send(payload=)``
    payload: builtins.bytes | None = None

    def __post_init__(self) -> None:
        """A failure says why: it cannot be built without a reason and a message (a
        programming error raises here, where the failure is made, not in a scheduler that
        logs an empty line much later).  The original error, where one exists, is the
        caller's to pass (``RequestPlane.fail`` asks for it by name)."""
        if self.status is TransferStatus.FAILED and (self.reason is None or not self.message.strip()):
            raise ValueError(f"request {self.request_id!r}: a failed result needs a reason and a message "
                             f"(reason={self.reason!r}, message={self.message!r}, error={self.error!r})")

    @property
    def ok(self) -> bool:
        return self.status is TransferStatus.SUCCESS

    @property
    def poll(self) -> KVPoll:
        """``Success`` or ``Failed``: what ``poll()`` answers once a request has ended."""
        return KVPoll.Success if self.ok else KVPoll.Failed

    @property
    def duration_s(self) -> float:
        """From the request's creation to its end."""
        return self.finished_at - self.created_at

    @property
    def transfer_s(self) -> float | None:
        """From the first post (sender) or the expect (receiver) to the end."""
        return None if self.started_at is None else self.finished_at - self.started_at

    @property
    def gbps(self) -> float:
        t = self.transfer_s
        return self.bytes / t / 1e9 if t else 0.0

    def raise_for_failure(self) -> None:
        """Raise ``TransferFailed`` (the original error as its ``__cause__``) if this result failed."""
        if self.status is TransferStatus.SUCCESS:
            return
        assert self.reason is not None
        raise TransferFailed(self.request_id, self.reason, self.message, peer=self.peer, error=self.error,
                             result=self)
