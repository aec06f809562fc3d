"""A hostile control-channel peer: speaks, or mangles, the peer protocol from raw TCP.

Used by the fault tests to attack a real service the way a stranger on the
network (or a peer holding the key but misbehaving) would: as a client that dials
it (``dial``, ``authenticate``), or as the acceptor it dials (``acceptor``,
``answer_hello``).  Everything it does is bounded in time.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import msgspec

from kvservice._config import ServiceConfig
from kvservice._control.addresses import split_address
from kvservice._control.peers import agree
from kvservice._control.protocol import (
    HEADER_BYTES,
    OLDEST_VERSION,
    PROTOCOL_VERSION,
    Hello,
    Join,
    Message,
    Proof,
    Reject,
    Sealed,
    decode_body,
    encode_body,
    frame,
    negotiate,
)
from kvservice._control.protocol import hello as our_hello
from kvservice._trust.handshake import (
    ACCEPTOR,
    DIALER,
    EXCHANGE_SINCE,
    Agreement,
    Exchange,
    FrameMac,
    LinkSecrets,
    new_nonce,
    prove,
    transcript,
    verify,
)
from kvservice.memory import KVLayout
from kvservice.memory.engines import pool_regions
from tests.helpers import SMALL

WAIT_S = 10.0  # hang guard for every wait here


def fake_metadata(agent: str) -> bytes:
    """Bytes that name ``agent`` the way NIXL's metadata does, and load nowhere."""
    name = agent.encode()
    return b"nixlSerDes|Agent" + struct.pack("<Q", len(name)) + name + b"|junk"


class Raw:
    """One raw TCP connection to a control port."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.mac: FrameMac | None = None
        #: the link's secrets once authenticated: Joins sent are sealed, Sealed replies opened
        self.secrets: LinkSecrets | None = None
        self.agreed: Agreement | None = None  # what the Hellos settled (``dial``)
        self.sent: list[bytes] = []  # every byte string written, for replays

    @classmethod
    async def connect(cls, address: str, *, rcvbuf: int | None = None, source: str | None = None) -> Raw:
        """``rcvbuf``: a small receive buffer, fixed before connecting (no autotuning), so a
        client that never reads stops accepting bytes after a few KiB, not tens of MiB.
        ``source``: the local IPv4 address to connect from (any of 127.0.0.0/8 on loopback)."""
        host, port = split_address(address)
        with anyio.fail_after(WAIT_S):
            if rcvbuf is None and source is None:
                return cls(await anyio.connect_tcp(host, port))
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                if rcvbuf is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
                if source is not None:
                    sock.bind((source, 0))
                sock.setblocking(False)
                await asyncio.get_running_loop().sock_connect(sock, (host, port))
            except BaseException:
                sock.close()
                raise
            return cls(await anyio.abc.SocketStream.from_socket(sock))

    async def send_raw(self, data: bytes) -> None:
        self.sent.append(data)
        await self.stream.send(data)

    async def send(self, msg: Message | dict[str, Any]) -> None:
        """A message (or a raw dict, to break the schema), framed and sealed if keyed; a
        Join goes inside ``Sealed`` (encrypted when keyed) once authenticated, as a peer's does."""
        body = encode_body(msg) if not isinstance(msg, dict) else msgspec.msgpack.encode(msg)
        joining = isinstance(msg, Join) or (isinstance(msg, dict) and msg.get("type") == "join")
        if joining and self.secrets is not None:
            body = encode_body(Sealed(self.secrets.seal_join(body) if self.secrets.keyed else body))
        await self.send_raw(frame(self.mac.seal(body) if self.mac else body))

    async def recv(self, timeout: float = WAIT_S) -> Message | None:
        """The next message; None when the service closed the connection."""
        with anyio.fail_after(timeout):
            try:
                header = await self._exactly(HEADER_BYTES)
                (n,) = struct.unpack(">I", header)
                body = await self._exactly(n)
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError):
                return None
        if self.mac is not None:
            opened = self.mac.open(body)
            if opened is not None:
                body = opened
        msg = decode_body(body)
        if isinstance(msg, Sealed) and self.secrets is not None:
            inner = self.secrets.open_join(msg.box) if self.secrets.keyed else msg.box
            assert inner is not None, "a Join this link's peer did not seal"
            return decode_body(inner)
        return msg

    async def _exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            buf += await self.stream.receive(n - len(buf))
        return buf

    async def until_closed(self, out: list[Message]) -> None:
        """Every message the peer sends, appended to ``out`` as it comes, until it closes
        the connection (at most 16)."""
        for _ in range(16):
            msg = await self.recv()
            if msg is None:
                return
            out.append(msg)

    async def closed_by_peer(self, timeout: float = WAIT_S) -> bool:
        """True once the service has closed this connection (reads drain until EOF)."""
        with anyio.move_on_after(timeout):
            try:
                while True:
                    await self.stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                return True
        return False

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.stream.aclose()
            except OSError:
                pass


