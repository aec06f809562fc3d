"""The calls a worker makes, carried out against the ``TransferService``.

Every call naming a request id first checks that the calling worker owns it, or
that nobody does (``owners.py``); ``send`` and ``expect`` claim it (``decline``, which
registers nothing here, does not).  Each request
a worker sends or expects is watched without a task: a done callback on the
service's future of its end (``completion_future`` / ``arrival_future``) ends
its bookkeeping and queues a ``Finished`` frame on the connection's outbox,
which the connection's one pusher task writes (``SidecarServer._pusher``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .._log import get_logger
from .._results import KVPoll, KVServiceError, ProtocolError, TransferResult, UnknownRequestError
from .._service import TransferService, early_expect, expect_waits
from .connection import Connection
from .owners import RECV, SEND, Key, Owners
from .wire import (
    Abort,
    AwaitArrival,
    AwaitCompletion,
    AwaitSettled,
    Call,
    Decline,
    Declined,
    Done,
    Expect,
    Expected,
    ExpectedReply,
    Finished,
    LivePeers,
    PeersReply,
    Poll,
    PollReply,
    ResultReply,
    Send,
    SendReply,
    ServerMessage,
    Status,
    StatusReply,
    result_to_wire,
)

log = get_logger("kvservice.sidecar")


class WorkerCalls:
    """``execute(conn, call)`` for the server; ``draining`` refuses new requests."""

    def __init__(self, svc: TransferService, roles: tuple[str, ...], owners: Owners,
                 status: Callable[[], dict[str, Any]]) -> None:
        self.svc = svc
        self.roles = roles
        self.owners = owners
        self.status = status
        self.draining = False

    async def execute(self, conn: Connection, msg: Call) -> ServerMessage:
        svc, owners, me = self.svc, self.owners, conn.number
        if isinstance(msg, Send):
            self._check_open("prefill")
            rid, key = msg.request_id, (SEND, msg.request_id)
            new = owners.claim(me, key)  # this worker's first send of it (NotOwnerError: another's id)
            layers = range(*msg.layers) if msg.layers is not None else None
            try:
                handle = await svc.send(rid, msg.pages, last=msg.last, timeout=msg.timeout, layers=layers,
                                        payload=msg.payload, fit=msg.fit, receiver=msg.receiver)
            except (ValueError, KVServiceError):
                if new:
                    owners.unclaim(key)  # nothing was registered (bad pages, a completed id, ...)
                raise
            result = handle.result
            if new:
                if result is None:
                    conn.sending[rid] = handle
                    self.watch(conn, key, svc.completion_future(handle))
                else:  # ended at once (a failure that sticks to the id)
                    conn.sent.put(rid, handle)
                    owners.ended(key)
            return SendReply(msg.call, int(handle.poll()), result_to_wire(result) if result else None)
        if isinstance(msg, AwaitCompletion):
            owners.check(me, msg.request_id)
            known = conn.handle(msg.request_id)
            if known is None:
                raise UnknownRequestError(f"unknown request {msg.request_id!r} (not sent on this connection)")
            return ResultReply(msg.call, result_to_wire(await svc.await_completion(known, timeout=msg.timeout)))
        if isinstance(msg, Expect):
            self._check_open("decode")
            rid, key = msg.request_id, (RECV, msg.request_id)
            new = owners.claim(me, key)  # before the await: a disconnect during expect() aborts it
            try:
                await svc.expect(rid, msg.pages, sender=msg.sender, timeout=msg.timeout, verify=msg.verify,
                                 member=msg.member)
            except (ValueError, KVServiceError):
                if new:
                    owners.unclaim(key)  # nothing was registered (e.g. a duplicate id, a bad sender)
                raise
            self.watch(conn, key, svc.arrival_future(rid))  # no await since expect(): it is known
            return Done(msg.call, int(svc.poll_arrival(rid)))
        if isinstance(msg, Decline):  # registers nothing: no claim, and allowed while draining
            self._check_role("decode")
            owners.check(me, msg.request_id)
            return Declined(msg.call, await svc.decline(msg.request_id, sender=msg.sender, message=msg.message))
        if isinstance(msg, Expected):
            owners.check(me, msg.request_id)
            early = early_expect(svc, msg.request_id)
            return ExpectedReply(msg.call, early.expected, early.pages,
                                 (early.dropped[0].value, early.dropped[1]) if early.dropped is not None else None)
        if isinstance(msg, AwaitArrival):
            owners.check(me, msg.request_id)
            return ResultReply(msg.call, result_to_wire(await svc.await_arrival(msg.request_id, msg.timeout)))
        if isinstance(msg, AwaitSettled):
            owners.check(me, msg.request_id)
            return ResultReply(msg.call, result_to_wire(await svc.await_settled(msg.request_id, msg.timeout)))
        if isinstance(msg, Abort):
            owners.check(me, msg.request_id)
            result = await svc.abort(msg.request_id)
            return ResultReply(msg.call, result_to_wire(result) if result else None)
        if isinstance(msg, Poll):
            owners.check(me, msg.request_id)
            if msg.side == RECV:
                return PollReply(msg.call, int(svc.poll_arrival(msg.request_id)))
            known = conn.handle(msg.request_id)
            if known is None:
                raise UnknownRequestError(f"unknown request {msg.request_id!r} (not sent on this connection)")
            return PollReply(msg.call, int(known.poll()))
        if isinstance(msg, Status):
            return StatusReply(msg.call, self.status())
        if isinstance(msg, LivePeers):
            return PeersReply(msg.call, await svc.live_peers(msg.role))
        raise ProtocolError(f"unexpected {type(msg).__name__}")  # pragma: no cover - schema forbids

    def expect_waits(self, msg: Expect) -> bool:
        """Whether ``msg`` may wait (a dial to its sender): else the reader runs it, no task."""
        return expect_waits(self.svc, msg.sender)

    def _check_open(self, role: str) -> None:
        self._check_role(role)
        if self.draining:
            raise KVServiceError("sidecar is shutting down")

    def _check_role(self, role: str) -> None:
        if role not in self.roles:
            raise KVServiceError(f"this sidecar does not serve the {role} role (sidecar.roles = {list(self.roles)})")

    def watch(self, conn: Connection, key: Key, future: asyncio.Future[TransferResult]) -> None:
        """Tell the worker when ``key``'s request ends (``future``: the service's of its end)."""
        side = key[0]
        ended = conn.on_end.get(side)
        if ended is None:
            ended = conn.on_end[side] = _Ended(conn, self.owners, side)
        conn.watching += 1
        conn.watched[key] = future
        future.add_done_callback(ended, context=conn.context)

    async def abort_owned(self, conn: Connection) -> int:
        """Abort what a departed worker started and that has not ended."""
        live = sorted({rid for side, rid in self.owners.disconnected(conn.number) if self._live(conn, side, rid)})
        n = 0
        for rid in live:
            try:
                await self.svc.abort(rid)
            except KVServiceError:  # UnknownRequestError included: it ended meanwhile
                continue
            n += 1
            log.warning("sidecar.request_aborted", request_id=rid, conn=conn.number, pid=conn.pid,
                        why="worker disconnected")
        return n

    def _live(self, conn: Connection, side: str, rid: str) -> bool:
        if side == SEND:
            handle = conn.sending.get(rid)
            return handle is not None and handle.result is None
        try:
            return self.svc.poll_arrival(rid) not in (KVPoll.Success, KVPoll.Failed)
        except UnknownRequestError:
            return False


class _Ended:
    """The done callback of the futures one connection watches on one ``side``: what a
    watcher task per request did, without the task (its creation, anyio's wrapper and
    cancel scope, some 27 objects the cyclic GC walks, and a write per request).  The request's key is its
    side and its result's id; a cancelled future (the worker went) is only counted off."""

    __slots__ = ("conn", "owners", "side")

    def __init__(self, conn: Connection, owners: Owners, side: str) -> None:
        self.conn = conn
        self.owners = owners
        self.side = side

    def __call__(self, future: asyncio.Future[TransferResult]) -> None:
        conn = self.conn
        if future.cancelled():  # Connection.unwatch_all: nobody to tell
            conn.unwatched(1)
            return
        result = future.result()
        side, rid = self.side, result.request_id
        key = (side, rid)
        if conn.watched.get(key) is future:
            del conn.watched[key]
        self.owners.ended(key)
        if side == SEND and (handle := conn.sending.pop(rid, None)) is not None:
            conn.sent.put(rid, handle)
        if conn.closed:
            conn.unwatched(1)
        else:
            conn.finish(Finished(side, result_to_wire(result)))  # the pusher counts it off once written
