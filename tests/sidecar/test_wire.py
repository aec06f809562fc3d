"""The worker socket's framing (``SocketFrames``): frames written straight to the
socket and read whole, with the generic ``FramedStream``'s behaviour at the edges:
frames split across reads or several in one, a full socket, an oversized length,
a connection that ends mid-frame or is closed."""

from __future__ import annotations

import asyncio
import socket
import struct
import types
from collections.abc import Callable

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

from kvservice._control.protocol import FrameError
from kvservice.sidecar import frames
from kvservice.sidecar.frames import SocketFrames, frame_stream
from kvservice.sidecar.wire import (
    SIDECAR_OLDEST_VERSION,
    SIDECAR_PROTOCOL_VERSION,
    Finished,
    Send,
    Status,
    WireResult,
    decode_client,
    decode_server,
    encode,
    sidecar_version,
)

RESULT = WireResult("r1", "SUCCESS", None, None, None, "", 4096, 1, 1.0, 1.5, 2.0)


async def pair() -> tuple[anyio.abc.UNIXSocketStream, anyio.abc.UNIXSocketStream]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return await anyio.abc.UNIXSocketStream.from_socket(a), await anyio.abc.UNIXSocketStream.from_socket(b)


async def test_frames_round_trip_and_split_reads() -> None:
    a, b = await pair()
    worker, daemon = frame_stream(a, 1 << 20, decode_server), frame_stream(b, 1 << 20, decode_client)
    assert isinstance(worker, SocketFrames) and worker._sock is not None
    msgs = [Send(1, "r1", [0, 1, 2], True, None), Status(2), Send(3, "r2", list(range(5000)))]
    for m in msgs:  # several frames in one read
        await worker.send(m)
    assert [await daemon.recv() for _ in msgs] == msgs
    raw = b"".join(encode(m) for m in msgs)

    async def dribble() -> None:  # frames split across reads, the header too
        for i in range(0, len(raw), 7):
            await a.send(raw[i:i + 7])

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(dribble)
            assert [await daemon.recv() for _ in msgs] == msgs
    await daemon.send(Finished("send", RESULT))
    assert await worker.recv() == Finished("send", RESULT)
    await worker.aclose()
    await daemon.aclose()


async def test_a_full_socket_is_written_as_the_reader_drains_it() -> None:
    a, b = await pair()
    a.extra(anyio.abc.SocketAttribute.raw_socket).setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    worker, daemon = frame_stream(a, 1 << 24, decode_server), frame_stream(b, 1 << 24, decode_client)
    msgs = [Send(n, f"r{n}", list(range(20_000))) for n in range(1, 6)]  # far more than the buffers hold
    got = []
    async with anyio.create_task_group() as tg:
        async def read() -> None:
            for _ in msgs:
                got.append(await daemon.recv())

        tg.start_soon(read)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as writers:  # concurrent senders: frames never interleave
                for m in msgs:
                    writers.start_soon(worker.send, m)
    assert sorted(got, key=lambda m: m.call) == msgs
    await worker.aclose()
    await daemon.aclose()


