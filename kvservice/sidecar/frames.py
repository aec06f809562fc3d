"""The worker socket's framing: ``SocketFrames``, the frames of ``wire`` over a Unix socket,
written and read straight from the socket, in the caller's turn (``frame_stream``)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

from .._control.links import FramedStream
from .wire import encode

M = TypeVar("M")


def frame_stream(stream: anyio.abc.ByteStream, limit: int, decode: Callable[[bytes], M]) -> SocketFrames[M]:
    """A ``FramedStream`` speaking the worker protocol; ``decode`` picks the direction."""
    return SocketFrames(stream, limit, decode, encode)


class SocketFrames(FramedStream[M]):
    """``FramedStream`` for the worker socket, without the per-write loop turns of the
    generic one, which sit on every call's path (measured: about 30-70 us each):

    * a frame is written straight to the non-blocking socket, in the caller's turn,
      when no other write is in progress (anyio's ``send`` yields to the loop before
      writing); whatever the socket does not take, and any error, goes through the
      stream's own ``send``, so errors and back-pressure are the stream's;
    * a frame that was read with an earlier one (``FramedStream.recv_body``) is returned
      after a yield: a burst of calls read at once is served one loop turn at a time;
    * a read goes straight to the socket too, and waits for it to become readable through
      a reader registered with the loop once and kept while frames keep coming (anyio's
      ``receive`` yields a loop turn first, then registers a reader and removes it again
      for every read that waits: two ``epoll_ctl`` calls, a poll handle and two futures).
      A read that waited was a loop turn already; one that found data there yields one
      after it, so a peer that keeps the socket full cannot hold the loop.
      The reader is removed when data comes while nobody waits (the socket stays readable,
      and the loop would call it every turn), when a wait ends in an exception, and
      before the socket closes (``stop_reading``, ``aclose``): a reader left on a closed
      descriptor would be left on whatever socket reuses its number.
    """

    burst = 1

    def __init__(self, stream: anyio.abc.ByteStream, max_frame_bytes: int,
                 decode: Callable[[bytes], M], encode: Callable[[Any], bytes]) -> None:
        super().__init__(stream, max_frame_bytes, decode, encode)
        # Direct writes only on a Unix socket: anyio's Unix stream writes straight to the
        # socket and returns once every byte is in it, so nothing of an earlier send can
        # still be queued behind a direct write.  Its TCP stream writes through an asyncio
        # transport that may still hold bytes when ``send`` returns; a direct write would
        # overtake them.
        raw = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
        self._sock: socket.socket | None = (
            raw if isinstance(raw, socket.socket) and raw.family == socket.AF_UNIX
            and not raw.getblocking() else None)
        self._reading: int | None = None  # the descriptor our reader is registered on
        self._readable: asyncio.Future[None] | None = None  # the waiting read's
        self._closing = False

    def set_limit(self, max_frame_bytes: int) -> None:
        """Frames received from now on may be this long (a small limit before the
        handshake, the configured one after it)."""
        self._limit = max_frame_bytes

    async def recv(self) -> M:
        return self._decode(await self.recv_body())

    async def send(self, msg: Any, timeout: float | None = None, *, shield: bool = False) -> None:
        await self.send_frame(self._encode(msg), timeout, shield=shield)

    async def send_frame(self, data: bytes, timeout: float | None = None, *, shield: bool = False) -> None:
        """Write whole frames (one, or several back to back: ``encode_frames``), never
        interleaved with another writer's.

        ``timeout``: ``TimeoutError`` if the socket has not taken them (and the writer
        before, if one is writing) within it; the frames may then be cut short, and the
        connection is the caller's to drop.  ``shield``: a cancelled caller still writes
        them whole (within ``timeout``).  Both apply only where the socket cannot take
        the frames at once: the usual write, straight into a socket with room, arms
        no timer and enters no scope (measured: those were 6-11 % of a sidecar
        process's loop CPU)."""
        if self._sock is not None and not self._write_lock.locked():  # no frame is half written
            sent = self._send_now(data)
            if sent == len(data):
                return
            data = data[sent:]  # the rest goes next: nothing runs before the lock is ours
        with anyio.CancelScope(shield=shield), anyio.fail_after(timeout):
            async with self._write_lock:  # uncontended: no yield
                if self._sock is not None:
                    data = data[self._send_now(data):]
                    if not data:
                        return
                await self._stream.send(data)  # rare: a full socket, or another writer's turn

    async def _fill(self, max_bytes: int) -> None:
        sock = self._sock
        if sock is None:
            return await super()._fill(max_bytes)
        waited = False
        while True:
            try:
                data = sock.recv(max_bytes)
            except BlockingIOError:
                await self._wait_readable(sock)
                waited = True
                continue
            except OSError as exc:  # as anyio's stream says it
                self.stop_reading()
                raise (anyio.ClosedResourceError() if self._closing else anyio.BrokenResourceError()) from exc
            if not data:
                self.stop_reading()
                raise anyio.IncompleteRead
            self._buf += data
            if not waited:  # data that was there already: a peer that keeps the socket full
                await anyio.lowlevel.checkpoint()  # gets a loop turn per read, as anyio's gave
            return

    async def _wait_readable(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        if self._closing:
            raise anyio.ClosedResourceError
        if self._readable is not None:  # one reader at a time, as anyio's stream enforces
            raise anyio.BusyResourceError("reading from")
        if self._reading is None:
            self._reading = fd = sock.fileno()
            loop.add_reader(fd, self._on_readable)
        waiter = self._readable = loop.create_future()
        try:
            await waiter
        except BaseException:  # cancelled: nobody waits, no reader kept for nobody
            self.stop_reading()
            raise
        finally:
            self._readable = None

    def _on_readable(self) -> None:
        waiter = self._readable
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        else:  # readable while nobody waits: the next read takes it without a wait
            self.stop_reading()

    def stop_reading(self) -> None:
        """Remove the reader, if registered (before the socket closes: the owner's job
        where the socket is closed without ``aclose``)."""
        fd, self._reading = self._reading, None
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
        waiter = self._readable
        if waiter is not None and not waiter.done():
            waiter.set_result(None)  # the read finds the socket closed, or reads on

    async def aclose(self) -> None:
        self._closing = True
        self.stop_reading()
        await super().aclose()

    def _send_now(self, data: bytes) -> int:
        """What a non-blocking send takes of ``data`` now (0: full, or gone: the stream's
        own ``send`` then decides)."""
        assert self._sock is not None
        try:
            return self._sock.send(data)
        except OSError:
            return 0
