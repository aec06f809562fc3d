"""Control-channel links to peers: framing, handshake, outbox and liveness.

A ``PeerLink`` is one TCP connection to one peer service, after the Hello
exchange.  It is used in both directions whichever side dialled.  The service
owns what the link *means* (requests tied to the peer); this module only moves
frames and says when the link is gone, and why.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from ._protocol import (
    HEADER_BYTES,
    Bye,
    FrameError,
    Hello,
    Message,
    Ping,
    decode_body,
    encode_frame,
    frame_length,
)

log = structlog.get_logger("kvservice.peers")

#: errors that mean "the connection is gone", as opposed to a protocol breach
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.IncompleteRead,
    OSError,
)


R = TypeVar("R")


class FramedStream(Generic[R]):
    """Length-prefixed msgpack frames over a byte stream.

    ``decode`` turns a frame body into a received message (raising ``FrameError``)
    and ``encode`` a message into a whole frame; the control plane and the
    sidecar's worker socket each bring their own pair."""

    def __init__(
        self, stream: anyio.abc.ByteStream, max_frame_bytes: int,
        decode: Callable[[bytes], R], encode: Callable[[Any], bytes],
    ) -> None:
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)
        self._limit = max_frame_bytes
        self._decode = decode
        self._encode = encode
        self._write_lock = anyio.Lock(fast_acquire=True)  # no yield when uncontended

    @property
    def stream(self) -> anyio.abc.ByteStream:
        return self._stream

    async def recv(self) -> R:
        """The next message; ``FrameError`` for an oversized or malformed frame."""
        n = frame_length(await self._reader.receive_exactly(HEADER_BYTES), self._limit)
        return self._decode(await self._reader.receive_exactly(n) if n else b"")

    async def send(self, msg: Any) -> None:
        data = self._encode(msg)
        async with self._write_lock:
            await self._stream.send(data)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self._stream.aclose()
            except CONNECTION_ERRORS:
                pass


def control_stream(stream: anyio.abc.ByteStream, max_frame_bytes: int) -> FramedStream[Message]:
    """A ``FramedStream`` speaking the peer control protocol."""
    return FramedStream(stream, max_frame_bytes, decode_body, encode_frame)


async def dial(
    address: str, hello: Hello, *, timeout: float, max_frame_bytes: int,
) -> tuple[FramedStream[Message], Message]:
    """Connect, send our Hello, and return the stream with the peer's reply."""
    host, port = split_address(address)
    with anyio.fail_after(timeout):
        stream = await anyio.connect_tcp(host, port)
        framed = control_stream(stream, max_frame_bytes)
        try:
            await framed.send(hello)
            reply = await framed.recv()
        except BaseException:
            await framed.aclose()
            raise
    return framed, reply


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); raises ``ValueError`` naming the problem."""
    host, sep, port_s = address.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not (0 < int(port_s) < 65536):
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port_s)


OnMessage = Callable[["PeerLink", Message], None]
OnLost = Callable[["PeerLink", BaseException | None, bool], Awaitable[None]]


class PeerLink:
    """A live control link to one peer.

    ``send`` never blocks or raises: frames queue in an outbox drained by the
    link's writer, so the service can speak from synchronous code.  When the
    link ends (EOF, error, silence past ``peer_timeout``, protocol breach, or
    ``close()``) ``on_lost(link, cause, graceful)`` runs exactly once.
    """

    def __init__(
        self, framed: FramedStream[Message], hello: Hello, *, on_message: OnMessage, on_lost: OnLost,
        heartbeat_interval: float, peer_timeout: float,
    ) -> None:
        self.hello = hello
        self.agent = hello.agent
        self.address = hello.address
        self._framed = framed
        self._on_message = on_message
        self._on_lost = on_lost
        self._heartbeat = heartbeat_interval
        self._peer_timeout = peer_timeout
        self._send, self._outbox = anyio.create_memory_object_stream[Message](math.inf)
        self._scope = anyio.CancelScope()
        self._drained = anyio.Event()
        self.last_rx = time.monotonic()
        self.closed = False
        self._closing = False
        self.graceful = False  # the peer said Bye
        self._cause: BaseException | None = None

    def send(self, msg: Message) -> None:
        """Queue ``msg``; dropped once the link is closing (nothing may follow Bye)."""
        if not self.closed and not self._closing:
            self._send.send_nowait(msg)

    def close(self, cause: BaseException | None = None) -> None:
        if self._cause is None:
            self._cause = cause
        self._scope.cancel()

    async def run(self) -> None:
        """Serve the link until it ends; then report it lost.  Never raises."""
        try:
            with self._scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._guard, self._writer)
                    tg.start_soon(self._guard, self._liveness)
                    await self._guard(self._reader)
        finally:
            self.closed = True
            self._send.close()
            self._outbox.close()
            await self._framed.aclose()
            with anyio.CancelScope(shield=True):
                await self._on_lost(self, self._cause, self.graceful)

    async def _guard(self, part: Callable[[], Awaitable[None]]) -> None:
        """Run one part of the link; whichever part ends first ends the link."""
        try:
            await part()
        except CONNECTION_ERRORS as exc:
            self._cause = self._cause or exc
        except FrameError as exc:
            log.warning("peer.protocol_error", peer=self.address, error=str(exc))
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
        async for msg in self._outbox:
            await self._framed.send(msg)
        self._drained.set()

    async def _liveness(self) -> None:
        while True:
            await anyio.sleep(self._heartbeat)
            silent = time.monotonic() - self.last_rx
            if silent > self._peer_timeout:
                self._cause = self._cause or TimeoutError(f"peer silent for {silent:.2f}s")
                self._scope.cancel()
                return
            self.send(Ping())
