"""The workers' API: a Unix-socket server in front of one ``TransferService``.

Admission comes before a byte is read: the connecting process's uid (the
kernel's ``SO_PEERCRED``) must be the daemon's own or in
``sidecar.allowed_uids``, fewer than ``sidecar.max_clients`` connections may be
open (greeted or greeting), and the daemon must not be draining.  Then a Hello
of at most ``HELLO_MAX_BYTES`` must come within ``HELLO_TIMEOUT_S``; only after
it may frames reach ``sidecar.max_frame_bytes``.  Every refusal gets an
``Error`` frame (call 0), is logged and counted by kind (``counters.refused``)
and closes that connection only; ``accept_loop`` guards the rest (a failed
``accept()``, a handler that raises).

Each connection is one worker.  Calls that never wait (``send``, ``poll``, ``status``, an
``expect`` whose sender is linked now, ...) run in the connection's reader, in order; the
others as tasks of the connection's own task group, so a slow ``await_arrival`` or an
``expect`` that dials never holds up a ``send``, and when the
worker goes away (EOF, a broken frame, a stuck socket) the group is cancelled
and every request the worker started and that has not ended is aborted
(``ABORTED``, the peer told), without touching other workers.  A worker acts
on its own request ids only (``owners.py``).

Every request a connection sends or expects is watched by a done callback on the
service's future of its end (``WorkerCalls.watch``: no task per request), which
queues a ``Finished`` frame on the connection's outbox, so the client resolves
handles without asking.  One pusher task per connection writes whatever is
queued in one write (a burst of requests that end together costs one syscall and
one wake-up of the worker), never inside a call's reply.
"""

from __future__ import annotations

import os
import typing
from typing import Any

import anyio
import anyio.abc

from .._control.accept import accept_loop
from .._control.links import CONNECTION_ERRORS
from .._control.protocol import FrameError
from .._log import get_logger
from .._results import KVServiceError, UnknownRequestError
from .._service import TransferService
from .._transfer.requests import Recent
from .._trust.peercred import PeerCred, PeerCredError, stream_peer_cred, uid_allowed
from .calls import WorkerCalls
from .connection import Connection, ServerCounters
from .frames import frame_stream
from .owners import NotOwnerError, Owners
from .settings import SidecarConfig
from .wire import (
    SIDECAR_OLDEST_VERSION,
    SIDECAR_PROTOCOL_VERSION,
    Abort,
    Bye,
    Call,
    Cancel,
    Error,
    Expect,
    Expected,
    Hello,
    LivePeers,
    Poll,
    Send,
    ServerMessage,
    Status,
    Welcome,
    call_refusal,
    decode_client,
    encode,
    encode_frames,
    sidecar_version,
)

log = get_logger("kvservice.sidecar")

HELLO_TIMEOUT_S = 5.0
#: the largest frame before the handshake: a Hello is a version and a name of 256 characters
HELLO_MAX_BYTES = 4096
#: a worker that does not take a frame within this long is dropped (its requests aborted)
PUSH_TIMEOUT_S = 10.0
MAX_CALLS_PER_CONNECTION = 10_000
#: at shutdown, how long to wait for the last Finished frames before Bye
FLUSH_TIMEOUT_S = 2.0
#: calls that complete without waiting on anything: run in the reader, saving a task per call
_INLINE = (Send, Abort, Poll, Status, LivePeers, Expected)
#: each call's name in the counters ("send", "poll", ...): its frame's tag
_OPS: dict[type, str] = {t: str(t.__struct_config__.tag) for t in typing.get_args(Call)}


