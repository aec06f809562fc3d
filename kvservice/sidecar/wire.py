"""Frames between workers and the sidecar over its Unix socket.

Same framing as the peer control channel (``kvservice._control.protocol``): a 4-byte
big-endian length, then a msgpack body decoded against a tagged union of
``msgspec.Struct`` types, so a frame is schema-checked as it is decoded, and a
length above the limit is refused before the body is read.

Conversation::

    worker -> Hello                       sidecar -> Welcome | Error (then closes)
    worker -> Send | Expect | Decline | Expected | AwaitCompletion | AwaitArrival | AwaitSettled | Abort
              | Poll | Status | LivePeers | Cancel
    sidecar -> the call's reply (same ``call`` number) or Error
    sidecar -> Finished     whenever a request this worker sent or expected ends
    sidecar -> Bye          when it shuts down (after the last Finished)

Each call carries a worker-chosen ``call`` number, so calls on one connection
overlap; ``Cancel`` withdraws one (the worker's caller was cancelled).
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable
from typing import Annotated, Any, Literal

import msgspec

from .._control.protocol import MAX_TEXT, decode_with, frame
from .._results import FailureReason, KVServiceError, TransferResult, TransferStatus
from ..discovery.member import MAX_NAME_CHARS, MAX_ROLE_CHARS, Member

#: 2: ``Send.fit``; 3: ``Decline`` and ``Expected``; 4: ``Send.receiver`` and ``Expect.verify``;
#: 5: ``Expect.member``
#: (a client checks the Welcome's version before it sends a call or a field that is newer
#: than the daemon: an older one would take it for a malformed frame)
SIDECAR_PROTOCOL_VERSION = 5
#: the oldest version a daemon of this release serves: the previous release's clients keep
#: working while the daemons are upgraded first (docs/operations.md "Upgrades")
SIDECAR_OLDEST_VERSION = 2


def sidecar_version(client: int) -> int | None:
    """The version a daemon of this release speaks with a client that says ``client``:
    its own, for a client as new or newer (that client may still speak it: it decides
    on the ``Welcome``), the client's for an older one it still serves, else ``None``."""
    if client >= SIDECAR_PROTOCOL_VERSION:
        return SIDECAR_PROTOCOL_VERSION
    return client if client >= SIDECAR_OLDEST_VERSION else None


RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
CallId = Annotated[int, msgspec.Meta(ge=1, le=2**53)]
Pages = Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]], msgspec.Meta(min_length=1)]
MAX_SENDER_CHARS = 512
#: a receiver's word for its sender, a sender's for its receiver: ``host:port`` or a
#: member's name (checked by the service)
Sender = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SENDER_CHARS)]
#: as the peer control channel's text: what reaches the sender
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Timeout = float | None  # as in-process: a timeout already past fails the request at once
_Layer = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
Layers = tuple[_Layer, _Layer]
#: the service checks it against its max_payload_bytes; this only bounds the frame
Payload = Annotated[bytes, msgspec.Meta(max_length=1 << 20)]


# -- worker -> sidecar -------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello", frozen=True, forbid_unknown_fields=True):
    version: int
    client: Annotated[str, msgspec.Meta(max_length=256)] = ""


class Send(msgspec.Struct, tag="send", frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """``send()``.  A field at its default is not sent: a daemon of the version before the
    field decodes the frame (``FIELDS_SINCE``)."""

    call: CallId
    request_id: RequestId
    pages: Pages
    last: bool = False
    timeout: Timeout = None
    layers: Layers | None = None  # [lo, hi): send(layers=range(lo, hi))
    payload: Payload | None = None
    fit: Literal["tail"] | None = None
    receiver: Sender | None = None  # pins the request to that decode (first chunk only)


class AwaitCompletion(msgspec.Struct, tag="await_completion", frozen=True, forbid_unknown_fields=True):
    call: CallId
    request_id: RequestId
    timeout: Timeout = None


class Expect(msgspec.Struct, tag="expect", frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """``expect()``; a field at its default is not sent (as ``Send``)."""

    call: CallId
    request_id: RequestId
    pages: Pages
    sender: Sender
    timeout: Timeout = None
    verify: bool | None = None  # check the landing (None: the daemon's verify_landing)
    #: the member a registry vouched for at ``sender``: it must prove it (checked by the service)
    member: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)] | None = None


