"""``TransferService``: the public API, request lifecycles and the service's lifetime.

Threading: everything here runs on the event loop.  NIXL is reached only
through the ``Door``, on the ``DoorThread``.  Peer links live in ``_control``.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import numpy as np
import numpy.typing as npt
import structlog

from ._addresses import split_address
from ._config import ServiceConfig
from ._control import ControlPlane, LocalPeer
from ._deadlines import Deadlines
from ._door import Door, DoorError, DoorThread
from ._pool import KVPool
from ._protocol import FENCE, Abort, Expect, Failed, Join, Message, Settled, decode_notif, text
from ._requests import (
    EarlyExpects,
    Recent,
    RecvRequest,
    SendRequest,
    TransferHandle,
    check_request_id,
    make_result,
)
from ._results import (
    FailureReason,
    KVPoll,
    KVServiceError,
    Overloaded,
    TransferResult,
    TransferStatus,
    UnknownRequestError,
)
from ._settle import Settlement
from ._stats import Stats
from ._trust.keys import load_key
from ._watchdog import Watchdog

log = structlog.get_logger("kvservice")

#: longest wait between two dials that try to settle a lost sender's requests
PROBE_MAX_S = 5.0

DoorFactory = Callable[[str, ServiceConfig], Door]
Pages = Sequence[int] | npt.NDArray[Any]


def _nixl_door(agent_name: str, config: ServiceConfig) -> Door:
    from ._nixl import NixlDoor

    return NixlDoor(agent_name, progress_thread=config.progress_thread, ucx_env=config.ucx_env)


class TransferService:
    """Moves KV pages between services over NIXL; every transfer ends as a result.

    Use as ``async with TransferService(config) as svc:``.  Entering creates the
    NIXL agent, registers the pool and starts the control listener and the
    watchdog; leaving drains in-flight work for ``drain_grace_s`` and fails the
    rest with ``SHUTDOWN``.
    """

    def __init__(
        self, config: ServiceConfig | None = None, *, pool: Any = None,
        door_factory: DoorFactory | None = None,
    ) -> None:
        self.config = config or ServiceConfig()
        self.layout = self.config.layout
        self._page_bytes = self.layout.page_bytes
        self._pool_tensor = pool
        self._kv: KVPool | None = None
        self.agent_name = f"{self.config.agent_prefix}-{uuid.uuid4().hex[:12]}"
        self._door_factory = door_factory or _nixl_door
        self._thread: DoorThread | None = None
        self._door: Door | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._watchdog: Watchdog | None = None
        self._control: ControlPlane | None = None
        self._sends: dict[str, SendRequest] = {}
        self._recvs: dict[str, RecvRequest] = {}
        # Ended requests keep only their result: one object each for the cyclic GC
        # to walk, not the request's events, queues and sets.
        self._sends_done: Recent[str, TransferResult] = Recent(self.config.results_kept)
        self._recvs_done: Recent[str, TransferResult] = Recent(self.config.results_kept)
        self._deadlines: Deadlines[SendRequest | RecvRequest] = Deadlines()
        # Expects that arrived before the matching send()
        self._early = EarlyExpects(self.config.max_unknown_expects, self.config.unknown_expect_ttl_s)
        # Expects dropped (peer lost / aborted) before any send(): a later send fails at once.
        self._dropped: Recent[str, FailureReason] = Recent(self.config.results_kept)
        self._settlement = Settlement(self._recvs_done, self._sends_done)
        self._idle = anyio.Event()
        self._closing = False
        self.stats = Stats()
        self.address = ""

    @property
    def kv(self) -> KVPool:
        """The registered KV pool (available once the service has started)."""
        if self._kv is None:
            raise KVServiceError("the KV pool exists once the service has started ('async with')")
        return self._kv

    # -- lifetime ---------------------------------------------------------------
    async def __aenter__(self) -> TransferService:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._start()
        except BaseException:
            # Stop what did start, then raise the start's own error (not a group).
            self._tg.cancel_scope.cancel()
            try:
                await self._tg.__aexit__(None, None, None)
            finally:
                self._close_door()
            raise
        return self

    async def _start(self) -> None:
        assert self._tg is not None
        cfg = self.config
        self._thread = DoorThread()
        # Allocating (and touching) a multi-GB pool takes seconds: not on the loop.
        self._kv = await anyio.to_thread.run_sync(KVPool, self.layout, self._pool_tensor)
        self._door = await self._thread.call(self._door_factory, self.agent_name, cfg)
        await self._thread.call(self._door.register_pool, self.kv.tensor, self.kv.descriptor_table())
        metadata = await self._thread.call(self._door.metadata)
        key = None
        if cfg.auth_key_file is not None:
            key = await anyio.to_thread.run_sync(load_key, cfg.auth_key_file)
        elif not cfg.loopback_only:
            log.warning("service.unauthenticated", host=cfg.host,
                        detail="allow_unauthenticated: anyone who reaches this port can peer with it")
        kv = self.kv
        local = LocalPeer(self.agent_name, self.layout, Join(
            metadata=metadata, layout=dict(self.layout.wire_shape()), num_pages=self.layout.num_pages,
            base_addr=kv.base_addr, device_id=kv.device_id), key)
        self._watchdog = Watchdog(
            self._thread, self._door, self.layout, self,
            poll_interval=cfg.poll_interval_s, idle_interval=cfg.idle_poll_interval_s,
            max_posts=cfg.max_posts_per_tick, max_checks=cfg.max_checks_per_tick,
            max_post_bytes=cfg.max_post_bytes_per_tick,
        )
        self._control = ControlPlane(cfg, self._thread, self._door, self, local, self.stats, self._tg)
        self.address = await self._control.listen()
        await self._tg.start(self._watchdog.run)
        await self._tg.start(self.stats.monitor_loop_lag)
        log.info("service.started", address=self.address, agent=self.agent_name,
                 pool_bytes=self.layout.pool_bytes, authenticated=key is not None)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        assert self._tg is not None and self._control is not None
        self._closing = True
        grace = self.config.drain_grace_s if exc is None else 0.0
        with anyio.CancelScope(shield=True):
            self._control.stop_listening()
            with anyio.move_on_after(grace):
                while self._sends or self._recvs:
                    self._idle = anyio.Event()
                    await self._idle.wait()
            for sreq in list(self._sends.values()):
                self._fail(sreq, FailureReason.SHUTDOWN, "service shut down before completion")
            for rreq in list(self._recvs.values()):
                self._fail(rreq, FailureReason.SHUTDOWN, "service shut down before arrival")
            if self._watchdog is not None:
                # The last releases, before the Bye: a peer takes our Bye as "settled".
                await self._watchdog.tick()
            await self._control.close_all(timeout=1.0)
            self._tg.cancel_scope.cancel()
        try:
            await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            self._close_door()
            log.info("service.stopped", address=self.address)
        return False

    def _close_door(self) -> None:
        if self._thread is not None:
            if self._door is not None:
                self._thread.call_sync(self._door.close)
            self._thread.shutdown()
            self._thread = None

    def _check_open(self) -> None:
        if self._tg is None or self._watchdog is None:
            raise KVServiceError("service is not running (use 'async with TransferService(...)')")
        if self._closing:
            raise KVServiceError("service is shutting down")

    # -- sending side -------------------------------------------------------------
    async def send(self, request_id: str, pages: Pages, *, last: bool = False,
                   timeout: float | None = None, receiver: str | None = None) -> TransferHandle:
        """Queue a chunk of ``request_id``'s pages for the receiver; never waits for the copy.

        ``timeout`` (seconds, default ``transfer_timeout_s``) bounds the whole
        request from the moment its destination is known.  ``receiver``
        ("host:port", on the first chunk) pins the request to that decode: an
        Expect for it from any other peer is refused (``REFUSED`` there) and
        counted.  Without it the first Expect for the id binds it.
        """
        self._check_open()
        check_request_id(request_id)
        src = self.layout.check_pages(pages)
        req = self._sends.get(request_id)
        pinned: str | None = None
        if receiver is not None:
            if req is not None or request_id in self._sends_done:
                raise ValueError(f"request {request_id!r}: receiver= goes with the first chunk only")
            assert self._control is not None
            pinned = await self._control.canonical(receiver)  # ValueError when malformed
            self._check_open()
        if req is None:
            done = self._sends_done.get(request_id)
            if done is not None:
                if done.ok:
                    raise ValueError(f"request {request_id!r} already completed; send after last")
                return TransferHandle(SendRequest.ended(done))  # sticky failure: not posted
        elif req.last:
            raise ValueError(f"request {request_id!r}: send after last=True")
        queued = (req.pages_queued if req else 0) + int(src.size)
        dest = req.dest if req else None
        if dest is None and req is None:
            dest = self._early.pages_of(request_id)
        if dest is not None:
            if queued > dest.size:
                raise ValueError(
                    f"request {request_id!r}: {queued} pages sent, receiver expects {dest.size}")
            if last and queued != dest.size:
                raise ValueError(
                    f"request {request_id!r}: last chunk ends at {queued} pages, receiver expects {dest.size}")
        if req is None:
            req = self._new_send(request_id, timeout, pinned)
        req.pending.append(src)
        req.pages_queued = queued
        req.last = last
        if timeout is not None:
            req.timeout = timeout
            if req.peer is not None:  # bound: from now; else the bind starts it
                req.deadline = time.monotonic() + timeout
                self._deadlines.push(req)
        if req.peer is not None:
            self._watchdog.schedule(req)  # type: ignore[union-attr]
        return TransferHandle(req)

    def _new_send(self, request_id: str, timeout: float | None, receiver: str | None) -> SendRequest:
        self._check_capacity()
        now = time.monotonic()
        cfg = self.config
        req = SendRequest(
            request_id=request_id, created=now,
            deadline=now + (timeout or cfg.transfer_timeout_s) + cfg.bootstrap_timeout_s,
            bootstrap_deadline=now + cfg.bootstrap_timeout_s, receiver=receiver,
        )
        self._sends[request_id] = req
        self._deadlines.push(req)
        dropped = self._dropped.pop(request_id)
        if dropped is not None:
            self._fail(req, dropped, "the receiver's expect was dropped before this send")
        else:
            early = self._early.pop(request_id)
            if early is not None:
                peer, pages = early
                if self._receiver_ok(req, peer):
                    self._bind(req, peer, pages)
        return req

    def _check_capacity(self) -> None:
        live = len(self._sends) + len(self._recvs)
        if live >= self.config.max_live_requests:
            self.stats.refuse("live_request_limit")
            raise Overloaded(f"{live} requests alive, the limit (max_live_requests) is "
                             f"{self.config.max_live_requests}")

    def _receiver_ok(self, req: SendRequest, agent: str) -> bool:
        """Whether ``agent`` may receive ``req``; if not, it is told (``REFUSED``) and it is counted."""
        if req.receiver is None:
            return True
        assert self._control is not None
        if req.receiver in self._control.addresses_of(agent):
            return True
        self.stats.refuse("receiver_mismatch")
        log.warning("transfer.expect_refused", request_id=req.request_id, agent=agent, receiver=req.receiver)
        self._refuse_expect(agent, req.request_id, FailureReason.REFUSED, "the request is pinned to another receiver")
        return False

    async def await_completion(self, handle: TransferHandle, timeout: float | None = None) -> TransferResult:
        """Wait for the request behind ``handle`` to end.

        If ``timeout`` passes first the request is failed with ``TIMEOUT`` (its
        handles released, the receiver told) and that result is returned.  If the
        *caller* is cancelled, the cancellation propagates and the transfer goes
        on; ``abort()`` stops it.

        A failed result is returned once the door has released every handle of
        the request (``result.settled``): from then on nothing reads the source
        pages, and they may be reused.
        """
        req = handle._req
        if timeout is None:
            await req.done.wait()
        else:
            with anyio.move_on_after(timeout):
                await req.done.wait()
            if req.result is None:
                self._fail(req, FailureReason.TIMEOUT, f"not complete within await_completion timeout {timeout}s")
                await req.done.wait()  # the release: one watchdog tick
        assert req.result is not None
        return req.result

    # -- receiving side -------------------------------------------------------------
    async def expect(self, request_id: str, pages: Pages, *, sender: str,
                     timeout: float | None = None) -> None:
        """Announce that ``request_id`` goes into ``pages``, and tell ``sender``.

        Returns once the request is registered here and its Expect is queued on
        the link to the sender (dialled first if needed), or once the request
        has failed (e.g. ``PEER_LOST`` when the sender cannot be reached; see
        ``await_arrival``).  If this process dies before the Expect is written,
        the sender never hears of the request and its ``send`` ends ``TIMEOUT``
        at its bootstrap deadline.
        """
        self._check_open()
        check_request_id(request_id)
        dst = self.layout.check_pages(pages)
        if request_id in self._recvs or request_id in self._recvs_done:
            raise ValueError(f"request {request_id!r} is already expected (duplicate request id)")
        assert self._control is not None
        split_address(sender)  # ValueError naming the problem
        self._check_capacity()
        now = time.monotonic()
        req = RecvRequest(
            request_id=request_id, created=now,
            deadline=now + (timeout or self.config.arrival_timeout_s),
            sender=sender, pages=dst,
        )
        self._recvs[request_id] = req
        self._deadlines.push(req)
        # From now on the sender's WRITEs need this side to poll NIXL: wake the
        # watchdog out of its idle wait rather than leave them stalled until it ends.
        self._watchdog.wake()  # type: ignore[union-attr]
        try:
            link = await self._control.link_to(sender)
        except anyio.get_cancelled_exc_class():
            self._fail(req, FailureReason.ABORTED, "expect() was cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - classified in ControlPlane.dial_failure
            reason = self._control.dial_failure(exc)
            original = exc.original if isinstance(exc, DoorError) else exc  # NIXL's own exception
            self._fail(req, reason, f"cannot reach sender {sender}: {exc}", error=original)
            return
        if self._closing:
            self._fail(req, FailureReason.SHUTDOWN, "service shut down before the expect was sent")
            return
        if req.result is not None:  # aborted (or timed out) while dialling: the sender fails it at once
            assert req.result.reason is not None
            link.send(Abort(request_id, req.result.reason.value, req.result.message))
            return
        if req.result is None:
            req.peer = link.agent
            req.started_at = time.monotonic()
            link.send(Expect(request_id, dst.tolist()))

    async def await_arrival(self, request_id: str, timeout: float | None = None) -> TransferResult:
        """Wait until every page of ``request_id`` has landed, or it failed.

        A ``timeout`` that passes first fails the request with ``TIMEOUT`` and
        tells the sender to stop.  A failed result does not free the pages: a
        WRITE already posted may still land in them.  Reuse them only once
        ``await_settled`` says so (``result.settled``); a success is settled.
        """
        req = self._recvs.get(request_id)
        if req is None:
            done = self._recvs_done.get(request_id)
            if done is None:
                raise UnknownRequestError(f"unknown request {request_id!r} (call expect() first)")
            return done
        if timeout is None:
            await req.done.wait()
        else:
            with anyio.move_on_after(timeout):
                await req.done.wait()
            if req.result is None:
                self._fail(req, FailureReason.TIMEOUT, f"not arrived within {timeout}s")
        assert req.result is not None
        return req.result

    async def await_settled(self, request_id: str, timeout: float | None = None) -> TransferResult:
        """Wait until ``request_id`` has ended and nothing of it can be written any more;
        return its result then (updated: ``settled=True``; an abort that lost the race with
        the last chunk here becomes the sender's ``SUCCESS``).

        On the receiving side this is when a failed request's pages may be reused:
        its ``Failed`` result alone does not mean that (a WRITE already posted keeps
        copying).  On the sending side a failure is settled once its handles are
        released, which ``await_completion`` already waits for.  ``timeout``: return
        the result as it stands then (``settled`` still False) rather than wait on;
        a sender that hangs (SIGSTOP) settles only when it is killed or resumes.
        Looks at the receiving side first when this service both sent and received
        ``request_id``."""
        side = "recv" if request_id in self._recvs or request_id in self._recvs_done else "send"
        live: RecvRequest | SendRequest | None = self._recvs.get(request_id) if side == "recv" else \
            self._sends.get(request_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        if live is not None:
            with anyio.move_on_after(timeout):
                await live.done.wait()
            if live.result is None:
                return await self._settled_or_unknown(side, request_id)
        result = await self._settled_or_unknown(side, request_id)
        if not result.settled:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            await self._settlement.wait(side, request_id, left)
        return await self._settled_or_unknown(side, request_id)

    async def _settled_or_unknown(self, side: str, request_id: str) -> TransferResult:
        live = self._recvs.get(request_id) if side == "recv" else self._sends.get(request_id)
        result = (live.result if live is not None else None) or \
            (self._recvs_done if side == "recv" else self._sends_done).get(request_id)
        if result is None:
            if live is not None:  # still running: report where it stands
                return make_result(live, TransferStatus.FAILED, reason=FailureReason.TIMEOUT,
                                   message="still in progress when await_settled's timeout passed")
            raise UnknownRequestError(f"unknown request {request_id!r}")
        return result

    def poll_arrival(self, request_id: str) -> KVPoll:
        req = self._recvs.get(request_id)
        if req is not None:
            return req.poll()
        done = self._recvs_done.get(request_id)
        if done is None:
            raise UnknownRequestError(f"unknown request {request_id!r}")
        return done.poll

    # -- either side ---------------------------------------------------------------
    async def abort(self, request_id: str) -> TransferResult | None:
        """Abandon ``request_id`` here and tell the peer.  Returns its result
        (``ABORTED``, or how it had already ended); ``None`` when only a
        not-yet-sent expect was dropped.

        On the receiving side the pages are **not** free when this returns: the
        sender's WRITE may still be landing.  Reuse them after ``await_settled``
        (whose result may also say the abort lost the race: every page landed)."""
        sreq = self._sends.get(request_id)
        rreq = self._recvs.get(request_id)
        early = self._early.pop(request_id) if sreq is None and rreq is None else None
        if early is not None:
            peer, _ = early
            self._dropped.put(request_id, FailureReason.ABORTED)
            self._send_to(peer, Abort(request_id, FailureReason.ABORTED.value, "aborted by sender"))
            return None
        if sreq is not None:
            self._fail(sreq, FailureReason.ABORTED, "aborted locally")
        if rreq is not None:
            self._fail(rreq, FailureReason.ABORTED, "aborted locally")
        if sreq is None and rreq is None:
            done = self._sends_done.get(request_id) or self._recvs_done.get(request_id)
            if done is None:
                raise UnknownRequestError(f"unknown request {request_id!r}")
            return done
        req = sreq or rreq
        assert req is not None
        return req.result

    def status(self) -> dict[str, Any]:
        """A snapshot for operators: counts, peers, loop lag."""
        wd = self._watchdog
        return self.stats.snapshot(
            sending=len(self._sends), receiving=len(self._recvs),
            expects_before_send=len(self._early),
            unsettled_pages=self._settlement.unsettled_pages,
            inflight_handles=wd.inflight if wd else 0,
            live_nixl_handles=wd.live_handles if wd else 0,
            peers=self._control.peer_addresses() if self._control else [],
        )

    # -- state changes (event loop; called by API, watchdog and control plane) ---------
    def _bind(self, req: SendRequest, peer: str, pages: npt.NDArray[np.int32]) -> None:
        if req.pages_queued > pages.size or (req.last and req.pages_queued != pages.size):
            self._fail(req, FailureReason.INCOMPATIBLE,
                       f"sender has {req.pages_queued} pages, receiver expects {pages.size}", peer=peer)
            return
        assert self._control is not None
        remote = self._control.remote_layout(peer)
        if remote is None:  # the peer is gone (its loss fails what was bound to it)
            self._fail(req, FailureReason.PEER_LOST, "receiver lost before the request was bound", peer=peer)
            return
        req.peer = peer
        req.link_generation = self._control.generation_of(peer)
        req.remote_layout = remote
        req.dest = pages
        req.deadline = time.monotonic() + (req.timeout or self.config.transfer_timeout_s)
        self._deadlines.push(req)  # due_at() is now the transfer deadline
        if req.pending:
            self._watchdog.schedule(req)  # type: ignore[union-attr]

    def _finish(self, req: SendRequest | RecvRequest, result: TransferResult) -> None:
        if isinstance(req, RecvRequest) and not result.ok and req.peer is None:
            result = dataclasses.replace(result, settled=True)  # no sender ever had these pages
        req.result = result
        if isinstance(req, SendRequest):
            self._sends.pop(req.request_id, None)
            self._sends_done.put(req.request_id, result)
            if result.ok:
                req.done.set()
            # else: done once the door released every handle of it (released())
            self._watchdog.forget(req)  # type: ignore[union-attr]
        else:
            req.done.set()
            self._recvs.pop(req.request_id, None)
            self._recvs_done.put(req.request_id, result)
            if not result.settled:
                assert req.peer is not None and req.pages is not None
                self._settlement.hold(req.request_id, req.peer, int(req.pages.size))
        side = "send" if isinstance(req, SendRequest) else "recv"
        self.stats.record(side, result)
        if result.ok:
            log.debug("transfer.completed", request_id=req.request_id, side=side, bytes=result.bytes)
        else:
            assert result.reason is not None
            log.warning("transfer.failed", request_id=req.request_id, side=side,
                        peer=req.peer, reason=result.reason.value, message=result.message,
                        error=repr(result.error) if result.error else None)
        if not self._sends and not self._recvs:
            self._idle.set()

    def _fail(self, req: SendRequest | RecvRequest, reason: FailureReason, message: str, *,
              error: BaseException | None = None, from_peer: bool = False, peer: str | None = None) -> None:
        """End ``req`` as Failed and, unless the peer told us, tell the peer."""
        if req.result is not None:
            return
        message = text(message)  # it travels to the peer, whose frames bound text
        target = peer or req.peer
        if not from_peer and target is not None:  # first: a Settled the finish may send follows it
            if isinstance(req, SendRequest):
                self._send_to(target, Failed(req.request_id, reason.value, message))
            else:
                self._send_to(target, Abort(req.request_id, reason.value, message))
        self._finish(req, make_result(req, TransferStatus.FAILED, reason=reason, error=error,
                                      message=message))

    def _send_to(self, agent: str, msg: Message) -> None:
        if self._control is not None:
            self._control.send_to(agent, msg)

    # -- watchdog callbacks (Owner) ---------------------------------------------------
    def chunk_done(self, req: SendRequest, npages: int) -> None:
        req.chunks_done += 1
        req.bytes_done += npages * self._page_bytes
        if req.complete and req.result is None:
            self._finish(req, make_result(req, TransferStatus.SUCCESS, nbytes=req.bytes_done,
                                          pages=req.pages_queued))

    def chunk_failed(self, req: SendRequest, err: DoorError) -> None:
        peer = req.peer
        self._fail(req, err.reason, str(err), error=err.original)
        if err.reason is FailureReason.REMOTE_DISCONNECT and peer is not None and self._control is not None:
            # NIXL keeps a disconnected agent loaded and fails every later post to
            # it; drop the peer now so its other requests fail at once (PEER_LOST)
            # and a reconnect loads it afresh.
            self._control.drop_peer(peer, err.original)

    def on_notifs(self, notifs: Mapping[str, list[bytes]]) -> None:
        for agent, messages in notifs.items():
            for raw in messages:
                n = decode_notif(raw)
                if n is not None and n.chunk == FENCE:
                    self._settlement.settle_recv(n.request_id, agent)
                    continue
                req = self._recvs.get(n.request_id) if n else None
                if n is None or req is None or req.peer != agent:
                    self.stats.stale_notifs += 1
                    continue
                req.chunks_seen += 1
                if n.total:
                    req.total_chunks = n.total
                if req.total_chunks is not None and req.chunks_seen >= req.total_chunks:
                    assert req.pages is not None
                    self._finish(req, make_result(
                        req, TransferStatus.SUCCESS, nbytes=self.layout.bytes_for(req.pages.size),
                        pages=int(req.pages.size)))

    def check_deadlines(self, now: float) -> None:
        for req in self._deadlines.pop_due(now):
            if isinstance(req, RecvRequest):
                why = "arrival deadline passed"
            elif req.peer is None:
                why = f"no expect from a receiver within {self.config.bootstrap_timeout_s}s"
            else:
                why = "transfer deadline passed"
            self._fail(req, FailureReason.TIMEOUT, why)
        for rid, agent in self._early.expire(now):
            self.stats.refuse("unknown_expect_expired")
            self._refuse_expect(agent, rid, FailureReason.TIMEOUT,
                                f"no send() for this request within {self.config.unknown_expect_ttl_s}s")
        live = len(self._sends) + len(self._recvs)
        self._deadlines.compact(itertools.chain(self._sends.values(), self._recvs.values()), live)

    def busy(self) -> bool:
        # Receivers keep the watchdog polling: with NIXL's progress thread off, a
        # sender's WRITE completes only while this side calls into NIXL.
        return bool(self._recvs) or bool(self._sends)

    # -- control-plane callbacks ------------------------------------------------------
    def on_message(self, agent: str, msg: Message) -> None:
        if isinstance(msg, Expect):
            self._on_expect(agent, msg)
        elif isinstance(msg, Abort):
            self._on_peer_abort(agent, msg.request_id, msg.reason, msg.message)
        elif isinstance(msg, Failed):
            rreq = self._recvs.get(msg.request_id)
            if rreq is not None and rreq.peer == agent:
                self._fail(rreq, _reason(msg.reason), f"sender reported: {msg.message}", from_peer=True)
        elif isinstance(msg, Settled):
            self._settlement.settle_recv(msg.request_id, agent, sender_ok=msg.ok)

    def _refuse_expect(self, agent: str, rid: str, reason: FailureReason, message: str) -> None:
        """Tell ``agent`` its Expect for ``rid`` is refused; nothing of ours was or will be
        written there for it, so it is settled too (unless ``rid`` is bound to that agent)."""
        self._send_to(agent, Failed(rid, reason.value, text(message)))
        bound = self._sends.get(rid)
        if bound is None or bound.peer != agent:
            self._send_to(agent, Settled(rid))

    def _on_expect(self, agent: str, msg: Expect) -> None:
        assert self._control is not None
        rid = msg.request_id
        remote = self._control.remote_layout(agent)
        if remote is None:
            return  # its link is being dropped
        try:
            pages = remote.check_pages(msg.pages)
        except ValueError as exc:
            self._refuse_expect(agent, rid, FailureReason.INCOMPATIBLE, str(exc))
            return
        req = self._sends.get(rid)
        if req is not None:
            if req.peer is None:
                if self._receiver_ok(req, agent):
                    self._bind(req, agent, pages)
            else:
                self._refuse_expect(agent, rid, FailureReason.INCOMPATIBLE, "request already bound to a receiver")
        elif rid in self._sends_done:
            done = self._sends_done.get(rid)
            assert done is not None
            self._refuse_expect(agent, rid, done.reason or FailureReason.INCOMPATIBLE,
                                "request already ended on the sender")
        elif rid in self._early:
            self._refuse_expect(agent, rid, FailureReason.INCOMPATIBLE, "duplicate expect")
        elif not self._early.add(rid, agent, pages, time.monotonic()):
            self.stats.refuse("unknown_expect_limit")
            self._refuse_expect(agent, rid, FailureReason.REFUSED, (
                f"too many expects for requests not sent yet (max_unknown_expects = "
                f"{self.config.max_unknown_expects})"))

    def _on_peer_abort(self, agent: str, rid: str, reason: str, message: str) -> None:
        why = _reason(reason)  # the peer's own reason: ABORTED, SHUTDOWN, TIMEOUT, ...
        sreq = self._sends.get(rid)
        if sreq is not None and (sreq.peer == agent or (sreq.peer is None and self._receiver_ok(sreq, agent))):
            # Its release, then a Settled to the receiver, follow (released()).
            self._fail(sreq, why, f"receiver aborted ({reason}): {message}", from_peer=True)
        elif sreq is None:
            # Not live here: ended already (settled once released), or not sent yet (a
            # later send() fails at once).  Either way nothing of it is or will be in flight.
            done = self._sends_done.get(rid)
            if done is None:
                if self._early.peer_of(rid) in (agent, None):
                    self._early.pop(rid)
                    self._dropped.put(rid, why)
                self._send_to(agent, Settled(rid))
            elif done.settled:
                self._send_to(agent, Settled(rid, ok=done.ok))
        rreq = self._recvs.get(rid)
        if rreq is not None and rreq.peer == agent:
            self._fail(rreq, why, f"sender aborted ({reason}): {message}", from_peer=True)

    def on_peer_lost(self, agent: str, address: str, cause: BaseException | None, graceful: bool,
                     gone: bool) -> None:
        reason = FailureReason.SHUTDOWN if graceful else FailureReason.PEER_LOST
        what = "peer shut down" if graceful else f"lost peer {address}: {cause!r}"
        for sreq in [r for r in self._sends.values() if r.peer == agent]:
            self._fail(sreq, reason, what, error=cause, from_peer=True)
        for rreq in [r for r in self._recvs.values() if r.peer == agent]:
            self._fail(rreq, reason, what, error=cause, from_peer=True)
        for rid in self._early.drop_peer(agent):
            self._dropped.put(rid, reason)
        if self._watchdog is not None:
            self._watchdog.forget_fences(agent)  # its unloading releases them
        if gone or self._closing:  # its process is gone / ours is leaving (our pool with it)
            if self._settlement.settle_agent(agent):
                log.info("transfer.settled_by_loss", peer=address, agent=agent,
                         why="NIXL reports its endpoint disconnected" if gone else "this service is leaving")
        elif self._settlement.held_by(agent) and self._tg is not None and not self._closing:
            self._tg.start_soon(self._settle_by_probing, agent, address)

    def on_peer_linked(self, agent: str) -> None:
        """A new link with ``agent`` settles nothing it held: its peer table dropped the
        old link (releasing every handle to us) before admitting this one, but NIXL's
        release does not stop a zero-copy WRITE already under way (measured: a resumed
        SIGSTOPped sender's released WRITE still landed after it re-linked).  What it
        held settles when its process is gone."""

    async def _settle_by_probing(self, agent: str, address: str) -> None:
        """``agent``'s link was lost but not proven gone (hung, or cut off): dial its
        address until that settles what it held (see ``_settle``).  Ends when nothing
        of ``agent`` is held any more, or with the service."""
        assert self._control is not None
        wait = self.config.heartbeat_interval_s
        while self._settlement.held_by(agent) and not self._closing:
            await anyio.sleep(wait)
            wait = min(wait * 2, PROBE_MAX_S)
            try:
                link = await self._control.link_to(address)
            except ConnectionRefusedError:  # nobody listens there any more: the process is gone
                log.info("transfer.settled_by_loss", peer=address, agent=agent, why="its address refuses connections")
                self._settlement.settle_agent(agent)
            except Exception as exc:  # noqa: BLE001 - still unknown (hung, cut off): try again later
                log.debug("peer.settle_probe_failed", agent=agent, address=address, error=repr(exc))
            else:
                if link.agent != agent:  # a new incarnation holds the address: the old one is gone
                    log.info("transfer.settled_by_loss", peer=address, agent=agent, why="a new incarnation holds it")
                    self._settlement.settle_agent(agent)
                    return
                # The same process, alive: keep probing for its exit.

    def released(self, req: SendRequest) -> None:
        """Watchdog: the door released every handle of ``req``.  A failure is settled
        now: its caller may reuse the source pages, and the receiver is told."""
        result = req.result
        if result is None or result.ok or result.settled:
            return
        req.result = self._settlement.settled_send(result)
        req.done.set()
        if req.peer is None:
            return
        # A released handle's bytes may still be on the wire (a TCP stream, a queue
        # pair): the receiver settles on the fence's notification, which NIXL sends only
        # after flushing the endpoint.  Nothing ever posted: nothing to wait for.
        assert self._watchdog is not None and self._control is not None
        if not req.posted:
            self._send_to(req.peer, Settled(req.request_id))
        elif self._control.generation_of(req.peer) == req.link_generation:
            self._watchdog.fence(req)
        # else: its link (and endpoint) is gone: a fence on a newer one proves nothing
        # about the old; the receiver settles when this process is gone

    def released_by_door(self, xids: list[int]) -> None:
        self.stats.forced_releases += len(xids)


def _reason(value: str) -> FailureReason:
    try:
        return FailureReason(value)
    except ValueError:
        return FailureReason.PEER_REPORTED