class SidecarServer:
    """Serves ``svc`` to workers on a Unix listener until ``close()``."""

    def __init__(self, svc: TransferService, config: SidecarConfig, shm_name: str) -> None:
        self.svc = svc
        self.cfg = config
        self.roles = tuple(config.sidecar.roles)
        self.shm_name = shm_name
        self.conns: set[Connection] = set()
        self.owners = Owners(svc.remembers)
        self.calls = WorkerCalls(svc, self.roles, self.owners, self.status)
        self.counters = ServerCounters()
        self.listening = False
        self.draining = False
        self._listen_scope = anyio.CancelScope()
        self._numbers = 0
        self._greeting = 0

    # -- listening ------------------------------------------------------------------
    async def serve(self, listener: anyio.abc.SocketListener, *,
                    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            with self._listen_scope:
                async with listener:
                    self.listening = True
                    task_status.started()
                    try:
                        await accept_loop(listener, self._handle, tg, self._on_listener_error, name="workers")
                    finally:
                        self.listening = False

    def _on_listener_error(self, kind: str, exc: BaseException) -> None:
        self.counters.refused[kind] += 1

    def stop_accepting(self) -> None:
        """No new workers, no new requests; calls and pushes for existing ones go on."""
        self.draining = self.calls.draining = True
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
                await self._push(conn, Bye("sidecar shutting down"))
            conn.close()

    # -- admission ----------------------------------------------------------------------
    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        """One worker's connection, from accept to close (``accept_loop`` closes the stream)."""
        self._numbers += 1
        self.counters.connections_total += 1
        cred: PeerCred | None = None
        try:
            cred, who = stream_peer_cred(stream), ""
        except PeerCredError as exc:
            who = str(exc)
        conn = Connection(self._numbers, frame_stream(stream, HELLO_MAX_BYTES, decode_client), cred,
                          Recent(self.svc.config.results_kept))
        try:
            await self._admit(conn, cred, who)
        finally:
            conn.framed.stop_reading()  # accept_loop closes the socket next

    async def _admit(self, conn: Connection, cred: PeerCred | None, who: str) -> None:
        """Refuse the connection, or greet and serve it (``who``: why ``cred`` is unknown)."""
        sidecar = self.cfg.sidecar
        if cred is None:
            return await self._refuse(conn, "uid", f"cannot tell which user the worker runs as: {who}")
        if not uid_allowed(cred.uid, sidecar.allowed_uids, root_too=False):
            return await self._refuse(conn, "uid", f"uid {cred.uid} may not use this sidecar (allowed: the "
                                                   f"daemon's own uid {os.geteuid()} and sidecar.allowed_uids)")
        if self.draining:
            return await self._refuse(conn, "draining", "sidecar is shutting down")
        if len(self.conns) + self._greeting >= sidecar.max_clients:
            return await self._refuse(
                conn, "too_many_workers", f"too many workers connected (sidecar.max_clients = {sidecar.max_clients})")
        self._greeting += 1
        try:
            greeted = await self._greet(conn)
        finally:
            self._greeting -= 1
        if greeted:
            conn.framed.set_limit(sidecar.max_frame_bytes)
            await self._serve_worker(conn)

    async def _refuse(self, conn: Connection, kind: str, message: str, error: str = "KVServiceError") -> None:
        """Count, log and tell a connection why it is refused; the caller then ends it."""
        self.counters.refused[kind] += 1
        cred = conn.cred
        if (unlogged := self.counters.log_throttle.allow(kind)) is not None:
            log.warning("sidecar.client_refused", kind=kind, conn=conn.number, pid=conn.pid,
                        uid=cred.uid if cred else None, error=message, unlogged=unlogged)
        try:
            with anyio.move_on_after(1.0):
                await conn.framed.send(Error(0, error, message))
        except CONNECTION_ERRORS:
            pass

    async def _greet(self, conn: Connection) -> bool:
        try:
            with anyio.fail_after(HELLO_TIMEOUT_S):
                hello = await conn.framed.recv()
            if not isinstance(hello, Hello):
                raise FrameError(f"expected hello, got {type(hello).__name__}")
            version = sidecar_version(hello.version)
            if version is None:
                raise FrameError(f"protocol version {hello.version}, this sidecar speaks "
                                 f"{SIDECAR_OLDEST_VERSION}-{SIDECAR_PROTOCOL_VERSION}")
        except FrameError as exc:
            await self._refuse(conn, "hello_invalid", str(exc), "ProtocolError")
            return False
        except TimeoutError:
            await self._refuse(conn, "hello_timeout", f"no hello within {HELLO_TIMEOUT_S:g} s", "ProtocolError")
            return False
        except CONNECTION_ERRORS:
            self.counters.refused["hello_incomplete"] += 1
            return False
        if self.draining:
            await self._refuse(conn, "draining", "sidecar is shutting down")
            return False
        conn.client, conn.version = hello.client, version
        try:
            await conn.framed.send(self._welcome(version))
        except CONNECTION_ERRORS:
            return False
        return True

    def _welcome(self, version: int) -> Welcome:
        lay = self.svc.layout
        return Welcome(
            version=version, pid=os.getpid(), agent=self.svc.agent_name,
            address=self.svc.address, roles=list(self.roles), shm_name=self.shm_name,
            layout={**lay.wire_shape(), "num_pages": lay.num_pages},
            max_frame_bytes=self.cfg.sidecar.max_frame_bytes, results_kept=self.svc.config.results_kept,
        )

    # -- one worker ----------------------------------------------------------------------
    async def _serve_worker(self, conn: Connection) -> None:
        self.conns.add(conn)
        self.owners.connected(conn.number)
        log.info("sidecar.client_connected", conn=conn.number, pid=conn.pid, client=conn.client)
        try:
            async with anyio.create_task_group() as tg:
                conn.tg = tg
                tg.start_soon(self._pusher, conn)
                await self._read(conn)
                conn.close()
        finally:
            self.conns.discard(conn)
            conn.unwatch_all()
            with anyio.CancelScope(shield=True):
                aborted = await self.calls.abort_owned(conn)
            self.counters.aborted_on_disconnect_total += aborted
            (log.warning if aborted else log.info)(
                "sidecar.client_disconnected", conn=conn.number, pid=conn.pid, aborted=aborted)

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
                    self.counters.refused["duplicate_call"] += 1
                    await self._push(conn, Error(msg.call, "ProtocolError", f"call {msg.call} is already in flight"))
                elif (why := call_refusal(msg, conn.version)) is not None:  # a client that ignored our Welcome
                    self.counters.refused["call_version"] += 1
                    await self._push(conn, Error(msg.call, "ProtocolError", why))
                elif len(conn.calls) >= MAX_CALLS_PER_CONNECTION:
                    self.counters.refused["too_many_calls"] += 1
                    await self._push(conn, Error(msg.call, "KVServiceError", "too many calls in flight"))
                elif isinstance(msg, _INLINE) or (isinstance(msg, Expect) and not self.calls.expect_waits(msg)):
                    # never waits: answer it now, in order, no task, nor a scope (no Cancel is
                    # read meanwhile); an expect whose sender is linked now does not wait either
                    await self._run_call(conn, msg, None)
                else:
                    scope = conn.calls[msg.call] = anyio.CancelScope()
                    conn.tg.start_soon(self._run_call, conn, msg, scope)
        except FrameError as exc:
            self.counters.refused["frame"] += 1
            log.warning("sidecar.frame_rejected", conn=conn.number, pid=conn.pid, error=str(exc))
            await self._push(conn, Error(0, "ProtocolError", str(exc)))
        except CONNECTION_ERRORS:
            pass

    async def _push(self, conn: Connection, msg: ServerMessage) -> None:
        """Send a frame; a worker that cannot take it in time is dropped."""
        if not conn.closed:
            await self._write(conn, encode(msg))

    async def _write(self, conn: Connection, frames: bytes) -> bool:
        """Write whole frames under the stream's write lock (never inside another's);
        False once the connection is closed: the worker is gone, or it did not take them
        within ``PUSH_TIMEOUT_S`` and is dropped."""
        try:
            await conn.framed.send_frame(frames, PUSH_TIMEOUT_S)
        except TimeoutError:
            self.counters.refused["push_timeout"] += 1
            log.warning("sidecar.client_stuck", conn=conn.number, pid=conn.pid, timeout_s=PUSH_TIMEOUT_S)
            conn.close()
            return False
        except CONNECTION_ERRORS:
            conn.close()
            return False
        return True

    async def _pusher(self, conn: Connection) -> None:
        """The connection's Finished frames (``Connection.finish``): everything queued when it
        wakes, in one write.  Runs until the connection's group is cancelled."""
        outbox = conn.outbox
        while not conn.closed:
            if not outbox:
                conn.wake = wake = anyio.Event()
                await wake.wait()
                continue
            frames = outbox[:]
            outbox.clear()
            if not await self._write(conn, encode_frames(frames)):
                return
            conn.unwatched(len(frames))

    async def _run_call(self, conn: Connection, msg: Call, scope: anyio.CancelScope | None) -> None:
        """Run a call and push its reply; ``scope`` (a call in a task of its own) is what
        the worker's ``Cancel`` cancels (no reply then)."""
        op = _OPS[type(msg)]
        self.counters.calls[op] += 1
        reply: ServerMessage | None = None
        try:
            if scope is None:
                reply = await self.calls.execute(conn, msg)
            else:
                with scope:
                    reply = await self.calls.execute(conn, msg)
        except NotOwnerError as exc:
            self.counters.refused["not_owner"] += 1
            log.warning("sidecar.not_owner", op=op, conn=conn.number, pid=conn.pid,
                        request_id=getattr(msg, "request_id", None))
            reply = Error(msg.call, "NotOwnerError", str(exc))
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
            await self._push(conn, reply)

    def status(self) -> dict[str, Any]:
        return {
            **self.svc.status(), "roles": list(self.roles), "workers": len(self.conns),
            "worker_calls_waiting": sum(len(c.calls) for c in self.conns),
            "workers_refused": dict(sorted(self.counters.refused.items())),
            "draining": self.draining, "address": self.svc.address, "agent": self.svc.agent_name,
        }
