"""Control-channel messages and their framing.

Frames are a 4-byte big-endian length followed by a msgpack-encoded message;
messages are a tagged union of ``msgspec.Struct`` types, so decoding checks the
schema.  Frames above the configured limit are refused before they are read.

Conversation (see ``_trust.handshake`` for the proofs)::

    dialer   -> Hello(nonce)                      small, read with PREAUTH_FRAME_BYTES
    acceptor -> Hello(nonce, proof) | Reject      the acceptor proves the key first
    dialer   -> Proof(proof)                      small; from here on every frame has a MAC
    dialer   -> Sealed(Join(metadata, memory))    read only after the proof checked out;
    acceptor -> Sealed(Join(metadata, memory)) | Reject     encrypted when keyed
    (a dialer that only wants to know who answers at an address sends
    Hello(probe=True), checks the acceptor's Hello and hangs up: no Join either way)
    either   -> Expect / Abort / Failed / Settled / Outcome / Ask / Posted / Ping / Bye
                                                  for the life of the link

Every field is bounded by the struct types below (lengths, integer ranges), so a
malformed frame fails decoding before any value is used; ``_trust.checks`` does
the checks that need context.

Completion does not travel here: it rides the NIXL notification of the last
WRITE (``ChunkNotif``), which NIXL delivers after the data is visible.  NIXL
lets any agent holding our metadata send a notification under any name, so each
one carries a MAC under its link's notification key (``encode_notif``).
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Sequence
from typing import Annotated, TypeVar

import msgspec

from .._results import KVServiceError, ProtocolError
from .._trust.handshake import NOTIF_MAC_BYTES, notif_mac

T = TypeVar("T")

#: 3: Join describes the KV memory as regions (``MemoryWire``); ChunkNotif carries a payload
#: 4: the Join travels as ``Sealed`` (encrypted when keyed); notifications carry a MAC;
#:    ``Hello.probe``
#: 5: ``MemoryWire`` names the staging buffer, ``Expect.staging`` a range of it (a peer of
#:    version 4 would ignore the range and write where the receiver does not look)
#: 6: versions are negotiated (``Hello.top``; see ``negotiate``); a link of version 6 derives
#:    its secrets with an ephemeral X25519 exchange (``Hello.share``: forward secrecy)
#:    and a receiver asks a sender it linked with again about what it holds (``Ask``)
#: 7: a sender tells the receiver when it posts requests' first WRITEs (``Posted``): the
#:    receiver polls NIXL for a request only from then on
PROTOCOL_VERSION = 7
#: the oldest version this release still speaks: each release links with the one before it
#: (docs/operations.md "Upgrades"), so a fleet upgrades one pod at a time without failing a request
OLDEST_VERSION = 5
_HEADER = struct.Struct(">I")
HEADER_BYTES = _HEADER.size
#: the largest frame read before the peer has proved the key (Hello, Proof, Reject)
PREAUTH_FRAME_BYTES = 1024

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_Agent = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
_Address = Annotated[str, msgspec.Meta(min_length=3, max_length=262)]
_Nonce = Annotated[bytes, msgspec.Meta(max_length=32)]  # exactly 32: checked with the version
_Proof = Annotated[bytes, msgspec.Meta(max_length=32)]
_Cert = Annotated[bytes, msgspec.Meta(max_length=6144)]  # _trust.identity.MAX_CERT_BYTES
_Signature = Annotated[bytes, msgspec.Meta(max_length=1024)]  # _trust.identity.MAX_SIGNATURE_BYTES
#: longest free text in a frame (messages of Reject / Abort / Failed / Bye); ``text()`` cuts to it
MAX_TEXT = 4096
_Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
_Reason = Annotated[str, msgspec.Meta(max_length=64)]
_U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack: < 2**64
_Small = Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]
_Name = Annotated[str, msgspec.Meta(max_length=16)]
#: regions a Join may describe (a layer has at most two: K and V)
MAX_REGIONS = 4096


def text(s: str) -> str:
    """``s`` cut to what a frame may carry."""
    return s if len(s) <= MAX_TEXT else s[: MAX_TEXT - 3] + "..."


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """First frame each way.  The versions are checked before anything else.

    ``version`` is the *oldest* version the sender speaks and ``top`` its newest (0: only
    ``version``): a peer of version 5, which knows no ``top`` (an unknown field is skipped)
    and requires ``version == 5``, still links with a release that speaks 5 and 6.  A link
    speaks the newest version both know (``negotiate``); the versions are bound to the
    proofs through the nonces (``_trust.handshake.new_nonce``), so nobody on the path
    can talk two peers down to an older version."""

    version: int
    agent: _Agent
    address: _Address  # the sender of this Hello's own control address ("host:port")
    nonce: _Nonce = b""
    proof: _Proof = b""  # the acceptor's; empty from the dialer
    #: from a dialer: "only prove who you are at this address", no link follows
    probe: bool = False
    top: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    #: the sender's ephemeral X25519 public key (from version 6; ``_trust.handshake.Exchange``)
    share: Annotated[bytes, msgspec.Meta(max_length=32)] = b""
    #: member identities (``_trust.identity``): 0 from a release without them, 1 "I know them, have
    #: none", 2 "I have one"; the acceptor's certificate and its signature over the transcript
    ident: Annotated[int, msgspec.Meta(ge=0, le=2)] = 0
    cert: _Cert = b""
    signature: _Signature = b""

    @property
    def newest(self) -> int:
        """The newest version the sender speaks."""
        return max(self.version, self.top)


def hello(agent: str, address: str, nonce: bytes, proof: bytes = b"", *, probe: bool = False,
          share: bytes = b"") -> Hello:
    """This release's Hello: it speaks ``OLDEST_VERSION`` to ``PROTOCOL_VERSION``."""
    return Hello(OLDEST_VERSION, agent, address, nonce, proof, probe, PROTOCOL_VERSION, share)


