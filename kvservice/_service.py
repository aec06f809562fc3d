"""``TransferService``: the public API and the service's lifetime.

It checks arguments, resolves names, and owns the lifetime (``async with``): entering
creates the NIXL agent (``_nixl``), registers the KV memory and builds the request
plane (``_transfer.RequestPlane``), which builds the watchdog and the control plane;
every request operation is handed to that plane.  Everything here runs on the event
loop; NIXL is reached only through the door, on the ``DoorThread``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.abc

from ._api import EarlyExpect, Pages
from ._config import ServiceConfig
from ._control.addresses import split_address
from ._control.peers import LocalPeer
from ._control.protocol import Join
from ._control.transport import Transport
from ._log import get_logger
from ._metrics import ServiceCollector
from ._nixl.door import Door, DoorThread
from ._peertimes import PeerTimes
from ._results import ConfigError, FailureReason, KVPoll, KVServiceError, TransferResult, UnknownRequestError
from ._stats import RequestCounts, ServiceStatus, Stats
from ._transfer import waits
from ._transfer.inbound import Inbound
from ._transfer.landing import refusal as landing_refusal
from ._transfer.plane import RequestPlane
from ._transfer.requests import RecvRequest, TransferHandle, check_request_id
from ._transfer.staging import Stager, staging_for
from ._trust.vetting import MetadataVetter
from .discovery.attach import Discovery, PeerUnknown
from .discovery.member import Member
from .memory._pool import KVPool
from .memory._regions import KVMemory, memory_to_wire, regions_table

log = get_logger("kvservice")

DoorFactory = Callable[[str, ServiceConfig], Door]


def _nixl_door(agent_name: str, config: ServiceConfig) -> Door:
    from ._nixl.agent import NixlDoor

    return NixlDoor(agent_name, progress_thread=config.progress_thread, ucx_env=config.ucx_environment)


class TransferService:
    """Moves KV pages between services over NIXL; every transfer ends as a result.
    ``SidecarClient`` offers the same API through a sidecar daemon (``kvservice.KVTransfer``).

    Use as ``async with TransferService(config) as svc:``.  Entering creates the
    NIXL agent, registers the pool and starts the control listener and the
    watchdog; leaving drains in-flight work for ``drain_grace_s`` and fails the
    rest with ``SHUTDOWN``.
    """

    def __init__(
        self, config: ServiceConfig | None = None, *, pool: Any = None, memory: KVMemory | None = None,
        door_factory: DoorFactory | None = None,
        thread_factory: Callable[[], DoorThread] = DoorThread, transport: Transport | None = None,
    ) -> None:
        """``memory``: the engine's own KV (``kvservice.memory``: ``sglang_mha``,
        ``vllm_blocks``, ``mla``, ...), registered as it is.  Without it the service
        allocates its own pool shaped by ``config.layout`` (``pool``: a tensor of that
        shape to use instead), available as ``kv``."""
        self.config = config or ServiceConfig()
        if memory is not None and pool is not None:
            raise ConfigError("memory= and pool= are exclusive: memory describes the engine's KV itself")
        if memory is not None and not isinstance(memory, KVMemory):
            raise ConfigError(f"memory: expected a kvservice.memory.KVMemory, got {type(memory).__name__}")
        self.layout = self.config.layout
        self._memory = memory
        self._pool_tensor = pool
        self._kv: KVPool | None = None
        self.agent_name = f"{self.config.agent_base}-{uuid.uuid4().hex[:12]}"
        self._door_factory = door_factory or _nixl_door
        self._thread_factory = thread_factory  # the simulation (tests/sim) runs door calls inline
        self._transport = transport  # None: TCP; the simulation's is in memory
        self._thread: DoorThread | None = None
        self._door: Door | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._vetter: MetadataVetter | None = None
        self._plane: RequestPlane | None = None  # built once the door and the memory are
        self._discovery: Discovery | None = None  # discovery = "etcd"
        self.stats = Stats(peers=PeerTimes(self.config.metrics_peer_labels))
        self.address = ""

    @property
    def kv(self) -> KVPool:
        """The service's own KV pool (once the service has started; not with ``memory=``)."""
        if self._kv is None:
            if self._memory is not None:
                raise KVServiceError("this service moves the engine's memory (memory=); it has no pool of its own")
            raise KVServiceError("the KV pool exists once the service has started ('async with')")
        return self._kv

    @property
    def memory(self) -> KVMemory:
        """The KV memory this service registers and moves pages of (once started, or
        from the start when given as ``memory=``)."""
        if self._memory is None:
            raise KVServiceError("the KV memory exists once the service has started ('async with')")
        return self._memory

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
                if self._plane is not None:
                    await self._plane.control.close_listeners()
            raise
        return self

    async def _start(self) -> None:
        assert self._tg is not None
        cfg = self.config
        self._thread = self._thread_factory()
        # First, before seconds of allocation: a key that cannot be had is a ConfigError.
        source = await self._thread.call(cfg.resolve_key)
        key = source.key
        log.info("service.key", source=source.source, path=source.path)
        if key is None:
            log.warning("service.unauthenticated", host=cfg.host,
                        detail="allow_unauthenticated: anyone who reaches this port "
                               f"({'any local user' if cfg.loopback_only else 'any host'}) can peer with it")
        # Allocating (and touching) a multi-GB pool takes seconds: not on the loop, but on the
        # door thread, idle until the door exists (and inline, in virtual time, in the simulation).
        if self._memory is None:
            self._kv = await self._thread.call(KVPool, self.layout, self._pool_tensor)
            self._memory = self._kv.memory
        # The vetting child boots (~0.3 s of CPU) while the agent is made and the pool registered,
        # so a peer's first handshake waits for less of it (_trust/vetting.py).  Not while the pool
        # is allocated: the one worker crash seen in a test run (SIGSEGV, once in thousands of
        # service starts) had the door thread in the pool's torch.zeros and another thread in this
        # child's spawn (vfork); not reproduced since, so that pairing is avoided, not proven.
        # The port does not wait for the boot: every service start would then take it (seconds on
        # a busy machine).  Only NIXL's door loads peers' metadata into NIXL; the fake door's is
        # not NIXL's.
        if self._door_factory is _nixl_door:
            self._vetter = MetadataVetter(self._tg, cfg.ucx_environment, agent_prefix=cfg.agent_prefix)
            self._vetter.start()
        memory = self._memory
        self._door = await self._thread.call(self._door_factory, self.agent_name, cfg)
        table = await self._thread.call(regions_table, memory.regions, memory.num_pages)
        staging = await self._thread.call(staging_for, memory, cfg.staging_bytes, self.stats.staging)
        segments = memory.segments + ((staging.segment,) if staging is not None else ())
        await self._thread.call(self._door.register, segments, memory.mem_type, table)
        metadata = await self._thread.call(self._door.metadata)
        wire = memory_to_wire(memory, (staging.area.addr, staging.area.nbytes) if staging is not None else (0, 0))
        local = LocalPeer(self.agent_name, memory, Join(metadata=metadata, memory=wire), key,
                          staging.area if staging is not None else None)
        plane = self._plane = RequestPlane(
            cfg, self.stats, self._tg, self._thread, self._door, local, Stager(staging, cfg.max_live_requests),
            Inbound, transport=self._transport, vetter=self._vetter)
        self.address = await plane.control.listen()
        await self._tg.start(plane.watchdog.run)
        await self._tg.start(self.stats.monitor_loop_lag, plane.moving)
        if cfg.discovery == "etcd":
            self._discovery = Discovery(cfg.discovery_settings, self.stats, agent=self.agent_name, address=self.address,
                                        memory=memory, load=self._load, drop=plane.drop_agent,
                                        identity=await self._thread.call(cfg.identity),
                                        allow_unsigned=cfg.allow_peers_without_identity)
            plane.control.rotation_listeners.append(self._discovery.registry.rotated)
            await self._discovery.start(self._tg)
        log.info("service.started", address=self.address, agent=self.agent_name,
                 kv_bytes=memory.nbytes, regions=len(memory.regions), authenticated=key is not None)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        assert self._tg is not None and self._plane is not None
        plane = self._plane
        plane.closing = True
        grace = self.config.drain_grace_s if exc is None else 0.0
        with anyio.CancelScope(shield=True):
            # New peers are refused (Reject "shutting_down") but the port stays open until
            # our NIXL agent is closed: a peer that finds it refusing connections may take
            # us for gone (what it holds of ours settles then).
            plane.control.refuse_new_peers()
            await plane.drain(grace)  # the last releases (and what they settle), before the Bye
            await plane.control.close_all(timeout=1.0)
            if self._discovery is not None:
                await self._discovery.registry.leave()
            self._tg.cancel_scope.cancel()
        try:
            await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            self._close_door()
            # Only now does the port close: a peer that finds it refusing may take our
            # agent for gone, and it is (docs/settle.md).
            await plane.control.close_listeners()
            # Our NIXL agent (and its registration of the pool) is gone: nothing can land in
            # the pool any more, whatever a lost or hung sender still held.
            plane.settlement.settle_all()
            log.info("service.stopped", address=self.address)
        return False

    def _close_door(self) -> None:
        if self._thread is not None:
            if self._door is not None:
                self._thread.call_sync(self._door.close)
            self._thread.shutdown()
            self._thread = None

    def _running(self) -> RequestPlane:
        """The plane, for a call that starts work: refused before start and once closing."""
        plane = self._plane
        if plane is None or self._tg is None:
            raise KVServiceError("service is not running (use 'async with TransferService(...)')")
        if plane.closing:
            raise KVServiceError("service is shutting down")
        return plane

    def _started(self, request_id: str) -> RequestPlane:
        """The plane, for a call about a request (answered after the service has closed too)."""
        if self._plane is None:
            raise UnknownRequestError(f"unknown request {request_id!r} (the service has not started)")
        return self._plane

    def _load(self) -> tuple[int, int]:
        """(peers linked, requests in flight): what discovery registers of this service's load."""
        plane = self._plane
        return (0, 0) if plane is None else (len(plane.control.peer_addresses()), len(plane.sends) + len(plane.recvs))

    # -- sending side -------------------------------------------------------------
    async def send(self, request_id: str, pages: Pages, *, last: bool = False,
                   timeout: float | None = None, receiver: str | None = None,
                   layers: range | None = None, payload: bytes | None = None,
                   fit: Literal["tail"] | None = None) -> TransferHandle:
        """Queue a chunk of ``request_id``'s pages for the receiver; never waits for the copy.

        ``timeout`` (seconds, default ``transfer_timeout_s``) bounds the whole
        request from the moment its destination is known.  ``receiver``
        ("host:port", on the first chunk) pins the request to that decode: an
        Expect for it from any other peer is refused (``REFUSED`` there) and
        counted.  Without it the first Expect for the id binds it.  With etcd
        discovery it may be a member's name; a name no live member has fails
        the request ``PEER_LOST`` at once, as ``expect(sender=)`` does.

        ``layers`` (a ``range``; default all) sends only those layers of the pages,
        so a prefill can send each layer as its forward pass produces it.  Each
        layer keeps its own position in the request: a call's pages go to the
        receiver's pages from that position on, so every (page, layer) is sent
        exactly once; the call with ``last=True`` must leave every layer at the
        receiver's page count.  ``payload`` (with ``last=True``; at most
        ``max_payload_bytes``) reaches the receiver's result with its success.

        ``fit="tail"`` (with a request's only chunk: whole pages, ``last=True``) says
        "these are all the pages I have": a receiver that reserved fewer, ``n``, gets
        the last ``n`` (it had the first ones already, e.g. in its prefix cache), fitted
        when its Expect binds the request, so the sender need not wait for the Expect to
        know how many to send.  A receiver that reserved more fails it ``INCOMPATIBLE``.
        """
        plane = self._running()
        check_request_id(request_id)
        if fit not in (None, "tail"):
            raise ValueError(f"fit must be None or 'tail', got {fit!r}")
        memory = self.memory
        src = memory.check_pages(pages)
        lo, hi = memory.check_layers(layers)
        if payload is not None:
            if not isinstance(payload, bytes):
                raise ValueError(f"payload must be bytes, got {type(payload).__name__}")
            if not last:
                raise ValueError("payload goes with the last chunk (last=True)")
            if len(payload) > self.config.max_payload_bytes:
                raise ValueError(f"payload of {len(payload)} bytes exceeds max_payload_bytes "
                                 f"({self.config.max_payload_bytes})")
        pinned: str | None = None
        member: str | None = None
        unknown: PeerUnknown | None = None
        if receiver is not None:
            if plane.sent_before(request_id):
                raise ValueError(f"request {request_id!r}: receiver= goes with the first chunk only")
            if self._discovery is not None:  # a member's name: where it registered
                try:
                    receiver, member = self._discovery.resolve(receiver)
                except PeerUnknown as exc:  # as expect(sender=): the request fails PEER_LOST
                    unknown = exc
            if unknown is None:
                pinned = await plane.control.canonical(receiver)  # ValueError when malformed
                if member is not None:  # the name is bound to the member that proves it (_control.named)
                    plane.control.name_member(pinned, member)
            self._running()
        return TransferHandle(plane.send(request_id, src, lo, hi, last=last, timeout=timeout, pinned=pinned,
                                         unknown=unknown, payload=payload, fit_tail=fit == "tail",
                                         member=member))

    async def await_completion(self, handle: TransferHandle, timeout: float | None = None) -> TransferResult:
        """Wait for the request behind ``handle`` to end.

        If ``timeout`` passes first the request is failed with ``TIMEOUT`` (its
        handles released, the receiver told) and that result is returned.  If the
        *caller* is cancelled, the cancellation propagates and the transfer goes
        on; ``abort()`` stops it.

        A failed result is returned once it is settled (``result.settled``): nothing
        of it is being posted, and a WRITE of it still in flight (let go when it
        failed, checked until it ends) has ended, or its receiver has failed the
        request (it answered, or its link was lost): from then on nothing read from
        the source pages can complete anything, and they may be reused.
        """
        plane = self._started(handle.request_id)
        return await waits.await_done(plane, handle._req, timeout,
                                      f"not complete within await_completion timeout {timeout}s")

    def completion_future(self, handle: TransferHandle) -> asyncio.Future[TransferResult]:
        """``await_completion(handle)`` without a timeout, as a future of the running loop
        (call it on the service's loop): for a caller with thousands of requests in flight
        that adds a done callback instead of keeping a task per request (the engine facade:
        a waiting task is seven objects the cyclic GC walks, a future and its callback two).
        Cancelling the future cancels only the future; the transfer goes on."""
        self._started(handle.request_id)
        return waits.ended_future(handle._req)

    # -- receiving side -------------------------------------------------------------
    async def expect(self, request_id: str, pages: Pages, *, sender: str,
                     timeout: float | None = None, verify: bool | None = None,
                     member: str | None = None) -> None:
        """Announce that ``request_id`` goes into ``pages``, and tell ``sender``.

        ``verify``: check the landing (None: the service's ``verify_landing``): the
        sender sends a CRC32C of each chunk's bytes, and the request succeeds only if
        its pages match them (else ``CORRUPTED``; ``INCOMPATIBLE`` if the sender sends
        none).  Host memory only: ``ValueError`` when this service's KV is in VRAM.

        ``member`` (with a member identity): the member a registry vouched for at
        ``sender`` (an SGLang rank's); as for a member's name given as ``sender``, the
        request fails ``REFUSED`` unless the service answering there proves that member.

        Returns once the request is registered here and its Expect is queued on
        the link to the sender (dialled first if needed), or once the request
        has failed (e.g. ``PEER_LOST`` when the sender cannot be reached; see
        ``await_arrival``).  If this process dies before the Expect is written,
        the sender never hears of the request and its ``send`` ends ``TIMEOUT``
        at its bootstrap deadline.

        Why there is no delivery receipt: the link is one TCP stream, so a queued
        Expect is delivered in order unless the link dies first, and then the
        request fails here (``PEER_LOST``) and the sender fails whatever it bound
        to this service; a receipt would add a frame per request to say what the
        link's loss already says.  ``poll_arrival`` moves on from
        ``WaitingForInput`` when the first chunk lands; a sender that refuses the
        Expect answers ``Failed`` (with its reason) at once.
        """
        plane = self._running()
        check_request_id(request_id)
        dst = self.memory.check_pages(pages)
        verify = self.config.verify_landing if verify is None else verify
        if verify and (why := landing_refusal(self.memory)) is not None:
            raise ValueError(f"expect(verify=True): {why}")
        if request_id in plane.recvs or request_id in plane.recvs_done:
            raise ValueError(f"request {request_id!r} is already expected (duplicate request id)")
        unknown: PeerUnknown | None = None
        if self._discovery is not None:  # a member's name: where it registered
            try:
                sender, named = self._discovery.resolve(sender)
                member = member or named
            except PeerUnknown as exc:
                unknown = exc
        if unknown is None:
            split_address(sender)  # ValueError naming the problem
            if member is not None:  # the name is bound to the member that proves it (_control.named)
                with contextlib.suppress(OSError):  # a name that does not resolve fails in the dial
                    plane.control.name_member(await plane.control.canonical(sender), member)
        await plane.expect(request_id, sender, dst, timeout, unknown, verify)

    async def decline(self, request_id: str, *, sender: str, message: str = "") -> bool:
        """Tell ``sender`` that this service will not expect ``request_id``: it needs none
        of it (a decode whose prefix cache already holds every page).  The sender's send of
        it ends ``Failed(ABORTED)`` at once (or at its ``send()``, if not made yet) and its
        pages are the sender's again, instead of waiting out ``bootstrap_timeout_s``.
        Nothing is reserved here.

        On the wire this is the ``Abort`` a receiver sends for a request it gave up: an
        unbound send takes it from the first peer to speak of it (a send pinned to another
        receiver ignores it and counts a foreign request).  Returns True once the Abort is
        queued on the link to ``sender`` (dialled first if needed), False when ``sender``
        cannot be reached (logged: its send ends at its own deadline, as for a receiver that
        never came).  ``ValueError`` while this service expects ``request_id`` itself
        (``abort()`` it)."""
        plane = self._running()
        check_request_id(request_id)
        if request_id in plane.recvs:
            raise ValueError(f"request {request_id!r} is expected here: abort() it instead")
        if self._discovery is not None:  # a member's name: where it registered
            sender, _ = self._discovery.resolve(sender)
        split_address(sender)  # ValueError naming the problem
        return await plane.decline(request_id, sender, message)

    async def await_arrival(self, request_id: str, timeout: float | None = None) -> TransferResult:
        """Wait until every page of ``request_id`` has landed, or it failed.

        A ``timeout`` that passes first fails the request with ``TIMEOUT`` and
        tells the sender to stop.  A failed result does not free the pages: a
        WRITE already posted may still land in them.  Reuse them only once
        ``await_settled`` says so (``result.settled``); a success is settled.
        """
        plane = self._started(request_id)
        found = waits.arrival(plane, request_id)
        if isinstance(found, RecvRequest):
            return await waits.await_done(plane, found, timeout, f"not arrived within {timeout}s")
        return found

    def arrival_future(self, request_id: str) -> asyncio.Future[TransferResult]:
        """``await_arrival(request_id)`` without a timeout, as a future of the running loop
        (see ``completion_future``)."""
        return waits.ended_future(waits.arrival(self._started(request_id), request_id))

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
        return await waits.await_settled(self._started(request_id), request_id, timeout)

    def poll_arrival(self, request_id: str) -> KVPoll:
        """Where ``request_id``'s arrival stands (``KVPoll``); never blocks."""
        found = waits.arrival(self._started(request_id), request_id)
        return found.poll() if isinstance(found, RecvRequest) else found.poll

    # -- the scheduler's reads: in KVTransfer, coroutines on both faces (docs/api.md) ---
    async def expected(self, request_id: str) -> bool:
        """Whether a receiver's expect for ``request_id`` is here, held for the first
        ``send()``: a scheduler that computes a request only once its receiver is ready
        (SGLang's prefill) polls this.  Returns at once (a thread: ``early_expect``)."""
        return early_expect(self, request_id).expected

    async def expected_pages(self, request_id: str) -> int | None:
        """How many pages the receiver that will bind ``request_id`` reserved, while its
        expect waits here for the first ``send()``; None before any expect.  A sender that
        may send fewer pages than it holds (the receiver had the rest cached: vLLM's prefix
        cache) reads it before sending.  Returns at once."""
        return early_expect(self, request_id).pages

    async def expect_dropped(self, request_id: str) -> tuple[FailureReason, str] | None:
        """Whether a receiver's expect for ``request_id`` came and was dropped before any
        ``send()`` (its peer was lost, it timed out or aborted): then (the reason a ``send()``
        now fails with at once, whose expect it was); else None.  Returns at once."""
        return early_expect(self, request_id).dropped

    # -- either side ---------------------------------------------------------------
    def remembers(self, request_id: str) -> bool:
        """Whether anything of ``request_id`` is still here: a live request on either
        side, either side's result (among the ``results_kept`` most recent of its side),
        or an expect dropped before its send (the failure that send will get).  The
        sidecar keeps a worker's ownership of an id exactly this long."""
        return self._plane is not None and self._plane.remembers(request_id)

    async def abort(self, request_id: str) -> TransferResult | None:
        """Abandon ``request_id`` here and tell the peer.  Returns its result
        (``ABORTED``, or how it had already ended); ``None`` when only a
        not-yet-sent expect was dropped.

        On the receiving side the pages are **not** free when this returns: the
        sender's WRITE may still be landing.  Reuse them after ``await_settled``.
        Either side's abort can lose the race with the last chunk: then the
        settled result (``await_settled``; on the sender also ``await_completion``)
        is the SUCCESS both sides agree on, not the ``ABORTED`` returned here."""
        return self._started(request_id).abort(request_id)

    @functools.cached_property
    def metrics(self) -> ServiceCollector:
        """This service's Prometheus metrics, read at each scrape (nothing on the transfer
        path updates them): ``registry.register(svc.metrics)`` once (see ``_metrics``)."""
        return ServiceCollector(self)

    def status(self) -> ServiceStatus:
        """A snapshot for operators: counts, peers, loop lag (see ``ServiceStatus``)."""
        plane = self._plane
        discovery = self._discovery.registry.status() if self._discovery is not None else None
        if plane is None:
            return self.stats.snapshot(RequestCounts(
                sending=0, receiving=0, expects_before_send=0, unsettled_pages=0, inflight_handles=0,
                live_nixl_handles=0, staging_held_bytes=0), [], {}, discovery)
        wd = plane.watchdog
        return self.stats.snapshot(RequestCounts(
            sending=len(plane.sends), receiving=len(plane.recvs), expects_before_send=len(plane.early),
            unsettled_pages=plane.settlement.unsettled_pages, inflight_handles=wd.inflight,
            live_nixl_handles=wd.live_handles, staging_held_bytes=wd.staging_held,
        ), plane.control.peer_addresses(), plane.control.peer_versions(), discovery)

    # -- discovery (discovery = "etcd"; kvservice.discovery) ---------------------------
    async def live_peers(self, role: str | None = None) -> list[Member]:
        """The cluster's live members (not this service), by name; ``role`` filters.
        Empty with static discovery.  Returns at once."""
        return self._discovery.registry.live(role) if self._discovery is not None else []


