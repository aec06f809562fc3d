"""An in-memory network for the control plane: addresses -> listeners, byte-stream pairs.

``MemNet.transport(owner)`` is what one simulated process passes to
``TransferService(transport=...)``.  ``connect`` to an address nobody listens
on raises ``ConnectionRefusedError``.  Faults, from the scheduler:

* ``Conn.cut()``: the connection resets (both ends: reads fail, writes fail);
* ``Conn.silence()``: it stops delivering bytes both ways, FIN included (a
  cable cut): only the peers' heartbeat timeouts notice;
* ``MemNet.kill(owner)``: the process died: its listener goes, and the kernel
  closes its sockets (peers read EOF, unless that connection is silent).
"""

from __future__ import annotations

import collections
import errno
from dataclasses import dataclass, field

import anyio
import anyio.abc
import anyio.lowlevel


class _Pipe:
    """One direction of a connection."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.eof = False  # the writer closed (FIN)
        self.reset = False  # the connection was reset
        self.reader_gone = False  # the reading end closed: writes fail
        self.silent = False
        self._waiter: anyio.Event | None = None

    def notify(self) -> None:
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None

    async def wait(self) -> None:
        if self._waiter is None:
            self._waiter = anyio.Event()
        await self._waiter.wait()


class MemStream(anyio.abc.ByteStream):
    def __init__(self, conn: Conn, rx: _Pipe, tx: _Pipe, owner: str) -> None:
        self.conn = conn
        self._rx = rx
        self._tx = tx
        self.owner = owner
        self._closed = False

    async def receive(self, max_bytes: int = 65536) -> bytes:
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            rx = self._rx
            if not rx.silent:
                if rx.reset:
                    raise anyio.BrokenResourceError("connection reset")
                if rx.buf:
                    data = bytes(rx.buf[:max_bytes])
                    del rx.buf[:max_bytes]
                    await anyio.lowlevel.checkpoint()
                    return data
                if rx.eof:
                    raise anyio.EndOfStream
            await rx.wait()

    async def send(self, item: bytes) -> None:
        await anyio.lowlevel.checkpoint()
        if self._closed:
            raise anyio.ClosedResourceError
        tx = self._tx
        if tx.eof:
            raise anyio.ClosedResourceError
        if not tx.silent and (tx.reset or tx.reader_gone):
            raise anyio.BrokenResourceError("connection reset by peer")
        tx.buf += item
        tx.notify()

    async def send_eof(self) -> None:
        self._tx.eof = True
        self._tx.notify()

    def close_now(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._tx.eof = True
        self._tx.notify()
        self._rx.reader_gone = True
        self._rx.notify()

    async def aclose(self) -> None:
        self.close_now()
        await anyio.lowlevel.checkpoint()


@dataclass(eq=False)
class Conn:
    number: int
    client: str
    server: str
    up: _Pipe = field(default_factory=_Pipe)  # client -> server
    down: _Pipe = field(default_factory=_Pipe)
    ends: list[MemStream] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ends = [MemStream(self, self.down, self.up, self.client),
                     MemStream(self, self.up, self.down, self.server)]

    @property
    def open(self) -> bool:
        return not any(e._closed for e in self.ends) and not self.up.reset

    def cut(self) -> None:
        for pipe in (self.up, self.down):
            pipe.reset = True
            pipe.buf.clear()
            pipe.notify()

    def silence(self) -> None:
        for pipe in (self.up, self.down):
            pipe.silent = True


class MemListener:
    def __init__(self, net: MemNet, address: tuple[str, int], owner: str) -> None:
        self._net = net
        self.address = address
        self.owner = owner
        self.backlog: collections.deque[MemStream] = collections.deque()
        self.closed = False
        self._waiter: anyio.Event | None = None

    async def accept(self) -> anyio.abc.ByteStream:
        while True:
            if self.closed:
                raise anyio.ClosedResourceError
            if self.backlog:
                stream = self.backlog.popleft()
                await anyio.lowlevel.checkpoint()
                return stream
            if self._waiter is None:
                self._waiter = anyio.Event()
            await self._waiter.wait()

    def _notify(self) -> None:
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None

    def close_now(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._net.listeners.get(self.address) is self:
            del self._net.listeners[self.address]
        for stream in self.backlog:  # never accepted: the dialler sees a reset
            stream.conn.cut()
        self.backlog.clear()
        self._notify()

    async def aclose(self) -> None:
        self.close_now()
        await anyio.lowlevel.checkpoint()


class MemTransport:
    def __init__(self, net: MemNet, owner: str) -> None:
        self._net = net
        self.owner = owner

    async def listen(self, host: str, port: int) -> tuple[int, list[MemListener]]:
        await anyio.lowlevel.checkpoint()
        address = (host, port)
        if address in self._net.listeners:
            raise OSError(errno.EADDRINUSE, f"{host}:{port} is in use")
        listener = self._net.listeners[address] = MemListener(self._net, address, self.owner)
        return port, [listener]

    async def connect(self, host: str, port: int) -> anyio.abc.ByteStream:
        await anyio.lowlevel.checkpoint()
        listener = self._net.listeners.get((host, port))
        if listener is None or listener.closed:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"{host}:{port} refused")
        conn = Conn(next(self._net.numbers), self.owner, listener.owner)
        self._net.conns.append(conn)
        listener.backlog.append(conn.ends[1])
        listener._notify()
        return conn.ends[0]


class MemNet:
    def __init__(self) -> None:
        import itertools

        self.listeners: dict[tuple[str, int], MemListener] = {}
        self.conns: list[Conn] = []
        self.numbers = itertools.count(1)

    def transport(self, owner: str) -> MemTransport:
        return MemTransport(self, owner)

    def live_conns(self) -> list[Conn]:
        self.conns = [c for c in self.conns if c.open]
        return list(self.conns)

    def kill(self, owner: str) -> None:
        """``owner``'s process died: its listener and its ends of every connection close."""
        for listener in [li for li in self.listeners.values() if li.owner == owner]:
            listener.close_now()
        for conn in self.conns:
            for end in conn.ends:
                if end.owner == owner:
                    end.close_now()
