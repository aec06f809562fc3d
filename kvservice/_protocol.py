"""Control-channel messages and their framing.

Frames are a 4-byte big-endian length followed by a msgpack-encoded message;
messages are a tagged union of ``msgspec.Struct`` types, so decoding checks the
schema.  Frames above the configured limit are refused before they are read.

Conversation::

    dialer  -> Hello            acceptor validates version and layout
    dialer  <- Hello | Reject
    either  -> Expect / Abort / Failed / Ping / Bye   for the life of the link

Completion does not travel here: it rides the NIXL notification of the last
WRITE (``ChunkNotif``), which NIXL delivers after the data is visible.
"""

from __future__ import annotations

import struct
from typing import Annotated, TypeVar

import msgspec

T = TypeVar("T")

PROTOCOL_VERSION = 1
_HEADER = struct.Struct(">I")
HEADER_BYTES = _HEADER.size

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class Hello(msgspec.Struct, tag="hello", frozen=True):
    version: int
    agent: str
    address: str  # the sender of this Hello's own control address ("host:port")
    metadata: bytes  # NIXL agent metadata
    layout: dict[str, str | int]  # KVLayout.wire_shape()
    num_pages: int
    base_addr: int  # address of the pool's first byte, for the descriptor table
    device_id: int = 0


class Reject(msgspec.Struct, tag="reject", frozen=True):
    message: str


class Expect(msgspec.Struct, tag="expect", frozen=True):
    """Receiver -> sender: write request ``request_id`` into these pages."""

    request_id: RequestId
    pages: list[int]


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """Either way: the request is abandoned; reason is a ``FailureReason`` value."""

    request_id: RequestId
    reason: str
    message: str = ""


class Failed(msgspec.Struct, tag="failed", frozen=True):
    """Sender -> receiver: the request's transfer failed on the sending side."""

    request_id: RequestId
    reason: str
    message: str = ""


class Ping(msgspec.Struct, tag="ping", frozen=True):
    pass


class Bye(msgspec.Struct, tag="bye", frozen=True):
    """The peer is shutting down; it has already failed what it owed us."""

    message: str = ""


Message = Hello | Reject | Expect | Abort | Failed | Ping | Bye

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class ChunkNotif(msgspec.Struct, array_like=True, frozen=True):
    """Carried in the NIXL notification of each chunk's WRITE."""

    request_id: str
    chunk: int
    total: int  # number of chunks of the request when this is the last one, else 0


_notif_encoder = msgspec.msgpack.Encoder()
_notif_decoder = msgspec.msgpack.Decoder(ChunkNotif)
NOTIF_MAGIC = b"kv1"


def encode_notif(n: ChunkNotif) -> bytes:
    return NOTIF_MAGIC + _notif_encoder.encode(n)


def decode_notif(raw: bytes) -> ChunkNotif | None:
    """``None`` for notifications that are not ours or are malformed."""
    if not raw.startswith(NOTIF_MAGIC):
        return None
    try:
        return _notif_decoder.decode(raw[len(NOTIF_MAGIC):])
    except msgspec.DecodeError:
        return None


def frame(body: bytes) -> bytes:
    """Prefix ``body`` with its length: one frame on the wire."""
    return _HEADER.pack(len(body)) + body


def encode_frame(msg: Message) -> bytes:
    return frame(_encoder.encode(msg))


def frame_length(header: bytes, limit: int) -> int:
    """Body length from a header; raises ``FrameError`` above ``limit``."""
    n: int = _HEADER.unpack(header)[0]
    if n > limit:
        raise FrameError(f"frame of {n} bytes exceeds the limit of {limit}")
    return n


def decode_with(decoder: msgspec.msgpack.Decoder[T], body: bytes) -> T:
    """Decode a frame body; a malformed or schema-violating one is a ``FrameError``."""
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError subclasses DecodeError
        raise FrameError(f"malformed frame: {exc}") from exc


def decode_body(body: bytes) -> Message:
    return decode_with(_decoder, body)


class FrameError(Exception):
    """A frame broke the protocol; the link that carried it is closed."""