def negotiate(theirs: Hello) -> int:
    """The version a link with the sender of ``theirs`` speaks: the newest both know.
    Raises ``ProtocolError`` (kind ``version``) when the ranges do not meet."""
    version = min(theirs.newest, PROTOCOL_VERSION)
    if version < max(theirs.version, OLDEST_VERSION):
        span = f"{theirs.version}" if theirs.newest == theirs.version else f"{theirs.version}-{theirs.newest}"
        raise ProtocolError(f"the peer speaks protocol version {span}, this service speaks "
                            f"{OLDEST_VERSION}-{PROTOCOL_VERSION}", "version")
    return version


class Proof(msgspec.Struct, tag="proof", frozen=True):
    """The dialer's answer to the acceptor's Hello (with its certificate and signature
    when both sides have a member identity)."""

    proof: _Proof
    cert: _Cert = b""
    signature: _Signature = b""


class RegionWire(msgspec.Struct, array_like=True, frozen=True):
    """One ``memory.Region`` (checked again, with context, by ``_trust.checks``)."""

    addr: _U64
    page_stride: _U64
    layer: _Small
    kind: _Name
    dtype: _Name
    tokens: _Small
    heads: _Small
    head_dim: _Small
    order: _Name
    device_id: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0


class MemoryWire(msgspec.Struct, frozen=True):
    """A ``memory.KVMemory`` as a peer sees it: where and how its pages lie."""

    num_pages: Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]
    regions: Annotated[list[RegionWire], msgspec.Meta(min_length=1, max_length=MAX_REGIONS)]
    mem_type: _Name = "DRAM"
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    tp_rank: Annotated[int, msgspec.Meta(ge=0, le=4095)] = 0
    #: its staging buffer (``_transfer.staging``: sliced token-major pages land there); 0 bytes: none
    staging_addr: _U64 = 0
    staging_bytes: _U64 = 0


class Join(msgspec.Struct, tag="join", frozen=True):
    """What a peer needs to write into our KV memory; sent only to an authenticated peer."""

    metadata: Annotated[bytes, msgspec.Meta(min_length=1)]  # NIXL agent metadata
    memory: MemoryWire