class Decline(msgspec.Struct, tag="decline", frozen=True, forbid_unknown_fields=True):
    """``TransferService.decline`` (protocol 3): tell ``sender`` the request will not be expected."""

    call: CallId
    request_id: RequestId
    sender: Sender
    message: Text = ""


class Expected(msgspec.Struct, tag="expected", frozen=True, forbid_unknown_fields=True):
    """``TransferService.expected``, ``expected_pages`` and ``expect_dropped`` (protocol 3),
    answered together: what the daemon holds of a receiver's expect before the first send."""

    call: CallId
    request_id: RequestId


class AwaitArrival(msgspec.Struct, tag="await_arrival", frozen=True, forbid_unknown_fields=True):
    call: CallId
    request_id: RequestId
    timeout: Timeout = None


class AwaitSettled(msgspec.Struct, tag="await_settled", frozen=True, forbid_unknown_fields=True):
    """``TransferService.await_settled``: the result once nothing of the request can land."""

    call: CallId
    request_id: RequestId
    timeout: Timeout = None


class Abort(msgspec.Struct, tag="abort", frozen=True, forbid_unknown_fields=True):
    call: CallId
    request_id: RequestId


class Poll(msgspec.Struct, tag="poll", frozen=True, forbid_unknown_fields=True):
    """The request's ``KVPoll`` now; side "send" (``handle.poll()``) or "recv" (``poll_arrival``)."""

    call: CallId
    request_id: RequestId
    side: Annotated[str, msgspec.Meta(pattern="^(send|recv)$")]


class Status(msgspec.Struct, tag="status", frozen=True, forbid_unknown_fields=True):
    call: CallId


class LivePeers(msgspec.Struct, tag="live_peers", frozen=True, forbid_unknown_fields=True):
    """``TransferService.live_peers``: the cluster's live members; ``role`` filters."""

    call: CallId
    role: Annotated[str, msgspec.Meta(max_length=MAX_ROLE_CHARS)] | None = None


class Cancel(msgspec.Struct, tag="cancel", frozen=True, forbid_unknown_fields=True):
    call: CallId


Call = (Send | AwaitCompletion | Expect | Decline | Expected | AwaitArrival | AwaitSettled | Abort | Poll | Status
        | LivePeers | Cancel)
ClientMessage = Hello | Call

#: the version that brought each call in (the rest are in every version served): a client
#: sends one only to a daemon that speaks it, a daemon takes one only on a connection that does
SINCE: dict[type[Call], int] = {Decline: 3, Expected: 3}
#: the version that brought each optional field of a call in: a call that sets one (not at
#: its default, so on the wire) goes only to a daemon that speaks it
FIELDS_SINCE: dict[tuple[type[Call], str], int] = {(Send, "receiver"): 4, (Expect, "verify"): 4,
                                                   (Expect, "member"): 5}


def call_refusal(msg: Call, version: int) -> str | None:
    """Why ``msg`` cannot go over a connection speaking ``version``; None when it can."""
    tag = type(msg).__struct_config__.tag
    since = SINCE.get(type(msg), SIDECAR_OLDEST_VERSION)
    if since > version:
        return f"the {tag} call is protocol version {since}, this connection speaks {version}"
    for (kind, name), since in FIELDS_SINCE.items():
        if kind is type(msg) and getattr(msg, name) is not None and since > version:
            return f"the {tag} call's {name}= is protocol version {since}, this connection speaks {version}"
    return None


# -- sidecar -> worker -------------------------------------------------------------------
class WireResult(msgspec.Struct, array_like=True, frozen=True):
    """A ``TransferResult``; the original error travels as its type name and text."""

    request_id: str
    status: str
    reason: str | None
    error_type: str | None
    error_message: str | None
    message: str
    bytes: int
    pages: int
    created_at: float
    started_at: float | None
    finished_at: float
    settled: bool = False
    payload: builtins.bytes | None = None


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    version: int
    pid: int
    agent: str
    address: str  # the sidecar's control address: what a receiver passes as ``sender``
    roles: list[str]
    shm_name: str
    layout: dict[str, Any]  # KVLayout fields, num_pages included
    max_frame_bytes: int
    results_kept: Annotated[int, msgspec.Meta(ge=1, le=2**31)]


