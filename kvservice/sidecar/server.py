"""The workers' API: a Unix-socket server in front of one ``TransferService``.

Each connection is one worker.  Its calls run as tasks of the connection's own
task group, so a slow ``await_arrival`` never holds up a ``send``, and when the
worker goes away (EOF, a broken frame, a stuck socket) the group is cancelled
and every request the worker started and that has not ended is aborted
(``ABORTED``, the peer told), without touching other workers.

Every request a connection sends or expects gets a watcher that pushes a
``Finished`` frame when it ends, so the client resolves handles without asking.
"""

from __future__ import annotations

import collections
import os
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import structlog

from .._peers import CONNECTION_ERRORS, FramedStream
from .._protocol import FrameError
from .._requests import Recent, TransferHandle
from .._results import KVPoll, KVServiceError, ProtocolError, TransferResult, UnknownRequestError
from .._service import TransferService
from .settings import SidecarConfig
from .wire import (
    SIDECAR_PROTOCOL_VERSION,
    Abort,
    AwaitArrival,
    AwaitCompletion,
    Bye,
    Call,
    Cancel,
    ClientMessage,
    Done,
    Error,
    Expect,
    Finished,
    Hello,
    Poll,
    PollReply,
    ResultReply,
    Send,
    SendReply,
    ServerMessage,
    Status,
    StatusReply,
    Welcome,
    decode_client,
    frame_stream,
    result_to_wire,
)

log = structlog.get_logger("kvservice.sidecar")

HELLO_TIMEOUT_S = 5.0
#: a worker that does not take a frame within this long is dropped (its requests aborted)
PUSH_TIMEOUT_S = 10.0
MAX_CALLS_PER_CONNECTION = 10_000
#: at shutdown, how long to wait for the last Finished frames before Bye
FLUSH_TIMEOUT_S = 2.0
_PUSH_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, *CONNECTION_ERRORS)
#: calls that complete without waiting on anything: run in the reader, saving a task per call
_INLINE = (Send, Abort, Poll, Status)


@dataclass(eq=False)
class Connection:
    number: int
    framed: FramedStream[ClientMessage]
    pid: int | None
    client: str = ""
    tg: anyio.abc.TaskGroup | None = None
    calls: dict[int, anyio.CancelScope] = field(default_factory=dict)
    handles: Recent[str, TransferHandle] = field(default_factory=lambda: Recent(10_000))
    owned: set[str] = field(default_factory=set)  # request ids this worker started, not yet ended
    watching: int = 0
    idle: anyio.Event = field(default_factory=anyio.Event)
    closed: bool = False

    def close(self) -> None:
        self.closed = True
        if self.tg is not None:
            self.tg.cancel_scope.cancel()

    async def push(self, msg: ServerMessage) -> None:
        """Send a frame; a worker that cannot take it in time is dropped."""
        if self.closed:
            return
        try:
            with anyio.fail_after(PUSH_TIMEOUT_S):
                await self.framed.send(msg)
        except _PUSH_ERRORS as exc:
            log.warning("sidecar.client_stuck", conn=self.number, pid=self.pid, error=repr(exc))
            self.close()


@dataclass
class ServerCounters:
    connections_total: int = 0
    refused_total: int = 0  # connections refused (too many, bad hello)
    frames_rejected_total: int = 0  # malformed or oversized frames
    aborted_on_disconnect_total: int = 0
    calls: collections.Counter[str] = field(default_factory=collections.Counter)