class Sealed(msgspec.Struct, tag="sealed", frozen=True):
    """A ``Join``'s encoded body: encrypted and authenticated under the link's Join key
    when keyed (``LinkSecrets.seal_join``), as it is otherwise."""

    box: Annotated[bytes, msgspec.Meta(min_length=1)]


class Reject(msgspec.Struct, tag="reject", frozen=True):
    message: _Text
    kind: _Reason = ""  # ProtocolError.kind of the refusal ("auth", "incompatible", ...)


class Expect(msgspec.Struct, tag="expect", frozen=True):
    """Receiver -> sender: write request ``request_id`` into these pages."""

    request_id: RequestId
    pages: list[int]
    #: the first cell of the receiver's staging this request lands in (``_transfer.staging``); -1: none
    staging: Annotated[int, msgspec.Meta(ge=-1, le=(1 << 31) - 1)] = -1
    #: check the landing (``_transfer.landing``): each chunk's notification carries the CRC32C
    #: of the bytes written.  A sender that does not know the field ignores it and sends none.
    verify: bool = False


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """Either way: the request is abandoned; reason is a ``FailureReason`` value."""

    request_id: RequestId
    reason: _Reason
    message: _Text = ""


class Failed(msgspec.Struct, tag="failed", frozen=True):
    """Sender -> receiver: the request's transfer failed on the sending side."""

    request_id: RequestId
    reason: _Reason
    message: _Text = ""


class Settled(msgspec.Struct, tag="settled", frozen=True):
    """Sender -> receiver: no WRITE of this request can land any more (each one is
    complete or released), so its pages may be reused.  ``ok``: it ended SUCCESS here."""

    request_id: RequestId
    ok: bool = False


class Outcome(msgspec.Struct, tag="outcome", frozen=True):
    """Receiver -> sender, in answer to its ``Failed``: ``ok`` when every page had
    arrived here first (the sender's give-up lost the race; its result becomes SUCCESS)."""

    request_id: RequestId
    ok: bool = False


#: request ids one ``Ask`` may name (a receiver with more held asks again for the rest)
MAX_ASK = 128  # 128 ids of the longest kind fit the smallest max_frame_bytes (64 KiB)


class Ask(msgspec.Struct, tag="ask", frozen=True):
    """Receiver -> sender, on a new link (version 6): of these requests, which can no
    WRITE of yours reach any more?  They failed here while an earlier link's WRITEs may
    have been under way.  Answered with a ``Settled`` for each one the sender can prove
    (``_transfer.proofs``); the others go unanswered and stay held.  A peer of version 5
    closes the link on this tag: send it only where ``ControlPlane.speaks(agent, 6)``."""

    request_ids: Annotated[list[RequestId], msgspec.Meta(min_length=1, max_length=MAX_ASK)]


#: the version from which a sender says ``Posted`` (and its receivers wait for it)
POSTED_VERSION = 7
#: request ids one ``Posted`` may name (a sender that plans more at once sends more frames)
MAX_POSTED = MAX_ASK


class Posted(msgspec.Struct, tag="posted", frozen=True):
    """Sender -> receiver (version 7): the first WRITEs of these requests have been posted
    (one frame for those one watchdog tick posted).  With NIXL's progress thread off a WRITE
    completes only while the receiver calls into NIXL, so a receiver polls for a request from
    this frame on (or from any earlier sign of its WRITEs: a notification, its end), and
    from its Expect only briefly, for a sender already waiting (``EXPECT_GRACE_S``).  A
    request completed within its post right after another to the same receiver may go
    unnamed: that receiver polls on after the other (``_transfer.watchdog``,
    ``Watchdog._tell_posted``).  A peer of version 6 or older closes the link on this tag:
    send it only where ``ControlPlane.speaks(agent, 7)``."""

    request_ids: Annotated[list[RequestId], msgspec.Meta(min_length=1, max_length=MAX_POSTED)]


class Ping(msgspec.Struct, tag="ping", frozen=True):
    pass


class Bye(msgspec.Struct, tag="bye", frozen=True):
    """The peer is shutting down; it has already failed what it owed us."""

    message: _Text = ""