async def dial(
    address: str, *, agent: str = "kv-stranger-1", my_address: str = "127.0.0.1:1",
    hello: dict[str, Any] | None = None, rcvbuf: int | None = None, source: str | None = None,
) -> tuple[Raw, Message | None, bytes]:
    """Open a connection (from ``source``, see ``Raw.connect``) and send this release's Hello
    (fields overridden by ``hello``); returns the connection, the service's answer, and the
    transcript (for a proof).  ``raw.agreed`` is what the two Hellos settled, when the answer
    is a Hello."""
    raw = await Raw.connect(address, rcvbuf=rcvbuf, source=source)
    exchange = Exchange()
    mine = our_hello(agent, my_address, new_nonce(PROTOCOL_VERSION), share=exchange.share)
    fields: dict[str, Any] = {"type": "hello", **msgspec.structs.asdict(mine)}
    fields.update(hello or {})
    await raw.send(fields)
    answer = await raw.recv()
    script = b""
    if isinstance(answer, Hello):
        sent = msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=Hello)
        raw.agreed = agree(negotiate(answer), sent, answer, exchange, DIALER)
        script = raw.agreed.script
    return raw, answer, script


def own_key() -> bytes:
    """The key a service configured with nothing uses on loopback: this user's."""
    key = ServiceConfig().resolve_key().key
    assert key is not None
    return key


async def authenticate(
    address: str, *, key: bytes | None, agent: str = "kv-stranger-1", my_address: str = "127.0.0.1:1",
    rcvbuf: int | None = None, source: str | None = None,
) -> Raw:
    """Pass the handshake up to (not including) Join, as a peer holding ``key`` would."""
    raw, answer, script = await dial(address, agent=agent, my_address=my_address, rcvbuf=rcvbuf, source=source)
    assert isinstance(answer, Hello), answer
    assert verify(key, ACCEPTOR, script, answer.proof) is None, "the service's proof did not verify"
    await raw.send(Proof(prove(key, DIALER, script)))
    assert raw.agreed is not None
    raw.secrets = raw.agreed.secrets(key, DIALER)
    raw.mac = raw.secrets.frame_mac
    return raw


