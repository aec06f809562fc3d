"""Control-channel links to peers: framing, outbox and liveness.

A ``PeerLink`` is one TCP connection to one peer service, after the handshake
(``plane``).  It is used in both directions whichever side dialled.  The
service owns what the link *means* (requests tied to the peer); this module
only moves frames and says when the link is gone, and why.
"""

from __future__ import annotations

import asyncio
import math
import select
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

from .._log import get_logger
from .._results import KVServiceError
from .._trust.handshake import FrameMac
from .preauth import source_of
from .protocol import (
    HEADER_BYTES,
    Bye,
    FrameError,
    Message,
    Ping,
    decode_body,
    encode_body,
    encode_frame,
    frame,
    frame_length,
)

__all__ = ["CONNECTION_ERRORS", "ControlStream", "FramedStream", "OutboxOverflow", "PeerLink", "try_send"]

log = get_logger("kvservice.peers")

#: errors that mean "the connection is gone", as opposed to a protocol breach
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.IncompleteRead,
    OSError,
)


R = TypeVar("R")


#: ``poll`` events that say the other end is gone: its FIN (``POLLRDHUP``), its RST (``POLLERR``)
_HUNG_UP = select.POLLRDHUP | select.POLLHUP | select.POLLERR


#: bytes asked of the stream per read (more when a frame's rest is longer, up to READ_MAX):
#: a small frame and whatever follows it come in one.  Not larger: recv() allocates what it
#: is asked for (measured: 4 us for 64 KiB, 22 us for 256 KiB, per call)
READ_BYTES = 64 * 1024
READ_MAX = 1024 * 1024


class FramedStream(Generic[R]):
    """Length-prefixed msgpack frames over a byte stream.

    ``decode`` turns a frame body into a received message (raising ``FrameError``)
    and ``encode`` a message into a whole frame; the control plane and the
    sidecar's worker socket each bring their own pair.

    Frames are read from the stream's own chunks: one ``receive`` brings a frame's
    header, its body and whatever has arrived after it (anyio's ``receive_exactly`` asked
    the socket for the 4-byte header and then for the body, each a loop turn, and paused
    and resumed the socket's reading each time the queue ran dry).  The length is still
    checked before the body is waited for.  Frames that came in one read are served
    without a loop turn each, ``burst`` at a time, then the reader yields once: a burst of
    frames costs no turn per frame and cannot hold the loop."""

    #: frames served from earlier reads between two yields to the loop
    burst = 32

    def __init__(
        self, stream: anyio.abc.ByteStream, max_frame_bytes: int,
        decode: Callable[[bytes], R], encode: Callable[[Any], bytes],
    ) -> None:
        self._stream = stream
        self._buf = bytearray()
        self._served = 0  # frames served since the last read or yield
        self._limit = max_frame_bytes
        self._decode = decode
        self._encode = encode
        self._write_lock = anyio.Lock(fast_acquire=True)  # no yield when uncontended

    @property
    def stream(self) -> anyio.abc.ByteStream:
        return self._stream

    def hung_up(self) -> bool:
        """Whether the other end closed the connection (its FIN or RST has arrived), asked of
        the kernel without reading anything: callable from any thread while the stream is
        open.  ``False`` for a stream without a socket (the simulation's)."""
        sock = self._stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
        if sock is None:
            return False
        fd = sock.fileno()
        if fd < 0:  # closed on this side
            return True
        poller = select.poll()
        poller.register(fd, _HUNG_UP)
        return any(events & _HUNG_UP for _, events in poller.poll(0))

    async def recv_body(self, limit: int | None = None) -> bytes:
        """The next frame's body; ``FrameError`` above ``limit`` (default: the stream's);
        ``IncompleteRead`` when the stream ends (between frames too)."""
        buf = self._buf
        read = False
        while len(buf) < HEADER_BYTES:
            await self._fill(READ_BYTES)
            read = True
        n = frame_length(bytes(buf[:HEADER_BYTES]), limit or self._limit)
        end = HEADER_BYTES + n
        while len(buf) < end:
            await self._fill(min(max(end - len(buf), READ_BYTES), READ_MAX))
            read = True
        if read:
            self._served = 0
        else:  # it came with an earlier frame
            self._served += 1
            if self._served >= self.burst:
                self._served = 0
                await anyio.lowlevel.checkpoint()
        body = bytes(buf[HEADER_BYTES:end])
        del buf[:end]
        return body

    async def _fill(self, max_bytes: int) -> None:
        try:
            self._buf += await self._stream.receive(max_bytes)
        except anyio.EndOfStream as exc:  # as anyio's receive_exactly: the stream ended
            raise anyio.IncompleteRead from exc

    async def recv(self) -> R:
        """The next message; ``FrameError`` for an oversized or malformed frame."""
        return self._decode(await self.recv_body())

    async def send(self, msg: Any) -> None:
        await self.send_frame(self._encode(msg))

    async def send_frame(self, data: bytes) -> None:
        async with self._write_lock:
            await self._stream.send(data)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self._stream.aclose()
            except CONNECTION_ERRORS:
                pass


