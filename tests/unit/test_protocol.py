"""Control-channel framing and the NIXL notification payload."""

from __future__ import annotations

import struct

import anyio
import anyio.abc
import msgspec
import pytest

from kvservice._control.addresses import split_address
from kvservice._control.links import ControlStream
from kvservice._control.protocol import (
    FORGED,
    HEADER_BYTES,
    NOTIF_MAGIC,
    OLDEST_VERSION,
    PROTOCOL_VERSION,
    Abort,
    Bye,
    ChunkNotif,
    Expect,
    Failed,
    FrameError,
    Hello,
    Join,
    LandingSum,
    MemoryWire,
    Message,
    Ping,
    Proof,
    RegionWire,
    Reject,
    decode_body,
    decode_notif,
    encode_frame,
    encode_notif,
    frame_length,
    hello,
    negotiate,
)
from kvservice._results import ProtocolError
from kvservice._trust.handshake import NOTIF_MAC_BYTES, notif_mac

MESSAGES: list[Message] = [
    Hello(version=PROTOCOL_VERSION, agent="kv-a", address="127.0.0.1:5000", nonce=b"n" * 32, proof=b"p" * 32),
    Proof(b"p" * 32),
    Join(metadata=b"\x00md\xff", memory=MemoryWire(num_pages=64, tp_size=2, tp_rank=1, regions=[
        RegionWire(2**63 + 4096, 4096, 0, "k", "bfloat16", 16, 2, 64, "NHD", 1),
        RegionWire(2**64 - 4096, 4096, 0, "v", "bfloat16", 16, 2, 64, "HND", 0)])),
    Reject("no", "auth"),
    Expect("r1", [0, 5, 63]),
    Expect("r1", [0, 5, 63], verify=True),
    Abort("r1", "ABORTED", "bye"),
    Failed("r1", "TIMEOUT", "late"),
    Ping(),
    Bye("shutting down"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_frame_round_trip(msg: Message) -> None:
    frame = encode_frame(msg)
    n = frame_length(frame[:HEADER_BYTES], limit=1 << 20)
    assert n == len(frame) - HEADER_BYTES
    assert decode_body(frame[HEADER_BYTES:]) == msg


def test_frame_length_refuses_oversize_before_reading_the_body() -> None:
    assert frame_length(struct.pack(">I", 1000), limit=1000) == 1000
    with pytest.raises(FrameError, match="1001 bytes exceeds the limit of 1000"):
        frame_length(struct.pack(">I", 1001), limit=1000)


REGION = [4096, 4096, 0, "k", "bfloat16", 16, 2, 64, "NHD", 0]


def join(memory: dict[str, object]) -> bytes:
    return msgspec.msgpack.encode({"type": "join", "metadata": b"m",
                                   "memory": {"num_pages": 1, "regions": [REGION], **memory}})


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # never-used msgpack byte
        b"",
        msgspec.msgpack.encode({"type": "nonsense"}),
        msgspec.msgpack.encode({"type": "expect", "request_id": "", "pages": [1]}),  # empty id
        msgspec.msgpack.encode({"type": "expect", "request_id": "r", "pages": ["x"]}),
        msgspec.msgpack.encode({"type": "hello", "version": 1}),  # missing fields
        msgspec.msgpack.encode({"type": "hello", "version": 2, "agent": "a" * 129, "address": "h:1"}),
        msgspec.msgpack.encode({"type": "hello", "version": 2, "agent": "a", "address": "h:1", "nonce": b"n" * 33}),
        join({"num_pages": 0}),
        join({"num_pages": 1 << 31}),
        join({"regions": []}),
        join({"regions": [REGION] * 4097}),
        join({"regions": [[-1, *REGION[1:]]]}),  # a negative address
        join({"regions": [[*REGION[:-1], 70000]]}),  # device id
        join({"regions": [REGION[:5]]}),  # fields missing
        join({"regions": [[*REGION[:3], "k" * 17, *REGION[4:]]]}),  # a kind longer than any
        join({"tp_size": 0}),
        join({"tp_rank": 4096}),
        msgspec.msgpack.encode({"type": "join", "metadata": b"", "memory": {"num_pages": 1, "regions": [REGION]}}),
        msgspec.msgpack.encode({"type": "join", "metadata": b"m"}),  # no memory
        msgspec.msgpack.encode({"type": "failed", "request_id": "r", "reason": "x" * 65}),
        msgspec.msgpack.encode({"type": "abort", "request_id": "r", "reason": "ABORTED", "message": "m" * 5000}),
        msgspec.msgpack.encode([1, 2, 3]),
    ],
)
def test_malformed_body_is_a_frame_error(body: bytes) -> None:
    with pytest.raises(FrameError, match="malformed frame"):
        decode_body(body)