def expect_waits(svc: TransferService, sender: str) -> bool:
    """Whether ``svc.expect(..., sender=sender)`` may wait (a dial, a name to resolve, a claim
    to prove); False where it ends in the caller's turn: registered and its Expect queued on
    a live link, or refused at once.  For the sidecar daemon, which runs such an expect in
    its reader rather than in a task; off the public object as ``early_expect`` is."""
    plane = svc._plane
    if plane is None:
        return False  # refused at once: not running
    if svc._discovery is not None:  # a member's name: where it registered
        try:
            sender, _ = svc._discovery.resolve(sender)
        except PeerUnknown:
            return False  # fails at once (PEER_LOST)
    return not plane.control.linked_now(sender)


def early_expect(svc: TransferService, request_id: str) -> EarlyExpect:
    """``expected``, ``expected_pages`` and ``expect_dropped`` of ``svc`` at once, as plain
    reads: never blocking, safe from another thread.  For the engine facade (a scheduler's
    thread) and the sidecar daemon; off the public object on purpose (docs/api.md)."""
    plane = svc._plane
    if plane is None:
        return EarlyExpect(False, None, None)
    pages = plane.matching.early_pages(request_id)
    return EarlyExpect(bool(plane.early.agents(request_id)), None if pages is None else int(pages.size),
                       plane.matching.dropped_expect(request_id))