class ControlStream(FramedStream[Message]):
    """The peer control protocol's frames; once ``mac`` is set (after the handshake
    proved the key) every frame is sealed and checked (``_trust.handshake.FrameMac``)."""

    def __init__(self, stream: anyio.abc.ByteStream, max_frame_bytes: int) -> None:
        super().__init__(stream, max_frame_bytes, decode_body, encode_frame)
        self.mac: FrameMac | None = None
        self._now = _Writable.of(stream)

    @property
    def source(self) -> str:
        """The remote IP address of this connection (``preauth.source_of``)."""
        return source_of(self._stream)

    async def recv(self, limit: int | None = None) -> Message:
        """The next message (``limit``: a smaller frame bound, before authentication)."""
        body = await self.recv_body(limit)
        if self.mac is not None:
            opened = self.mac.open(body)
            if opened is None:
                raise FrameError("frame failed authentication (forged, altered or replayed)")
            body = opened
        return decode_body(body)

    async def send(self, msg: Any) -> None:
        await self.send_body(encode_body(msg))

    async def send_body(self, body: bytes) -> None:
        """Frame (and seal) an encoded message and write it."""
        await self.send_bodies((body,))

    async def send_bodies(self, bodies: Sequence[bytes]) -> None:
        """Frame (and seal) encoded messages, in order, and write them at once.  Sealing
        happens in write order: the MAC's sequence number is the frame's place on the wire."""
        mac = self.mac
        async with self._write_lock:
            frames = [frame(mac.seal(b) if mac is not None else b) for b in bodies]
            await self._stream.send(frames[0] if len(frames) == 1 else b"".join(frames))

    def write_now(self, body: bytes) -> bool:
        """Frame, seal and write ``body`` without waiting, when nothing stands before it:
        no write in progress here and nothing left unsent in the connection (so the frame
        goes to the kernel at once and in order).  False, having done nothing, otherwise,
        and for a stream that offers no such write: the caller queues it for ``send_bodies``.
        Raises what the connection's write raises (it is broken then)."""
        now = self._now
        if now is None or self._write_lock.locked() or not now.idle():
            return False
        mac = self.mac
        now.transport.write(frame(mac.seal(body) if mac is not None else body))
        return True

    @property
    def writes_now(self) -> bool:
        """Whether this stream can take ``write_now`` (a socket under anyio's asyncio backend)."""
        return self._now is not None


class _Transport(Protocol):
    def write(self, data: bytes) -> None: ...
    def is_closing(self) -> bool: ...
    def get_write_buffer_size(self) -> int: ...