def test_request_id_longer_than_256_is_refused() -> None:
    body = encode_frame(Expect("x" * 257, [1]))[HEADER_BYTES:]
    with pytest.raises(FrameError):
        decode_body(body)


KEY, OTHER = b"k" * 32, b"o" * 32


def test_notif_round_trip() -> None:
    n = ChunkNotif("req-7", chunk=3, total=4, payload=b"p")
    raw = encode_notif(n, KEY)
    assert raw.startswith(NOTIF_MAGIC)
    assert decode_notif(raw, [KEY]) == n
    assert decode_notif(raw, [OTHER, KEY]) == n  # any of the sender's recent links' keys


class _ExpectV5(msgspec.Struct, tag="expect", frozen=True):
    """``Expect`` as a version without landing checks declares it."""

    request_id: str
    pages: list[int]
    staging: int = -1


class _ChunkNotifV5(msgspec.Struct, array_like=True, frozen=True):
    """``ChunkNotif`` as a version without landing checks declares it."""

    request_id: str
    chunk: int
    total: int
    payload: bytes | None = None


def test_an_older_peer_ignores_the_landing_ask_and_sum() -> None:
    """A sender without landing checks decodes a new receiver's Expect (the unknown
    ``verify`` key ignored) and a new sender's notification (the trailing sum ignored)."""
    old_expect = msgspec.msgpack.Decoder(_ExpectV5 | Ping)
    assert old_expect.decode(encode_frame(Expect("r1", [3, 4], 7, verify=True))[HEADER_BYTES:]) == \
        _ExpectV5("r1", [3, 4], 7)
    raw = encode_notif(ChunkNotif("r1", 2, 3, b"p", LandingSum(0xDEADBEEF, 4, 2, 0, 1)), KEY)
    body = raw[len(NOTIF_MAGIC):-NOTIF_MAC_BYTES]
    assert msgspec.msgpack.Decoder(_ChunkNotifV5).decode(body) == _ChunkNotifV5("r1", 2, 3, b"p")


def test_a_newer_peer_reads_an_older_ones_expect_and_notif() -> None:
    """And the other way: no ``verify`` is False, no sum is None (which a receiver that
    asked for checks fails ``INCOMPATIBLE``: tests/system/test_landing.py)."""
    old = msgspec.msgpack.encode(_ExpectV5("r1", [3], -1))
    assert decode_body(old) == Expect("r1", [3], -1, verify=False)
    raw = NOTIF_MAGIC + msgspec.msgpack.encode(_ChunkNotifV5("r1", 0, 1))
    n = decode_notif(raw + notif_mac(KEY, raw[len(NOTIF_MAGIC):]), [KEY])
    assert n == ChunkNotif("r1", 0, 1) and n.landing is None


@pytest.mark.parametrize("landing", [[2**32, 0, 1, 0, 1], [1, -1, 1, 0, 1], [1, 0, 0, 0, 1], [1, 0, 1, 0]])
def test_a_landing_sum_out_of_range_is_refused(landing: list[int]) -> None:
    raw = NOTIF_MAGIC + msgspec.msgpack.encode(["r1", 0, 1, None, landing])
    assert decode_notif(raw + notif_mac(KEY, raw[len(NOTIF_MAGIC):]), [KEY]) is FORGED


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"some other app's notification",
        b"kv1" + encode_notif(ChunkNotif("r", 0, 1), KEY)[len(NOTIF_MAGIC):],  # another version's magic
    ],
)
def test_foreign_notifs_are_not_ours(raw: bytes) -> None:
    assert decode_notif(raw, [KEY]) is None


