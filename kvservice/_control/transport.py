"""How the control plane reaches the network: TCP by default.  The simulation
(``tests/sim``) brings an in-memory transport instead."""

from __future__ import annotations

from typing import Protocol

import anyio
import anyio.abc

from .accept import Acceptor


class ByteListener(Acceptor[anyio.abc.ByteStream], Protocol):
    """A listener of the control plane (anyio's ``SocketListener`` is one)."""

    async def aclose(self) -> None: ...


class Transport(Protocol):
    """How the control plane reaches the network: TCP by default; the simulation
    (tests/sim) injects an in-memory one."""

    async def listen(self, host: str, port: int) -> tuple[int, list[ByteListener]]:
        """Listen on ``host:port``; the port bound and the listeners (one per address)."""

    async def connect(self, host: str, port: int) -> anyio.abc.ByteStream: ...


class TcpTransport:
    async def listen(self, host: str, port: int) -> tuple[int, list[ByteListener]]:
        multi = await anyio.create_tcp_listener(local_host=host, local_port=port)
        listeners: list[ByteListener] = []
        for listener in multi.listeners:
            assert isinstance(listener, anyio.abc.SocketListener)  # what create_tcp_listener makes
            listeners.append(listener)
        return multi.extra(anyio.abc.SocketAttribute.local_port), listeners

    async def connect(self, host: str, port: int) -> anyio.abc.ByteStream:
        return await anyio.connect_tcp(host, port)
