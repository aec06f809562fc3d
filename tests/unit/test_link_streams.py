"""A control link's outbox (a memory object stream) is closed on every path, including a
link admitted and then dropped before it ever ran: an unclosed stream is a ResourceWarning,
an error under the suite's ``filterwarnings = error`` at whichever test collects it."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
import uvloop

from kvservice._control.links import WRITE_BATCH_BYTES, ControlStream, FramedStream, OutboxOverflow, PeerLink
from kvservice._control.protocol import Expect, FrameError, Ping, encode_body, frame
from kvservice._trust.handshake import ACCEPTOR, DIALER, FrameMac

from ..helpers import eventually, unclosed_resources


async def _link(sock: socket.socket, lost: list[BaseException | None] | None = None,
                refused: list[str] | None = None, *, heartbeat: float = 1.0, peer_timeout: float = 5.0,
                max_outbox: int = 1 << 20) -> PeerLink:
    async def on_lost(link: PeerLink, cause: BaseException | None, graceful: bool) -> None:
        if lost is not None:
            lost.append(cause)

    stream = await anyio.abc.SocketStream.from_socket(sock)
    return PeerLink(
        ControlStream(stream, 1 << 16), agent="a", address="127.0.0.1:1", generation=1,
        on_message=lambda link, msg: None, on_lost=on_lost, heartbeat_interval=heartbeat,
        peer_timeout=peer_timeout, max_outbox_bytes=max_outbox,
        on_refused=refused.append if refused is not None else lambda kind: None,
    )


@asynccontextmanager
async def _sealed_link() -> AsyncIterator[tuple[PeerLink, ControlStream, list[int]]]:
    """A sealed link over a socket pair, not running yet; the other end's sealed stream;
    and the sizes of the writes the link's stream's ``send`` makes, as they come."""
    ours, theirs = socket.socketpair()
    key, script = b"k" * 32, b"transcript"
    reader = ControlStream(await anyio.abc.SocketStream.from_socket(theirs), 1 << 20)
    reader.mac = FrameMac(key, script, ACCEPTOR)
    try:
        link = await _link(ours)
        link._framed.mac = FrameMac(key, script, DIALER)
        writes: list[int] = []
        send = link._framed.stream.send

        async def counted(data: bytes) -> None:
            writes.append(len(data))
            await send(data)

        link._framed.stream.send = counted  # type: ignore[method-assign]
        yield link, reader, writes
    finally:
        await reader.aclose()


async def test_a_link_closed_before_it_ran_closes_its_outbox() -> None:
    ours, theirs = socket.socketpair()
    with theirs, unclosed_resources() as unclosed:
        link = await _link(ours)
        link.send(Expect("r1", [1]))  # queued before the drop, as a link's first Expect can be
        link.close(ConnectionResetError("handshake broke off"))
        link.send(Expect("r2", [2]))  # after the close: dropped, not raised
        assert link.closed
        await link._framed.aclose()  # the handshake's failure handler closes the connection
        del link
    assert unclosed == []


async def test_a_link_that_ran_closes_its_outbox() -> None:
    ours, theirs = socket.socketpair()
    with unclosed_resources() as unclosed:
        link = await _link(ours)
        theirs.close()  # the peer goes: the link's reader sees the end
        with anyio.fail_after(5):
            await link.run()
        assert link.ended.is_set() and link.closed
        del link
    assert unclosed == []


async def test_a_half_close_on_a_transport_closed_under_it_ends_the_link_as_a_reset() -> None:
    """``tell_and_close`` half-closes after the outbox drained; when the peer closed the
    connection meanwhile, uvloop's ``write_eof`` raises ``RuntimeError`` ("the handler is
    closed", seen in the soak as a ``peer.handler_error``): the link ends as a reset
    connection, not as a handler's failure."""
    ours, theirs = socket.socketpair()
    lost: list[BaseException | None] = []
    refused: list[str] = []
    with theirs:
        link = await _link(ours, lost, refused)

        async def closed_under_us() -> None:
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

        link._framed.stream.send_eof = closed_under_us  # type: ignore[method-assign]
        async with anyio.create_task_group() as tg:
            tg.start_soon(link.run)
            link.send(Expect("r1", [1]))
            await link.tell_and_close(ConnectionResetError("lost"), timeout=5)
        with anyio.fail_after(5):
            await link.ended.wait()
    assert refused == [], refused  # not counted as a handler error
    assert len(lost) == 1 and isinstance(lost[0], ConnectionResetError), lost


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a real TCP connection over loopback (``hung_up`` asks TCP's own state)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        theirs = socket.create_connection(server.getsockname())
        ours, _ = server.accept()
    ours.setblocking(False)
    return ours, theirs


async def test_hung_up_tells_a_peer_that_closed_or_reset_from_one_still_there() -> None:
    """What the control plane asks just before loading a peer's NIXL agent (``load_peer``):
    a peer that is gone (its FIN, its RST) is told from one that is quiet or has sent
    something not yet read, without reading it, and from the door's thread as well."""
    ours, theirs = _tcp_pair()
    framed = ControlStream(await anyio.abc.SocketStream.from_socket(ours), 1 << 16)
    try:
        assert not framed.hung_up()
        theirs.sendall(b"\0\0\0\1x")  # a frame not yet read
        await anyio.sleep(0.05)
        assert not framed.hung_up()
        assert not await anyio.to_thread.run_sync(framed.hung_up)
        theirs.close()  # its FIN
        await eventually(framed.hung_up, what="the FIN seen")
        assert await anyio.to_thread.run_sync(framed.hung_up)
        assert await framed.recv_body() == b"x"  # what it sent before is still there to read
    finally:
        await framed.aclose()
    assert framed.hung_up()  # closed on this side

    ours, theirs = _tcp_pair()
    framed = ControlStream(await anyio.abc.SocketStream.from_socket(ours), 1 << 16)
    try:
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # linger 0: RST
        theirs.close()
        await eventually(framed.hung_up, what="the RST seen")
    finally:
        await framed.aclose()


class _NoSocket(anyio.abc.ByteStream):
    """A byte stream with no socket under it (the simulation's transport brings such)."""

    async def receive(self, max_bytes: int = 65536) -> bytes:
        raise anyio.EndOfStream

    async def send(self, item: bytes) -> None:
        pass

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


async def test_hung_up_is_false_for_a_stream_without_a_socket() -> None:
    assert not ControlStream(_NoSocket(), 1 << 16).hung_up()


async def test_the_writer_puts_a_burst_of_queued_frames_in_few_writes_in_order_and_sealed() -> None:
    """Frames queued while the writer was busy go out together: one socket write and one
    wait per burst, not per frame (a decode scheduler's step of Expects).  Each frame is still
    sealed on its own, in queue order, and a write stays within ``WRITE_BATCH_BYTES`` plus
    one frame."""
    async with _sealed_link() as (link, reader, writes):
        small = [Expect(f"r{i}", [i]) for i in range(300)]
        big = [Expect(f"b{i}", list(range(8000))) for i in range(12)]  # ~24-40 KB each
        for msg in small + big:
            link.send(msg)  # all queued before the writer runs
        async with anyio.create_task_group() as tg:
            tg.start_soon(link.run)
            with anyio.fail_after(10):
                got = [await reader.recv() for _ in small + big]  # each opened under its own MAC
            link.close()
        assert got == small + big
        assert len(writes) < 10, writes  # 312 frames in a handful of writes
        largest = max(len(encode_body(m)) for m in big) + 64
        assert max(writes) <= WRITE_BATCH_BYTES + largest, writes


async def test_frames_that_arrive_together_are_read_at_once_and_the_reader_still_yields() -> None:
    """A burst of frames in the socket is one ``receive`` (not one for each frame's header and
    another for its body), served without a loop turn per frame, yet the reader yields every
    ``burst`` frames so that a flood cannot hold the loop; an oversized length is refused before
    its body, and a stream that ends mid-frame is ``IncompleteRead``."""
    ours, theirs = socket.socketpair()
    msgs = [Expect(f"r{i}", [i]) for i in range(100)]
    theirs.sendall(b"".join(frame(encode_body(m)) for m in msgs) + b"\x7f\xff\xff\xff" + b"x" * 10)
    theirs.close()
    framed = ControlStream(await anyio.abc.SocketStream.from_socket(ours), 1 << 16)
    reads = 0
    receive = framed.stream.receive

    async def counted(max_bytes: int = 65536) -> bytes:
        nonlocal reads
        reads += 1
        return await receive(max_bytes)

    framed.stream.receive = counted  # type: ignore[method-assign]
    turns = 0

    async def ticker() -> None:
        nonlocal turns
        while True:
            await anyio.lowlevel.checkpoint()
            turns += 1

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            with anyio.fail_after(5):
                got = [await framed.recv() for _ in msgs]
            tg.cancel_scope.cancel()
        assert got == msgs
        assert reads <= 2, reads
        assert len(msgs) // FramedStream.burst - 1 <= turns <= len(msgs) // FramedStream.burst + 2, turns
        with pytest.raises(FrameError):  # 2 GiB announced: refused on the header alone
            await framed.recv()
    finally:
        await framed.aclose()
    left, right = socket.socketpair()
    right.sendall(frame(encode_body(msgs[0]))[:-3])
    right.close()
    cut = ControlStream(await anyio.abc.SocketStream.from_socket(left), 1 << 16)
    try:
        with pytest.raises(anyio.IncompleteRead):
            await cut.recv()
    finally:
        await cut.aclose()


def _small_tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A TCP connection with small buffers: ours (non-blocking, for a link) and theirs."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        theirs = socket.socket()
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        theirs.connect(server.getsockname())
        ours, _ = server.accept()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    ours.setblocking(False)
    return ours, theirs


async def test_a_write_the_peer_never_takes_ends_the_link_though_the_peer_still_talks() -> None:
    """A peer that sends (its heartbeats come) but never reads: the queue stays under its
    bound, so it is the write in progress, unfinished for ``peer_timeout``, that ends the link
    (``OutboxOverflow``, counted), found by the liveness check."""
    ours, theirs = _small_tcp_pair()
    lost: list[BaseException | None] = []
    refused: list[str] = []
    with theirs:  # a raw socket: nothing reads it (an event loop's transport would, into memory)
        link = await _link(ours, lost, refused, heartbeat=0.1, peer_timeout=1.0, max_outbox=64 << 20)
        for i in range(100):  # ~2.4 MiB: under the link's bound, far over what the kernel buffers
            link.send(Expect(f"b{i}", list(range(8000))))

        async def heartbeats() -> None:
            while True:
                theirs.send(frame(encode_body(Ping())))
                await anyio.sleep(0.1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeats)
            began = time.monotonic()
            with anyio.fail_after(10):
                await link.run()
            tg.cancel_scope.cancel()
    assert 1.0 <= time.monotonic() - began < 5, time.monotonic() - began
    assert len(lost) == 1 and isinstance(lost[0], OutboxOverflow), lost
    assert refused == ["outbox_overflow"], refused


async def test_a_lone_frame_is_written_at_once_and_a_turns_others_are_queued_in_order_and_sealed() -> None:
    """A frame with nothing before it goes to the kernel within ``send`` (no writer task
    wake-up, no loop turn); the frames sent after it in the same loop turn are queued and
    the writer puts them in one write; frames sent while the writer holds some are queued
    behind them.  Every frame arrives in order, each opened under its own MAC."""
    async with _sealed_link() as (link, reader, writes):
        assert link._framed.writes_now  # anyio's asyncio socket stream: else every frame waits for the writer
        sent: list[Expect] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(link.run)
            await anyio.sleep(0.05)  # the writer waits on an empty outbox
            lone = Expect("lone", [0])
            link.send(lone)
            sent.append(lone)
            assert (link.written_now, link.written_queued, writes) == (1, 0, [])  # in the kernel already
            with anyio.fail_after(5):
                assert await reader.recv() == lone
            burst = [Expect(f"r{i}", [i]) for i in range(50)]
            for msg in burst:
                link.send(msg)
            sent += burst
            assert (link.written_now, link.written_queued) == (2, 49)
            with anyio.fail_after(5):
                assert [await reader.recv() for _ in burst] == burst
            assert len(writes) == 1, writes  # the 49 in one write
            for round_ in range(20):  # turns that find the writer idle, busy, or a turn open
                for i in range(round_ % 4):
                    msg = Expect(f"m{round_}-{i}", [i])
                    link.send(msg)
                    sent.append(msg)
                if round_ % 3:
                    await anyio.lowlevel.checkpoint()
                else:
                    await anyio.sleep(0.005)
            rest = len(sent) - 51
            with anyio.fail_after(5):
                got = [await reader.recv() for _ in range(rest)]
            assert got == sent[51:]
            assert link.written_now > 2 and link.written_queued > 49, (link.written_now, link.written_queued)
            link.close()


async def test_a_frame_written_at_once_into_a_broken_connection_ends_the_link() -> None:
    """The transport's own write raising (the connection broke under it) closes the link
    with that error as its cause; ``send`` itself never raises."""
    ours, theirs = socket.socketpair()
    lost: list[BaseException | None] = []
    with theirs:
        link = await _link(ours, lost)
        async with anyio.create_task_group() as tg:
            tg.start_soon(link.run)
            await anyio.sleep(0.05)
            now = link._framed._now
            assert now is not None
            now.transport = _Broken()
            link.send(Expect("r1", [1]))
            with anyio.fail_after(5):
                await link.ended.wait()
    assert len(lost) == 1 and isinstance(lost[0], ConnectionResetError), lost


class _Broken:
    """A transport whose connection broke under its write (idle until written to)."""

    def write(self, data: bytes) -> None:
        raise ConnectionResetError("reset under the write")

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0


def test_uvloop_streams_are_written_at_once_too() -> None:
    """The services run on uvloop, whose transports are no subclass of asyncio's: a lone
    frame there is written within ``send`` as well, and arrives."""

    async def main() -> None:
        ours, theirs = socket.socketpair()
        reader = ControlStream(await anyio.abc.SocketStream.from_socket(theirs), 1 << 20)
        try:
            link = await _link(ours)
            assert link._framed.writes_now
            async with anyio.create_task_group() as tg:
                tg.start_soon(link.run)
                await anyio.sleep(0.05)
                link.send(Expect("lone", [0]))
                assert link.written_now == 1
                with anyio.fail_after(5):
                    assert await reader.recv() == Expect("lone", [0])
                link.close()
        finally:
            await reader.aclose()

    uvloop.run(main())


async def test_frames_written_at_once_to_a_peer_that_stopped_reading_still_end_the_link() -> None:
    """Frames sent one per loop turn to a running link take the direct way while the
    connection has nothing unsent; once the kernel's buffer is full the transport keeps the
    rest, the next frames queue behind it, and the writer's unfinished write ends the link
    (``OutboxOverflow``) after ``peer_timeout``, as for frames that were queued all along."""
    ours, theirs = _small_tcp_pair()
    lost: list[BaseException | None] = []
    refused: list[str] = []
    with theirs:  # nothing reads it
        link = await _link(ours, lost, refused, heartbeat=0.1, peer_timeout=1.0, max_outbox=64 << 20)

        async def talk() -> None:
            while True:
                theirs.send(frame(encode_body(Ping())))  # its heartbeats keep coming
                link.send(Expect(f"b{link.written_now + link.written_queued}", list(range(2000))))
                await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg:
            tg.start_soon(link.run)
            tg.start_soon(talk)
            began = time.monotonic()
            with anyio.fail_after(10):
                await link.ended.wait()
            tg.cancel_scope.cancel()
    assert 1.0 <= time.monotonic() - began < 5, time.monotonic() - began
    assert link.written_now >= 1 and link.written_queued >= 1, (link.written_now, link.written_queued)
    assert len(lost) == 1 and isinstance(lost[0], OutboxOverflow), lost
    assert refused == ["outbox_overflow"], refused