async def test_a_write_the_socket_takes_at_once_arms_no_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The usual write (a socket with room) enters no cancel scope and arms no timer,
    whatever ``timeout`` and ``shield`` say: those cost every call and every result."""
    a, b = await pair()
    worker, daemon = frame_stream(a, 1 << 20, decode_server), frame_stream(b, 1 << 20, decode_client)

    def no_scope(*args: object, **kw: object) -> None:
        raise AssertionError("a scope on the fast path")

    with monkeypatch.context() as m:
        m.setattr(frames.anyio, "fail_after", no_scope)
        m.setattr(frames.anyio, "CancelScope", no_scope)
        await worker.send(Status(1), 5.0, shield=True)
    assert await daemon.recv() == Status(1)
    await worker.aclose()
    await daemon.aclose()


async def test_a_full_socket_times_out_and_a_cancelled_shielded_write_ends_whole() -> None:
    """A socket nobody drains: ``timeout`` raises ``TimeoutError`` (the caller drops the
    connection).  A shielded write whose caller is cancelled meanwhile still ends whole
    once the reader drains: the reader then sees whole frames only."""
    a, b = await pair()
    a.extra(anyio.abc.SocketAttribute.raw_socket).setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    worker, daemon = frame_stream(a, 1 << 24, decode_server), frame_stream(b, 1 << 24, decode_client)
    big = Send(1, "r1", list(range(200_000)))  # far more than the buffers hold
    with anyio.fail_after(10):
        with pytest.raises(TimeoutError):
            await worker.send(big, 0.2)
    a2, b2 = await pair()
    a2.extra(anyio.abc.SocketAttribute.raw_socket).setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    worker2, daemon2 = frame_stream(a2, 1 << 24, decode_server), frame_stream(b2, 1 << 24, decode_client)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            done = anyio.Event()

            async def write() -> None:
                with anyio.CancelScope() as scope:
                    scope.cancel()  # cancelled before and during: the shield keeps it writing
                    await worker2.send(big, 10.0, shield=True)
                done.set()

            tg.start_soon(write)
            await anyio.sleep(0.1)
            assert not done.is_set()  # still writing: nobody has read
            assert await daemon2.recv() == big
            await done.wait()
    for s in (worker, daemon, worker2, daemon2):
        await s.aclose()


async def test_an_oversized_length_is_refused_before_the_body() -> None:
    a, b = await pair()
    daemon = frame_stream(b, 1024, decode_client)
    await a.send(struct.pack(">I", 1025))
    with anyio.fail_after(5), pytest.raises(FrameError):
        await daemon.recv()
    await a.aclose()
    await daemon.aclose()


async def test_a_connection_that_ends_mid_frame_or_between_frames() -> None:
    a, b = await pair()
    daemon = frame_stream(b, 1024, decode_client)
    await a.send(encode(Status(1))[:-1])
    await a.aclose()
    with anyio.fail_after(5), pytest.raises(anyio.IncompleteRead):
        await daemon.recv()
    await daemon.aclose()
    a, b = await pair()
    daemon = frame_stream(b, 1024, decode_client)
    await a.aclose()
    with anyio.fail_after(5), pytest.raises(anyio.IncompleteRead):  # as the generic FramedStream
        await daemon.recv()
    await daemon.aclose()


class LoopSpy:
    """The loop as ``SocketFrames`` sees it, counting its readers added and removed."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.added = self.removed = 0

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        self.added += 1
        self.loop.add_reader(fd, callback)

    def remove_reader(self, fd: int) -> bool:
        self.removed += 1
        return self.loop.remove_reader(fd)

    def create_future(self) -> asyncio.Future[None]:
        return self.loop.create_future()