def _flip(raw: bytes, at: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:]


_GOOD = encode_notif(ChunkNotif("r", 0, 1, payload=b"pay"), KEY)


@pytest.mark.parametrize(
    "raw",
    [
        NOTIF_MAGIC,  # ours, but empty
        NOTIF_MAGIC + b"\xc1garbage",
        NOTIF_MAGIC + msgspec.msgpack.encode(["r", "not-an-int", 0]),
        encode_notif(ChunkNotif("r", 0, 1), OTHER),  # sealed under another link's key
        _flip(_GOOD, len(NOTIF_MAGIC) + 1),  # the request id altered
        _flip(_GOOD, len(_GOOD) - 20),  # the payload altered
        _flip(_GOOD, len(_GOOD) - 1),  # the MAC altered
        _GOOD[:-1],  # truncated
        NOTIF_MAGIC + b"\x93\xa1r\x00\x01" + b"\0" * 16,  # a valid body, no real MAC
    ],
)
def test_forged_or_malformed_notifs_are_refused(raw: bytes) -> None:
    assert decode_notif(raw, [KEY]) is FORGED


@pytest.mark.parametrize("address", ["127.0.0.1", ":80", "host:", "host:0", "host:65536", "host:8o"])
def test_split_address_rejects(address: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        split_address(address)


def test_split_address() -> None:
    assert split_address("127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert split_address("[::1]:7") == ("::1", 7)


async def test_framed_stream_over_tcp_refuses_an_oversize_frame() -> None:
    """A peer announcing a frame over the limit is refused without reading it."""
    got: list[BaseException | Message] = []
    done = anyio.Event()

    async def serve(stream: anyio.abc.SocketStream) -> None:
        framed = ControlStream(stream, max_frame_bytes=64 * 1024)
        for _ in range(2):
            try:
                got.append(await framed.recv())
            except FrameError as exc:
                got.append(exc)
                break
        await framed.aclose()
        done.set()

    with anyio.fail_after(10):
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, serve)
            client = await anyio.connect_tcp("127.0.0.1", port)
            async with client:
                await client.send(encode_frame(Expect("ok", [1, 2])))
                await client.send(struct.pack(">I", 64 * 1024 + 1) + b"\x00" * 16)
                await done.wait()
            tg.cancel_scope.cancel()
    assert got[0] == Expect("ok", [1, 2])
    assert isinstance(got[1], FrameError) and "exceeds the limit" in str(got[1])


def test_a_link_speaks_the_newest_version_both_know() -> None:
    def said(version: int, top: int = 0) -> Hello:
        return Hello(version, "kv-a", "127.0.0.1:1", b"n" * 32, top=top)

    assert negotiate(hello("kv-a", "127.0.0.1:1", b"n" * 32)) == PROTOCOL_VERSION  # this release
    assert negotiate(said(5)) == 5  # the previous release: no ``top``
    assert negotiate(said(OLDEST_VERSION, PROTOCOL_VERSION + 3)) == PROTOCOL_VERSION  # a newer one
    for version, top in ((OLDEST_VERSION - 1, 0), (PROTOCOL_VERSION + 1, PROTOCOL_VERSION + 2), (99, 0)):
        with pytest.raises(ProtocolError, match=f"{OLDEST_VERSION}-{PROTOCOL_VERSION}") as raised:
            negotiate(said(version, top))
        assert raised.value.kind == "version"


def test_a_previous_release_reads_this_releases_hello() -> None:
    """A decoder that knows only version 5's fields (an unknown field is skipped) reads
    this release's Hello, and sees the version it requires."""
    class HelloV5(msgspec.Struct, tag="hello", frozen=True):
        version: int
        agent: str
        address: str
        nonce: bytes = b""
        proof: bytes = b""
        probe: bool = False

    old = msgspec.msgpack.decode(encode_frame(hello("kv-a", "127.0.0.1:1", b"n" * 32, share=b"s" * 32))[4:],
                                 type=HelloV5)
    assert old.version == OLDEST_VERSION and old.agent == "kv-a"