Message = (Hello | Proof | Join | Sealed | Reject | Expect | Abort | Failed | Settled | Outcome | Ask | Posted | Ping
           | Bye)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class LandingSum(msgspec.Struct, array_like=True, frozen=True):
    """The CRC32C of the bytes a chunk's WRITE moved (``_transfer.landing``): of pages
    ``pos:pos + pages`` of the receiver's Expect, layers ``lo:hi``."""

    crc: Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
    pos: _Small
    pages: Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]
    lo: _Small
    hi: _Small


class ChunkNotif(msgspec.Struct, array_like=True, frozen=True):
    """Carried in the NIXL notification of each chunk's WRITE.

    Fields are only ever added at the end, with a default: a decoder that does not
    know a trailing element ignores it (``tests/unit/test_protocol.py``)."""

    request_id: str
    chunk: int  # FENCE: the settle fence, not a chunk
    total: int  # number of chunks of the request when this is the last one, else 0
    #: the request's payload (``send(payload=)``), on its last chunk only: it arrives
    #: with the notification that completes the request
    payload: bytes | None = None
    #: when the receiver asked for landing checks (``Expect.verify``): this chunk's CRC32C
    landing: LandingSum | None = None


#: ``ChunkNotif.chunk`` of the fence WRITE a sender posts after releasing a failed
#: request's handles: its notification arrives after every earlier WRITE to us landed
FENCE = -1


_notif_encoder = msgspec.msgpack.Encoder()
_notif_decoder = msgspec.msgpack.Decoder(ChunkNotif)
NOTIF_MAGIC = b"kv2"
_MAGIC_BYTES = len(NOTIF_MAGIC)


def encode_notif(n: ChunkNotif, key: bytes) -> bytes:
    """The notification: magic, body, and the body's MAC under the link's ``key``
    (``LinkSecrets.notif_out``)."""
    body = _notif_encoder.encode(n)
    return NOTIF_MAGIC + body + notif_mac(key, body)


#: what ``decode_notif`` answers for a notification of ours whose MAC does not verify
FORGED = ChunkNotif("", 0, 0)


def decode_notif(raw: bytes, keys: Sequence[bytes]) -> ChunkNotif | None:
    """The notification if its MAC verifies under one of ``keys`` (the sender's links'
    ``notif_in``, newest first); ``FORGED`` if it is ours by its magic but does not
    verify or decode; ``None`` if it is not ours (another NIXL user's)."""
    if not raw.startswith(NOTIF_MAGIC):
        return None
    if len(raw) < _MAGIC_BYTES + NOTIF_MAC_BYTES:
        return FORGED
    body, tag = raw[_MAGIC_BYTES:-NOTIF_MAC_BYTES], raw[-NOTIF_MAC_BYTES:]
    for key in keys:  # a loop, not any() over a generator: this runs per notification
        if hmac.compare_digest(notif_mac(key, body), tag):
            break
    else:
        return FORGED
    try:
        return _notif_decoder.decode(body)
    except msgspec.DecodeError:
        return FORGED


def peek_notif(raw: bytes) -> ChunkNotif | None:
    """What a notification of ours says, unverified: for tools and tests that watch
    the wire (never for acting on it: ``decode_notif``)."""
    if not raw.startswith(NOTIF_MAGIC):
        return None
    try:
        return _notif_decoder.decode(raw[_MAGIC_BYTES:-NOTIF_MAC_BYTES])
    except msgspec.DecodeError:
        return None


def frame(body: bytes) -> bytes:
    """Prefix ``body`` with its length: one frame on the wire."""
    return _HEADER.pack(len(body)) + body


def encode_body(msg: Message) -> bytes:
    return _encoder.encode(msg)


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


class FrameError(KVServiceError):
    """A frame broke the protocol: oversized, malformed, unauthenticated, or out of turn.

    Raised by the decoders and framed streams (peer links and the sidecar's socket);
    the link or connection that carried it is closed.  A dial that ends so fails its
    requests ``PEER_LOST`` with it as ``error``; ``SidecarClient`` reports it as a
    lost connection.  Not a ``ProtocolError``: that is a refusal with a ``kind``."""