class SendReply(msgspec.Struct, tag="sent", frozen=True):
    call: int
    poll: int  # KVPoll value after the send
    result: WireResult | None = None  # set when the request had already ended


class Done(msgspec.Struct, tag="done", frozen=True):
    """Reply to Expect: the request's ``KVPoll`` value after it (a daemon of 3 sends none)."""

    call: int
    poll: int | None = None


class Declined(msgspec.Struct, tag="declined", frozen=True):
    """Reply to Decline: whether its Abort was queued on the link to the sender."""

    call: int
    queued: bool


class ExpectedReply(msgspec.Struct, tag="expected_reply", frozen=True):
    """Reply to Expected: the service's three answers."""

    call: int
    expected: bool
    pages: int | None
    dropped: tuple[str, str] | None  # (FailureReason value, whose expect it was)


class ResultReply(msgspec.Struct, tag="result", frozen=True):
    call: int
    result: WireResult | None


class PollReply(msgspec.Struct, tag="poll_reply", frozen=True):
    call: int
    poll: int  # KVPoll value


class StatusReply(msgspec.Struct, tag="status_reply", frozen=True):
    call: int
    status: dict[str, Any]


class PeersReply(msgspec.Struct, tag="peers", frozen=True):
    call: int
    members: list[Member]  # bounded and checked on decode, as a registration read from etcd


class Error(msgspec.Struct, tag="error", frozen=True):
    """A call raised (``kind`` names the exception class), or call 0: the connection is refused."""

    call: int
    kind: str
    message: str


class Finished(msgspec.Struct, tag="finished", frozen=True):
    """A request this connection sent (side "send") or expected ("recv") has ended."""

    side: str
    result: WireResult


class Bye(msgspec.Struct, tag="bye", frozen=True):
    message: str = ""


ServerMessage = (Welcome | SendReply | Done | Declined | ExpectedReply | ResultReply | PollReply | StatusReply
                 | PeersReply | Error | Finished | Bye)

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_server_decoder = msgspec.msgpack.Decoder(ServerMessage)

def encode(msg: ClientMessage | ServerMessage) -> bytes:
    return frame(_encoder.encode(msg))


def encode_frames(msgs: Iterable[ClientMessage | ServerMessage]) -> bytes:
    """``msgs`` as frames back to back, for one write."""
    return b"".join([frame(_encoder.encode(msg)) for msg in msgs])


def decode_client(body: bytes) -> ClientMessage:
    return decode_with(_client_decoder, body)


def decode_server(body: bytes) -> ServerMessage:
    return decode_with(_server_decoder, body)


# -- results ---------------------------------------------------------------------------------
def result_to_wire(r: TransferResult) -> WireResult:
    return WireResult(
        request_id=r.request_id, status=r.status.value, reason=r.reason.value if r.reason else None,
        error_type=type(r.error).__name__ if r.error is not None else None,
        error_message=str(r.error) if r.error is not None else None,
        message=r.message, bytes=r.bytes, pages=r.pages, created_at=r.created_at,
        started_at=r.started_at, finished_at=r.finished_at, settled=r.settled, payload=r.payload,
    )


class SidecarRemoteError(KVServiceError):
    """Stands for an error raised inside the sidecar (``type_name`` is its class).

    Never raised: a ``SidecarClient``'s failed result carries it as ``error``, where a
    service in this process would carry the exception itself (exceptions do not cross
    the socket, their class name and message do)."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message

    def __reduce__(self) -> tuple[object, ...]:  # pickle rebuilds it from __init__'s arguments
        return type(self), (self.type_name, self.message), self.__dict__


def result_from_wire(w: WireResult) -> TransferResult:
    error = SidecarRemoteError(w.error_type, w.error_message or "") if w.error_type else None
    return TransferResult(
        request_id=w.request_id, status=TransferStatus(w.status),
        reason=FailureReason(w.reason) if w.reason else None, error=error, message=w.message,
        bytes=w.bytes, pages=w.pages, created_at=w.created_at, started_at=w.started_at,
        finished_at=w.finished_at, settled=w.settled, payload=w.payload,
    )