async def test_the_reader_is_registered_once_while_frames_keep_coming(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads that wait, one after another, register the loop's reader once (anyio's
    ``receive`` added and removed one per read); data that comes while nobody reads
    removes it (the loop would call it every turn), and the next read takes that data
    without a wait."""
    spy = LoopSpy()
    monkeypatch.setattr(frames, "asyncio", types.SimpleNamespace(get_running_loop=lambda: spy))
    a, b = await pair()
    worker, daemon = frame_stream(a, 1024, decode_server), frame_stream(b, 1024, decode_client)
    fd = b.extra(anyio.abc.SocketAttribute.raw_socket).fileno()
    with anyio.fail_after(10):
        got: list[object] = []
        async with anyio.create_task_group() as tg:

            async def read(n: int) -> None:
                for _ in range(n):
                    got.append(await daemon.recv())

            tg.start_soon(read, 4)
            for call in (1, 2, 3, 4):
                await anyio.sleep(0.01)  # the reader waits again
                assert daemon._reading == fd and daemon._readable is not None
                await worker.send(Status(call))
        assert got == [Status(1), Status(2), Status(3), Status(4)]
        assert spy.added == 1 and spy.removed <= 1  # (asyncio's loop may call it once more, and remove it)
        await worker.send(Status(5))  # nobody reads: the reader goes
        for _ in range(100):
            await anyio.sleep(0.001)
            if daemon._reading is None:
                break
        assert daemon._reading is None
        added = spy.added
        assert await daemon.recv() == Status(5) and spy.added == added  # read without a wait
    await worker.aclose()
    await daemon.aclose()


async def test_a_cancelled_or_closed_wait_leaves_no_reader() -> None:
    a, b = await pair()
    worker, daemon = frame_stream(a, 1024, decode_server), frame_stream(b, 1024, decode_client)
    with anyio.fail_after(10):
        with anyio.move_on_after(0.05) as scope:
            await daemon.recv()
        assert scope.cancelled_caught and daemon._reading is None and daemon._readable is None
        await worker.send(Status(1))  # the stream reads on after a cancelled read
        assert await daemon.recv() == Status(1)
        async with anyio.create_task_group() as tg:  # one reader at a time
            tg.start_soon(daemon.recv)
            await anyio.sleep(0.01)
            with pytest.raises(anyio.BusyResourceError):
                await daemon.recv()
            tg.cancel_scope.cancel()
        assert daemon._reading is None

        async def closing() -> None:
            await anyio.sleep(0.05)
            await daemon.aclose()

        async with anyio.create_task_group() as tg:  # closed while a read waits: it ends at once
            tg.start_soon(closing)
            with pytest.raises(anyio.ClosedResourceError):
                await daemon.recv()
        assert daemon._reading is None
        with pytest.raises(anyio.ClosedResourceError):
            await daemon.recv()
    await worker.aclose()


async def test_frames_already_in_the_socket_are_read_a_loop_turn_apart() -> None:
    """A peer that keeps the socket full cannot hold the reader's loop: a read that found
    data there yields a turn.  Frames of 40 KiB, four written before the first read: each
    takes a read of its own (64 KiB at a time), none waits."""
    a, b = await pair()
    daemon = frame_stream(b, 1 << 20, decode_client)
    frames = [encode(Send(n, f"r{n}", list(range(1000, 15_000)))) for n in range(1, 5)]
    assert all(40_000 < len(f) < 48_000 for f in frames)
    a.extra(anyio.abc.SocketAttribute.raw_socket).sendall(b"".join(frames))  # fits in the socket
    turns = 0

    async def ticker() -> None:
        nonlocal turns
        while True:
            turns += 1
            await anyio.lowlevel.checkpoint()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.lowlevel.checkpoint()
            before = turns
            got = [await daemon.recv() for _ in frames]
            ticked = turns - before
            tg.cancel_scope.cancel()
    assert [m.call for m in got] == [1, 2, 3, 4]  # type: ignore[union-attr]
    assert ticked >= len(frames)
    await a.aclose()
    await daemon.aclose()


@pytest.mark.parametrize("rounds", [20])
async def test_a_socket_that_reuses_a_closed_ones_descriptor_is_read(rounds: int) -> None:
    """The server's way of ending a connection: ``stop_reading``, then the stream is closed
    beneath the framing (``accept_loop``).  A reader left on the closed descriptor would sit
    on the next socket given that number (asyncio's own loop then never reads it)."""
    for call in range(1, rounds + 1):
        a, b = await pair()
        worker, daemon = frame_stream(a, 1024, decode_server), frame_stream(b, 1024, decode_client)
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(worker.send, Status(call))
                assert await daemon.recv() == Status(call)  # a read that waited: registered
        daemon.stop_reading()
        await b.aclose()
        await worker.aclose()


async def test_sending_on_a_closed_or_broken_stream_raises_the_streams_errors() -> None:
    a, b = await pair()
    worker = frame_stream(a, 1024, decode_server)
    await b.aclose()
    with pytest.raises((anyio.BrokenResourceError, anyio.ClosedResourceError)):
        for _ in range(3):  # the peer's close may take a write to be noticed
            await worker.send(Status(1))
    await worker.aclose()
    with pytest.raises(anyio.ClosedResourceError):
        await worker.send(Status(2))


async def test_tcp_streams_keep_the_streams_own_writes() -> None:
    """anyio's TCP stream may still hold bytes in its transport when ``send`` returns, so a
    direct write could overtake them: only Unix sockets are written directly."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        with anyio.fail_after(10):
            async with await anyio.connect_tcp("127.0.0.1", port) as tcp:
                framed = frame_stream(tcp, 1 << 20, decode_server)
                assert isinstance(framed, SocketFrames) and framed._sock is None


@pytest.mark.parametrize("fields", [
    {"layers": [-1, 2]},  # a negative layer
    {"layers": [0, 1, 2]},  # not a [lo, hi) pair
    {"layers": "0:2"},
    {"payload": b"x" * ((1 << 20) + 1)},  # beyond any payload a frame may carry
    {"payload": "text"},
])
def test_a_send_with_malformed_layers_or_payload_is_refused_at_decoding(fields: dict[str, object]) -> None:
    import msgspec

    body = msgspec.msgpack.encode({"type": "send", "call": 1, "request_id": "r", "pages": [1], **fields})
    with pytest.raises(FrameError):
        decode_client(body)


def test_live_peers_frames_are_bounded_at_decoding() -> None:
    """A role longer than any member's, and a member the daemon could not have read from etcd
    (a name etcd's key could not hold), are malformed frames, as a bad registration is."""
    import msgspec

    from kvservice.discovery.member import Member
    from kvservice.sidecar.wire import LivePeers, PeersReply

    assert decode_client(encode(LivePeers(1, "decode"))[4:]) == LivePeers(1, "decode")
    with pytest.raises(FrameError):
        decode_client(msgspec.msgpack.encode({"type": "live_peers", "call": 1, "role": "r" * 64}))
    member = Member(name="prefill-0", address="127.0.0.1:7100", agent="a", incarnation=1, role="prefill")
    assert decode_server(encode(PeersReply(2, [member]))[4:]) == PeersReply(2, [member])
    bad = msgspec.to_builtins(PeersReply(2, [member]))
    bad["members"][0]["name"] = "../etc"
    with pytest.raises(FrameError):
        decode_server(msgspec.msgpack.encode(bad))


def test_a_daemon_serves_the_previous_release_and_answers_a_newer_client_with_its_own() -> None:
    assert sidecar_version(SIDECAR_PROTOCOL_VERSION) == SIDECAR_PROTOCOL_VERSION
    assert sidecar_version(SIDECAR_PROTOCOL_VERSION + 3) == SIDECAR_PROTOCOL_VERSION  # the client decides
    assert sidecar_version(SIDECAR_OLDEST_VERSION) == SIDECAR_OLDEST_VERSION
    assert sidecar_version(SIDECAR_OLDEST_VERSION - 1) is None


def test_a_field_newer_than_the_daemon_is_refused_before_it_is_sent_and_a_default_is_not_sent() -> None:
    """``Send.receiver`` and ``Expect.verify`` came with protocol 4.  Left at their default
    they are not on the wire, so a daemon of 2 or 3 (which refuses an unknown field) still
    decodes the frame; set, they go only to a daemon of 4."""
    import msgspec

    from kvservice.sidecar.wire import Expect, call_refusal

    plain, pinned = Send(1, "r", [0], True), Send(2, "r", [0], True, receiver="127.0.0.1:7100")
    checked = Expect(3, "r", [0], "127.0.0.1:7100", verify=False)
    assert msgspec.msgpack.decode(encode(plain)[4:]) == {"type": "send", "call": 1, "request_id": "r", "pages": [0],
                                                         "last": True}
    assert "verify" not in msgspec.msgpack.decode(encode(Expect(4, "r", [0], "127.0.0.1:7100"))[4:])
    assert decode_client(encode(pinned)[4:]) == pinned and decode_client(encode(checked)[4:]) == checked
    for old in (SIDECAR_OLDEST_VERSION, 3):
        assert call_refusal(plain, old) is None
        speaks = f"is protocol version 4, this connection speaks {old}"
        assert call_refusal(pinned, old) == f"the send call's receiver= {speaks}"
        assert call_refusal(checked, old) == f"the expect call's verify= {speaks}"
    assert call_refusal(pinned, 4) is None and call_refusal(checked, 4) is None
    with pytest.raises(FrameError):  # bounded as a sender is
        decode_client(msgspec.msgpack.encode({"type": "send", "call": 1, "request_id": "r", "pages": [1],
                                              "receiver": "h" * 513}))


def test_expect_member_is_protocol_5_bounded_as_a_members_name_and_not_sent_at_its_default() -> None:
    """``Expect.member`` (the member a registry vouched for at the sender) came with
    protocol 5: it round-trips, is not on the wire when left at ``None`` (a daemon of 2 to 4
    decodes the frame), and a call that sets it is refused on a connection of 2 to 4."""
    import msgspec

    from kvservice.discovery.member import MAX_NAME_CHARS
    from kvservice.sidecar.wire import FIELDS_SINCE, Expect, call_refusal

    assert SIDECAR_PROTOCOL_VERSION == 5 and FIELDS_SINCE[(Expect, "member")] == 5
    named = Expect(5, "r", [0], "127.0.0.1:7100", member="prefill-1")
    assert decode_client(encode(named)[4:]) == named
    assert msgspec.msgpack.decode(encode(named)[4:])["member"] == "prefill-1"
    assert "member" not in msgspec.msgpack.decode(encode(Expect(6, "r", [0], "127.0.0.1:7100", verify=True))[4:])
    for old in (SIDECAR_OLDEST_VERSION, 3, 4):
        assert call_refusal(named, old) == (f"the expect call's member= is protocol version 5, "
                                            f"this connection speaks {old}")
    assert call_refusal(Expect(7, "r", [0], "127.0.0.1:7100", verify=True), 4) is None
    assert call_refusal(named, 5) is None
    base = {"type": "expect", "call": 1, "request_id": "r", "pages": [1], "sender": "127.0.0.1:7100"}
    for bad in ("", "m" * (MAX_NAME_CHARS + 1), 7):
        with pytest.raises(FrameError):  # bounded as a member's name is
            decode_client(msgspec.msgpack.encode({**base, "member": bad}))