class _Writable:
    """The transport under an anyio asyncio socket stream, written directly while idle.

    anyio's ``send`` writes to the same transport, after a checkpoint (a loop turn) and
    then a wait for the transport's room; a write to a transport with nothing buffered and
    room to spare needs neither, and goes to the kernel within the call.  This reads three
    attributes of anyio's stream class (``_transport``, ``_protocol`` with its
    ``write_event``, ``_closed``); a release that renames them leaves ``of`` returning None,
    and every frame takes the writer's way (``tests/unit/test_link_streams.py`` says so).
    The sidecar's worker socket has a direct write of its own (``sidecar.wire``): a Unix
    stream there, a raw socket with no transport in between."""

    __slots__ = ("_protocol", "_stream", "transport")

    def __init__(self, stream: Any, transport: _Transport, protocol: Any) -> None:
        self._stream, self.transport, self._protocol = stream, transport, protocol

    @classmethod
    def of(cls, stream: anyio.abc.ByteStream) -> _Writable | None:
        transport: Any = getattr(stream, "_transport", None)
        protocol = getattr(stream, "_protocol", None)
        # (uvloop's transports are no subclass of asyncio's: their methods are what counts)
        if not (all(callable(getattr(transport, m, None)) for m in ("write", "is_closing", "get_write_buffer_size"))
                and isinstance(getattr(protocol, "write_event", None), asyncio.Event)
                and isinstance(getattr(stream, "_closed", None), bool)):
            return None
        return cls(stream, transport, protocol)

    def idle(self) -> bool:
        p, t = self._protocol, self.transport
        return (not self._stream._closed and p.exception is None and p.write_event.is_set()
                and not t.is_closing() and t.get_write_buffer_size() == 0)


#: what a transport's write raises when its connection broke (uvloop: RuntimeError)
_WRITE_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, *CONNECTION_ERRORS)

#: bytes of queued frames the link's writer puts in one write (``PeerLink._writer``)
WRITE_BATCH_BYTES = 256 * 1024

#: wakes of a link's liveness check in a row that come late (this service's own loop held)
#: and so do not judge the peer's silence (``PeerLink._liveness``)
STALLS_FORGIVEN = 3


class OutboxOverflow(KVServiceError):
    """The peer stopped reading: more than ``max_outbox_bytes`` queued for it, or none
    of it taken for ``peer_timeout_s``.

    Never raised to a caller: it closes the link, and is kept as the ``error`` of the
    requests that fail ``PEER_LOST`` with it."""


_LINK_ENDINGS: tuple[type[BaseException], ...] = (*CONNECTION_ERRORS, OutboxOverflow)

OnMessage = Callable[["PeerLink", Message], None]
OnLost = Callable[["PeerLink", BaseException | None, bool], Awaitable[None]]