class SidecarServer:
    """Serves ``svc`` to workers on a Unix listener until ``close()``."""

    def __init__(self, svc: TransferService, config: SidecarConfig, shm_name: str) -> None:
        self.svc = svc
        self.cfg = config
        self.roles = tuple(config.sidecar.roles)
        self.shm_name = shm_name
        self.conns: set[Connection] = set()
        self.counters = ServerCounters()
        self.listening = False
        self.draining = False
        self._listen_scope = anyio.CancelScope()
        self._numbers = 0

    # -- listening ------------------------------------------------------------------
    async def serve(self, listener: anyio.abc.Listener[anyio.abc.SocketStream], *,
                    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            with self._listen_scope:
                async with listener:
                    self.listening = True
                    task_status.started()
                    try:
                        await listener.serve(self._handle, task_group=tg)
                    finally:
                        self.listening = False

    def stop_accepting(self) -> None:
        """No new workers, no new requests; calls and pushes for existing ones go on."""
        self.draining = True
        self._listen_scope.cancel()

    async def close(self) -> None:
        """After the service has stopped: flush the last Finished frames, say Bye, disconnect."""
        self.stop_accepting()
        with anyio.move_on_after(FLUSH_TIMEOUT_S):
            for conn in list(self.conns):
                while conn.watching and not conn.closed:
                    conn.idle = anyio.Event()
                    await conn.idle.wait()
        for conn in list(self.conns):
            with anyio.move_on_after(0.5):
                await conn.push(Bye("sidecar shutting down"))
            conn.close()

    # -- one worker ----------------------------------------------------------------------
    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        try:
            await self._serve_worker(stream)
        except Exception:  # one worker's connection must never take the daemon down
            log.exception("sidecar.connection_crashed")

    async def _serve_worker(self, stream: anyio.abc.SocketStream) -> None:
        self._numbers += 1
        self.counters.connections_total += 1
        conn = Connection(self._numbers, frame_stream(stream, self.cfg.sidecar.max_frame_bytes, decode_client),
                          _peer_pid(stream))
        conn.handles = Recent(self.svc.config.results_kept)
        try:
            if not await self._greet(conn):
                self.counters.refused_total += 1
                return
            self.conns.add(conn)
            log.info("sidecar.client_connected", conn=conn.number, pid=conn.pid, client=conn.client)
            try:
                async with anyio.create_task_group() as tg:
                    conn.tg = tg
                    await self._read(conn)
                    conn.close()
            finally:
                self.conns.discard(conn)
                with anyio.CancelScope(shield=True):
                    aborted = await self._abort_owned(conn)
                (log.warning if aborted else log.info)(
                    "sidecar.client_disconnected", conn=conn.number, pid=conn.pid, aborted=aborted)
        finally:
            await conn.framed.aclose()

    async def _greet(self, conn: Connection) -> bool:
        try:
            with anyio.fail_after(HELLO_TIMEOUT_S):
                hello = await conn.framed.recv()
                if not isinstance(hello, Hello):
                    raise FrameError(f"expected hello, got {type(hello).__name__}")
                if hello.version != SIDECAR_PROTOCOL_VERSION:
                    raise FrameError(f"protocol version {hello.version}, "
                                     f"this sidecar speaks {SIDECAR_PROTOCOL_VERSION}")
                if self.draining:
                    raise KVServiceError("sidecar is shutting down")
                if len(self.conns) >= self.cfg.sidecar.max_clients:
                    raise KVServiceError(f"too many workers connected (sidecar.max_clients = "
                                         f"{self.cfg.sidecar.max_clients})")
                conn.client = hello.client
                await conn.framed.send(self._welcome())
                return True
        except (FrameError, KVServiceError, TimeoutError) as exc:
            if isinstance(exc, FrameError):
                self.counters.frames_rejected_total += 1
            log.warning("sidecar.client_refused", pid=conn.pid, error=str(exc) or repr(exc))
            kind = "KVServiceError" if isinstance(exc, KVServiceError) else "ProtocolError"
            await _try_send(conn, Error(0, kind, str(exc) or "no hello in time"))
        except CONNECTION_ERRORS:
            pass
        return False

    def _welcome(self) -> Welcome:
        lay = self.svc.layout
        return Welcome(
            version=SIDECAR_PROTOCOL_VERSION, pid=os.getpid(), agent=self.svc.agent_name,
            address=self.svc.address, roles=list(self.roles), shm_name=self.shm_name,
            layout={**lay.wire_shape(), "num_pages": lay.num_pages},
            max_frame_bytes=self.cfg.sidecar.max_frame_bytes, results_kept=self.svc.config.results_kept,
        )

    async def _read(self, conn: Connection) -> None:
        assert conn.tg is not None
        try:
            while True:
                msg = await conn.framed.recv()
                if isinstance(msg, Cancel):
                    scope = conn.calls.get(msg.call)
                    if scope is not None:
                        scope.cancel()
                elif isinstance(msg, Hello):
                    raise FrameError("hello after the handshake")
                elif msg.call in conn.calls:
                    await conn.push(Error(msg.call, "ProtocolError", f"call {msg.call} is already in flight"))
                elif len(conn.calls) >= MAX_CALLS_PER_CONNECTION:
                    await conn.push(Error(msg.call, "KVServiceError", "too many calls in flight"))
                elif isinstance(msg, _INLINE):  # never waits: answer it now, in order, no task
                    await self._run_call(conn, msg, anyio.CancelScope())
                else:
                    scope = conn.calls[msg.call] = anyio.CancelScope()
                    conn.tg.start_soon(self._run_call, conn, msg, scope)
        except FrameError as exc:
            self.counters.frames_rejected_total += 1
            log.warning("sidecar.frame_rejected", conn=conn.number, pid=conn.pid, error=str(exc))
            await _try_send(conn, Error(0, "ProtocolError", str(exc)))
        except CONNECTION_ERRORS:
            pass

    async def _run_call(self, conn: Connection, msg: Call, scope: anyio.CancelScope) -> None:
        op = str(type(msg).__struct_config__.tag)
        self.counters.calls[op] += 1
        reply: ServerMessage | None = None
        try:
            with scope:
                reply = await self._execute(conn, msg)
        except UnknownRequestError as exc:
            reply = Error(msg.call, "UnknownRequestError", str(exc))
        except ValueError as exc:
            reply = Error(msg.call, "ValueError", str(exc))
        except KVServiceError as exc:
            reply = Error(msg.call, type(exc).__name__, str(exc))
        except Exception as exc:  # one bad call must not take the daemon down
            log.exception("sidecar.call_crashed", op=op, conn=conn.number)
            reply = Error(msg.call, "KVServiceError", f"internal error in the sidecar: {exc!r}")
        finally:
            conn.calls.pop(msg.call, None)
        if reply is not None:  # None: the worker cancelled the call
            await conn.push(reply)

    # -- the calls ------------------------------------------------------------------------
    async def _execute(self, conn: Connection, msg: Call) -> ServerMessage:
        svc = self.svc
        if isinstance(msg, Send):
            self._check_open("prefill")
            handle = await svc.send(msg.request_id, msg.pages, last=msg.last, timeout=msg.timeout)
            result = handle.result
            if conn.handles.get(msg.request_id) is None and result is None:
                conn.handles.put(msg.request_id, handle)
                conn.owned.add(msg.request_id)
                self._watch(conn, "send", msg.request_id, handle.wait)
            return SendReply(msg.call, int(handle.poll()), result_to_wire(result) if result else None)
        if isinstance(msg, AwaitCompletion):
            known = conn.handles.get(msg.request_id)
            if known is None:
                raise UnknownRequestError(f"unknown request {msg.request_id!r} (not sent on this connection)")
            return ResultReply(msg.call, result_to_wire(await svc.await_completion(known, timeout=msg.timeout)))
        if isinstance(msg, Expect):
            self._check_open("decode")
            rid = msg.request_id
            new = rid not in conn.owned
            conn.owned.add(rid)  # before the await: a disconnect during expect() aborts it
            try:
                await svc.expect(rid, msg.pages, sender=msg.sender, timeout=msg.timeout)
            except ValueError:
                if new:
                    conn.owned.discard(rid)  # nothing was registered (e.g. a duplicate id)
                raise

            async def arrival() -> TransferResult:
                return await svc.await_arrival(rid)

            self._watch(conn, "recv", rid, arrival)
            return Done(msg.call)
        if isinstance(msg, AwaitArrival):
            return ResultReply(msg.call, result_to_wire(await svc.await_arrival(msg.request_id, msg.timeout)))
        if isinstance(msg, Abort):
            result = await svc.abort(msg.request_id)
            return ResultReply(msg.call, result_to_wire(result) if result else None)
        if isinstance(msg, Poll):
            if msg.side == "recv":
                return PollReply(msg.call, int(svc.poll_arrival(msg.request_id)))
            known = conn.handles.get(msg.request_id)
            if known is None:
                raise UnknownRequestError(f"unknown request {msg.request_id!r} (not sent on this connection)")
            return PollReply(msg.call, int(known.poll()))
        if isinstance(msg, Status):
            return StatusReply(msg.call, self.status())
        raise ProtocolError(f"unexpected {type(msg).__name__}")  # pragma: no cover - schema forbids

    def _check_open(self, role: str) -> None:
        if role not in self.roles:
            raise KVServiceError(f"this sidecar does not serve the {role} role (sidecar.roles = {list(self.roles)})")
        if self.draining:
            raise KVServiceError("sidecar is shutting down")

    def _watch(self, conn: Connection, side: str, rid: str, wait: Any) -> None:
        assert conn.tg is not None
        conn.watching += 1

        async def watcher() -> None:
            try:
                result = await wait()
                conn.owned.discard(rid)
                await conn.push(Finished(side, result_to_wire(result)))
            finally:
                conn.watching -= 1
                if not conn.watching:
                    conn.idle.set()

        conn.tg.start_soon(watcher)

    async def _abort_owned(self, conn: Connection) -> int:
        """Abort what a departed worker started and that has not ended."""
        n = 0
        for rid in sorted(conn.owned):
            if not self._live(conn, rid):
                continue
            try:
                await self.svc.abort(rid)
            except (UnknownRequestError, KVServiceError):
                continue
            n += 1
            log.warning("sidecar.request_aborted", request_id=rid, conn=conn.number, pid=conn.pid,
                        why="worker disconnected")
        conn.owned.clear()
        self.counters.aborted_on_disconnect_total += n
        return n

    def _live(self, conn: Connection, rid: str) -> bool:
        handle = conn.handles.get(rid)
        if handle is not None:
            return handle.result is None
        try:
            return self.svc.poll_arrival(rid) not in (KVPoll.Success, KVPoll.Failed)
        except UnknownRequestError:
            return False

    def status(self) -> dict[str, Any]:
        return {
            **self.svc.status(), "roles": list(self.roles), "workers": len(self.conns),
            "worker_calls_waiting": sum(len(c.calls) for c in self.conns),
            "draining": self.draining, "address": self.svc.address, "agent": self.svc.agent_name,
        }


async def _try_send(conn: Connection, msg: ServerMessage) -> None:
    try:
        with anyio.move_on_after(1.0):
            await conn.framed.send(msg)
    except CONNECTION_ERRORS:
        pass


def _peer_pid(stream: anyio.abc.SocketStream) -> int | None:
    """The worker's pid from SO_PEERCRED (Linux), for logs."""
    try:
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid: int = struct.unpack("3i", creds)[0]
        return pid
    except (OSError, AttributeError, anyio.TypedAttributeLookupError):
        return None