@asynccontextmanager
async def acceptor(serve: Callable[[Raw], Awaitable[None]]) -> AsyncIterator[str]:
    """A hostile acceptor on loopback: each connection a service dials to it is handed to
    ``serve`` as a ``Raw`` (bounded by ``WAIT_S``, closed after).  Yields its address; on
    leaving, waits (``WAIT_S`` at most) for the connections' ``serve`` to end: enter it
    before the dialling service, so that the service's close ends them."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    serving = 0
    idle = anyio.Event()

    async def one(stream: anyio.abc.SocketStream) -> None:
        nonlocal serving, idle
        serving += 1
        raw = Raw(stream)
        try:
            with anyio.move_on_after(WAIT_S):
                await serve(raw)
        finally:
            await raw.aclose()
            serving -= 1
            if serving == 0:
                idle.set()
                idle = anyio.Event()

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, one)
        try:
            yield f"127.0.0.1:{port}"
            if serving:
                with anyio.move_on_after(WAIT_S):
                    await idle.wait()
        finally:
            tg.cancel_scope.cancel()


async def answer_hello(raw: Raw, *, key: bytes | None, agent: str = "kv-impostor-1",
                       my_address: str = "127.0.0.1:1", hello: dict[str, Any] | None = None,
                       version: int | None = None) -> Hello:
    """As an acceptor: read the dialer's Hello and answer with this release's Hello (fields
    overridden by ``hello``), proven under ``key`` over the transcript of the link's
    ``version`` (default: what the dialer's and the answer's versions negotiate; the
    exchange's shares are whatever the two Hellos carry).  Returns the dialer's Hello;
    ``raw.agreed`` is what the two Hellos settled (for ``accept_join``)."""
    theirs = await raw.recv()
    assert isinstance(theirs, Hello), theirs
    exchange = Exchange()
    mine = our_hello(agent, my_address, new_nonce(PROTOCOL_VERSION), share=exchange.share)
    fields: dict[str, Any] = {"type": "hello", **msgspec.structs.asdict(mine)}
    fields.update(hello or {})
    sent = msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=Hello)
    if version is None:
        version = min(theirs.newest, sent.newest, PROTOCOL_VERSION)
    script = transcript((theirs.agent, theirs.address, theirs.nonce), (sent.agent, sent.address, sent.nonce),
                        version, (theirs.share, sent.share))
    fields["proof"] = prove(key, ACCEPTOR, script)
    await raw.send(fields)
    keyed_exchange = version >= EXCHANGE_SINCE and sent.share == exchange.share
    raw.agreed = Agreement(version, script, exchange.shared(theirs.share) if keyed_exchange else None)
    return theirs


async def accept_join(raw: Raw, *, key: bytes | None) -> Join:
    """As an acceptor past ``answer_hello``: the dialer's Proof checked under ``key``, the
    link's secrets taken (Joins sent from here on are sealed), and its Join, opened."""
    proof = await raw.recv()
    assert isinstance(proof, Proof), proof
    assert raw.agreed is not None
    assert verify(key, DIALER, raw.agreed.script, proof.proof) is None, "the dialer's proof did not verify"
    raw.secrets = raw.agreed.secrets(key, ACCEPTOR)
    raw.mac = raw.secrets.frame_mac
    join = await raw.recv()
    assert isinstance(join, Join), join
    return join


def stripped(top: int = 0) -> dict[str, Any]:
    """Hello fields of an acceptor that says it speaks only version 5 (``top`` stripped, or
    lowered to ``top``, and no key-exchange share), while its nonce says this release's."""
    return {"version": OLDEST_VERSION, "top": top, "share": b""}


REGION_FIELDS = ("addr", "page_stride", "layer", "kind", "dtype", "tokens", "heads", "head_dim", "order",
                 "device_id")


def wire_memory(layout: KVLayout = SMALL, base: int = 1 << 40, regions: int | None = None,
                region: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    """A Join's ``memory`` for a pool of ``layout`` at ``base``, as a dict (so tests can put
    any value in any field): ``region`` overrides fields of every region, ``regions`` cuts
    or repeats the list to that many, ``fields`` the memory's own fields."""
    rows = []
    for r in pool_regions(layout, base):
        row = {"addr": r.addr, "page_stride": r.page_stride, "layer": r.layer, "kind": r.kind, "dtype": r.dtype,
               "tokens": r.tokens, "heads": r.heads, "head_dim": r.head_dim, "order": r.order,
               "device_id": r.device_id}
        row.update(region or {})
        rows.append([row[k] for k in REGION_FIELDS])
    if regions is not None:
        rows = (rows * (regions // len(rows) + 1))[:regions]
    memory: dict[str, Any] = {"num_pages": layout.num_pages, "regions": rows, "mem_type": "DRAM",
                              "tp_size": 1, "tp_rank": 0}
    memory.update(fields)
    return memory


def join_for(agent: str, metadata: bytes | None = None, memory: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Join as a dict (so tests can put any value in any field)."""
    return {"type": "join", "metadata": metadata if metadata is not None else fake_metadata(agent),
            "memory": memory if memory is not None else wire_memory()}


def is_reject(msg: Message | None, kind: str | None = None) -> bool:
    return isinstance(msg, Reject) and (kind is None or msg.kind == kind)


__all__ = ["Join", "Raw", "accept_join", "acceptor", "answer_hello", "authenticate", "dial", "fake_metadata",
           "is_reject", "join_for", "own_key", "stripped", "wire_memory"]