class PeerLink:
    """A live control link to one peer incarnation (``agent``), the ``generation``-th
    link this service has made.

    ``send`` never blocks or raises: encoded frames queue in an outbox drained by
    the link's writer, so the service can speak from synchronous code.  The
    outbox is bounded in bytes (``max_outbox_bytes``): a peer that does not read
    is dropped as lost (``OutboxOverflow``), not buffered for ever.  When the link
    ends (EOF, error, silence past ``peer_timeout``, protocol breach, overflow, an
    exception in ``on_message``, or ``close()``) ``on_lost(link, cause, graceful)``
    runs exactly once.
    """

    def __init__(
        self, framed: ControlStream, *, agent: str, address: str, generation: int,
        on_message: OnMessage, on_lost: OnLost, heartbeat_interval: float, peer_timeout: float,
        max_outbox_bytes: int, on_refused: Callable[[str], object] = lambda kind: None,
    ) -> None:
        self.agent = agent
        self.address = address
        self.generation = generation
        self._framed = framed
        self._on_message = on_message
        self._on_lost = on_lost
        self._on_refused = on_refused
        self._heartbeat = heartbeat_interval
        self._peer_timeout = peer_timeout
        self._max_outbox = max_outbox_bytes
        self._queued = 0  # bytes in the outbox
        self._send, self._outbox = anyio.create_memory_object_stream[bytes](math.inf)
        self._scope = anyio.CancelScope()
        self._drained = anyio.Event()
        self.ended = anyio.Event()  # set once on_lost has run
        self.last_rx = time.monotonic()
        self.closed = False
        self._closing = False
        self._telling = False  # tell_and_close: the outbox drains, then a half-close
        self.graceful = False  # the peer said Bye
        self._cause: BaseException | None = None
        self._running = False  # run() has begun: it closes the outbox when the link ends
        #: when the writer's write in progress began (``None``: not writing); one that takes
        #: more than ``peer_timeout`` ends the link (``_liveness``)
        self._writing_since: float | None = None
        #: the writer holds frames taken from the outbox, not yet written
        self._writer_busy = False
        #: the loop ``run`` runs on while a frame written at once may have company coming
        #: in the same loop turn (``send``); None: not running, or no such frame
        self._loop: asyncio.AbstractEventLoop | None = None
        self._turn_open = False
        #: frames ``send`` wrote at once, and those it queued for the writer
        self.written_now = 0
        self.written_queued = 0

    def send(self, msg: Message) -> None:
        """Send ``msg``, never waiting; dropped once the link is closing (nothing may
        follow Bye).

        A frame with nothing before it (the outbox empty, the writer idle, nothing unsent in
        the connection) is written here and now: a lone frame (a decode's Expect, a sender's
        Posted) reaches the kernel without waking the writer task, which costs a loop turn
        and anyio's checkpoint before its write (a 2 MiB hand-off: 2.40 -> 2.25 ms p50,
        docs/perf/library.md).  Once one has gone so, the others sent in the same loop turn
        are queued, and the writer puts them in one write, as a burst always was (a decode
        scheduler's step of Expects: one write, not one each)."""
        if self.closed or self._closing:
            return
        body = encode_body(msg)
        loop = self._loop
        if (loop is not None and not self._turn_open and not self._queued and not self._writer_busy):
            try:
                wrote = self._framed.write_now(body)
            except _WRITE_ERRORS as exc:  # the connection broke under it
                self.close(exc)
                return
            if wrote:
                self.written_now += 1
                self._turn_open = True
                loop.call_soon(self._close_turn)
                return
        self.written_queued += 1
        self._queued += len(body)
        if self._queued > self._max_outbox:
            self._on_refused("outbox_overflow")
            self.close(OutboxOverflow(
                f"peer {self.address} is not reading: {self._queued} bytes queued, limit {self._max_outbox}"))
            return
        self._send.send_nowait(body)

    def _close_turn(self) -> None:
        self._turn_open = False

    async def outlived(self, within: float) -> bool:
        """Whether this link is dead, asked when its agent links again: it gets ``within``
        seconds to be heard from (a live peer heartbeats) or to close (a dead one closes once
        silent ``peer_timeout``; a network cut can keep its peer's close from reaching us).
        True once it has closed; False when a frame came on it first, or neither came in time."""
        asked = time.monotonic()
        with anyio.move_on_after(within):
            while self.last_rx <= asked and not self.closed:
                with anyio.move_on_after(self._heartbeat / 4):
                    await self.ended.wait()
        return self.closed

    def close(self, cause: BaseException | None = None) -> None:
        if self._cause is None:
            self._cause = cause
        self._scope.cancel()
        if not self._running:
            # A link admitted and dropped before it ran (its handshake broke off after the
            # admit): ``run``'s cleanup will never come, so the outbox is closed here.
            self.closed = True
            self._send.close()
            self._outbox.close()

    async def run(self) -> None:
        """Serve the link until it ends; then report it lost.  Never raises."""
        self._running = True
        if self._framed.writes_now:
            self._loop = asyncio.get_running_loop()
        try:
            with self._scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._guard, self._writer)
                    tg.start_soon(self._guard, self._liveness)
                    await self._guard(self._reader)
        finally:
            self.closed = True
            self._loop = None
            self._send.close()
            self._outbox.close()
            await self._framed.aclose()
            with anyio.CancelScope(shield=True):
                try:
                    await self._on_lost(self, self._cause, self.graceful)
                finally:
                    self.ended.set()

    async def _guard(self, part: Callable[[], Awaitable[None]]) -> None:
        """Run one part of the link; whichever part ends first ends the link, and
        nothing raised while serving this peer goes further than this link."""
        try:
            await part()
        except _LINK_ENDINGS as exc:
            self._cause = self._cause or exc
        except FrameError as exc:
            log.warning("peer.protocol_error", peer=self.address, agent=self.agent, error=str(exc))
            self._on_refused("frame")
            self._cause = self._cause or exc
        except Exception as exc:  # one peer's failure is that peer's
            log.exception("peer.handler_error", peer=self.address, agent=self.agent)
            self._on_refused("handler_error")
            self._cause = self._cause or exc
        self._scope.cancel()

    async def flush_and_close(self, timeout: float) -> None:
        """Send what is queued plus a Bye, then close (used at shutdown)."""
        self.send(Bye("shutting down"))
        self._closing = True
        # We are the ones leaving: the peer closing its end once it reads our Bye is
        # expected, and may reach our reader before the flush below returns.
        self.graceful = True
        self._send.close()  # the writer drains the outbox, then sets _drained
        with anyio.move_on_after(timeout):
            await self._drained.wait()
        self.close()

    async def tell_and_close(self, cause: BaseException, timeout: float) -> None:
        """The link is lost for ``cause`` (not left: no Bye), but the peer can still read
        it: send what is queued first (the ``Failed`` of the requests ``cause`` ended, so
        the peer learns why), then our end of the stream, and let the peer close its end
        once it has read everything; at most ``timeout`` seconds, then close.  (Closing
        at once could reset the connection under the peer's unread frames: a socket
        closed with the peer's replies unread sends a RST.)"""
        if self._cause is None:
            self._cause = cause
        self._closing = True  # nothing queued after this
        self._telling = True
        self._send.close()  # the writer drains the outbox, then half-closes
        with anyio.move_on_after(timeout):
            await self.ended.wait()
        self.close(cause)

    async def _reader(self) -> None:
        while True:
            msg = await self._framed.recv()
            self.last_rx = time.monotonic()
            if isinstance(msg, Ping):
                continue
            if isinstance(msg, Bye):
                self.graceful = True
                return
            self._on_message(self, msg)

    async def _writer(self) -> None:
        async for body in self._outbox:
            # Whatever else is queued goes in the same write: a burst of frames (a decode
            # scheduler's step of Expects) costs one socket write and one wait, not one each.
            self._writer_busy = True  # until written: send() writes nothing past these
            bodies, size = [body], len(body)
            while size < WRITE_BATCH_BYTES:
                try:
                    body = self._outbox.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
                bodies.append(body)
                size += len(body)
            self._queued -= size
            # A write that cannot finish for peer_timeout (the peer has stopped reading) is
            # found by the liveness check, which wakes every heartbeat anyway: no timer armed
            # and cancelled per write.
            self._writing_since = time.monotonic()
            await self._framed.send_bodies(bodies)
            self._writing_since = None
            self._writer_busy = False
        self._drained.set()
        if self._telling:  # our end of the stream: the peer's EOF after it read all ends the link
            try:
                await self._framed.stream.send_eof()
            except RuntimeError as exc:  # uvloop's word for a transport the peer closed meanwhile
                raise ConnectionResetError(f"peer {self.address} closed the connection first ({exc})") from exc
            await anyio.sleep_forever()

    async def _liveness(self) -> None:
        """Ping every heartbeat; end the link once the peer has been silent past
        ``peer_timeout``, or once a write to it has not finished in that time
        (``OutboxOverflow``: it stopped reading).

        Silence is judged only on a wake that came on time. A wake late by more than a
        heartbeat means this service's own loop was held (a GC pause, an engine holding the
        GIL or the core): the peer's frames may be waiting unread in the socket, and on
        uvloop timers run before the socket is read. Such a wake pings and looks again a
        heartbeat later, once the reader has had its turn; at most ``STALLS_FORGIVEN`` times
        in a row, so a loop that always stalls still finds a dead peer."""
        forgiven = 0
        while True:
            asleep = time.monotonic()
            await anyio.sleep(self._heartbeat)
            now = time.monotonic()
            if (since := self._writing_since) is not None and now - since > self._peer_timeout:
                self._on_refused("outbox_overflow")
                raise OutboxOverflow(f"peer {self.address} read nothing for {now - since:.2f}s")
            silent = now - self.last_rx
            if silent <= self._peer_timeout:
                forgiven = 0
            elif now - asleep > 2 * self._heartbeat and forgiven < STALLS_FORGIVEN:
                forgiven += 1  # our own stall: judge once the reader has had its turn
            else:
                self._cause = self._cause or TimeoutError(f"peer silent for {silent:.2f}s")
                self._scope.cancel()
                return
            self.send(Ping())


async def try_send(framed: ControlStream, msg: Message, timeout: float = 1.0) -> None:
    """Best effort: a refusal must not wait on, or fail because of, the peer
    (at most ``timeout`` seconds)."""
    with anyio.move_on_after(timeout):
        try:
            await framed.send(msg)
        except CONNECTION_ERRORS:
            pass
