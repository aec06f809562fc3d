"""``SidecarClient``: the ``TransferService`` API, served by a sidecar daemon.

Switching an engine from in-process to sidecar is one line::

    svc = TransferService(config)            # in-process: this process owns a NIXL agent
    svc = SidecarClient("/run/kvservice/prefill.sock")   # sidecar: the daemon owns it

Both satisfy ``kvservice.KVTransfer`` (mypy checks it: ``kvservice/_api_check.py``): async
context managers with ``kv`` (the KV pool: here a tensor over the daemon's shared segment,
so ``kv.write`` puts bytes where the daemon sends them from), ``layout``, ``address``,
``agent_name``, ``send``, ``await_completion``, ``expect``, ``decline``, ``await_arrival``,
``await_settled``, ``poll_arrival``, ``abort``, ``status`` and the scheduler's reads
(``expected``, ``expected_pages``, ``expect_dropped``, ``live_peers``), with the same arguments,
errors and ``TransferResult`` values.  Differences, all forced by the process boundary:

* ``TransferResult.error`` is a ``SidecarRemoteError`` naming the original
  exception's class (``type_name``) instead of the exception object itself.
* ``handle.poll()`` and ``poll_arrival(id)`` never block: the state the daemon reported
  with the latest ``send()`` / ``expect()`` (or ``await fetch_poll(handle)`` /
  ``await fetch_poll_arrival(id)``) until the request ends, then ``Success``/``Failed``
  (the daemon's ``Finished`` frame); ``poll_arrival`` knows the ids this client expected.
* ``status()`` (a ``SidecarStatus``: the service's ``ServiceStatus`` and the daemon's
  own) is the snapshot as of the last refresh (``status_interval`` seconds);
  ``await fetch_status()`` asks for a fresh one.
* ``live_peers(role)``, ``expected``, ``expected_pages`` and ``expect_dropped`` each ask the
  daemon (coroutines on both faces: ``kvservice/_api.py``).  ``decline`` and the last three
  need a daemon of sidecar protocol 3, ``send``'s ``receiver=`` and ``expect``'s
  ``verify=`` one of 4, ``expect``'s ``member=`` one of 5: on an older one they raise
  ``KVServiceError`` without sending a frame.
* If the daemon goes away, every unfinished request ends ``Failed`` with
  ``SHUTDOWN`` (it said goodbye) or ``PEER_LOST`` (it vanished), and later calls
  raise ``KVServiceError``.
* A request id belongs to the worker that first sent or expected it: another
  worker's call naming it raises ``NotOwnerError``.

Before it says anything, the client checks who runs the daemon (``SO_PEERCRED``):
this process's own uid, root, or one of ``trusted_uids``; anything else may be
a socket planted by another user, and is refused.  What the daemon then
announces is checked before it is used (the segment's name and owner, the layout).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Collection
from types import TracebackType
from typing import Literal

import anyio
import anyio.abc

from .._api import Pages
from .._control.addresses import split_address
from .._control.protocol import text
from .._results import (
    FailureReason,
    KVPoll,
    KVServiceError,
    TransferResult,
    UnknownRequestError,
)
from .._transfer.requests import check_request_id
from .._trust.peercred import PeerCred
from ..discovery.member import MAX_ROLE_CHARS, Member
from ..memory._layout import KVLayout
from ..memory._pool import KVPool
from .dial import handshake, map_pool
from .handle import RequestState, SidecarHandle
from .link import Lost, WorkerLink
from .shm import Segment
from .status import SidecarStatus
from .wire import (
    MAX_SENDER_CHARS,
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
    Welcome,
    result_from_wire,
)


class SidecarClient:
    """A worker's connection to a ``kvservice serve`` daemon on this host.

    ``async with SidecarClient(socket_path) as svc:`` connects, maps the shared
    KV pool and starts a reader task.  Leaving waits up to ``drain_grace_s`` for
    this worker's unfinished requests, then disconnects; the daemon aborts
    whatever is still unfinished.  ``trusted_uids``: users besides this
    process's own and root that may run the daemon.
    """

    def __init__(
        self, socket_path: str | os.PathLike[str], *, name: str = "", connect_timeout: float = 5.0,
        drain_grace_s: float = 5.0, status_interval: float = 1.0, trusted_uids: Collection[int] = (),
    ) -> None:
        self.socket_path = os.fspath(socket_path)
        self.trusted_uids = frozenset(trusted_uids)
        self.name = name or f"{os.path.basename(sys.argv[0]) or 'python'}:{os.getpid()}"
        self._connect_timeout = connect_timeout
        self._grace = drain_grace_s
        self._status_interval = status_interval
        self._link = WorkerLink(self.socket_path)
        self._segment: Segment | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._status = SidecarStatus()
        self._kv: KVPool | None = None
        self.welcome: Welcome | None = None
        self.layout = KVLayout()
        self.address = ""
        self.agent_name = ""
        self.roles: tuple[str, ...] = ()

    @property
    def connected(self) -> bool:
        """True between a successful ``async with`` entry and the loss (or close) of the connection."""
        return self._link.framed is not None and self._link.lost is None

    async def wait_disconnected(self) -> str:
        """Wait until the connection ends (the daemon shut down or vanished); returns why."""
        if self._link.lost_event is None:
            raise KVServiceError("not connected (use 'async with SidecarClient(...)')")
        await self._link.lost_event.wait()
        return self._link.lost or ""

    @property
    def kv(self) -> KVPool:
        """The daemon's KV pool, mapped into this process."""
        if self._kv is None:
            raise KVServiceError("not connected (use 'async with SidecarClient(...)')")
        return self._kv

    # -- lifetime -------------------------------------------------------------------------
    async def __aenter__(self) -> SidecarClient:
        framed, welcome, daemon = await handshake(self.socket_path, self.name, timeout=self._connect_timeout,
                                                  trusted_uids=self.trusted_uids)
        try:
            self._attach(welcome, daemon)
        except BaseException:
            await framed.aclose()
            raise
        self._link.connected(framed, welcome)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._link.read)
        try:
            await self.fetch_status()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        if self._status_interval > 0:
            self._tg.start_soon(self._refresh_status)
        return self

    def _attach(self, welcome: Welcome, daemon: PeerCred) -> None:
        self.welcome = welcome
        self.layout, self._segment = map_pool(welcome, daemon, self.socket_path)
        assert self._segment.tensor is not None
        self._kv = KVPool(self.layout, self._segment.tensor)
        self.address, self.agent_name, self.roles = welcome.address, welcome.agent, tuple(welcome.roles)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        assert self._tg is not None and self._link.framed is not None
        with anyio.CancelScope(shield=True):
            if exc is None and self._link.lost is None:
                with anyio.move_on_after(self._grace):
                    for req in list(self._link.live.values()):
                        await req.done.wait()
            self._link.on_lost("sidecar client closed", FailureReason.ABORTED)
            await self._link.framed.aclose()
            self._tg.cancel_scope.cancel()
        try:
            await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            self._kv = None
            if self._segment is not None:
                self._segment.close()
        return False

    # -- sending side -----------------------------------------------------------------------
    async def _request_call(
        self, side: str, request_id: str, make: Callable[[int], Call],
    ) -> tuple[RequestState, ServerMessage]:
        """Call the daemon for ``request_id`` (a send or an expect), tracking the request from
        before the call (its Finished frame may overtake the reply); a request this call
        created is forgotten again if the call fails.

        A caller cancelled while it waits for the reply gets what a cancelled call leaves in
        process: nothing going on.  The daemon may have done the call already (one that never
        waits there is done before our ``Cancel`` is read), so the request is aborted too
        (``ABORTED``, its peer told; the ``Abort`` waits up to 1 s for the daemon).  Its pages
        are then the caller's once settled, as for any failed request."""
        key = (side, request_id)
        created = key not in self._link.live
        req = self._link.live.setdefault(key, RequestState(request_id, side))
        try:
            reply = await self._link.call(make)
        except BaseException as exc:
            if created and req.result is None and self._link.live.get(key) is req:
                del self._link.live[key]
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                with anyio.CancelScope(shield=True), anyio.move_on_after(1.0), \
                        contextlib.suppress(KVServiceError):
                    await self._link.call(lambda n: Abort(n, request_id))
            raise
        return req, reply

    async def send(self, request_id: str, pages: Pages, *, last: bool = False,
                   timeout: float | None = None, receiver: str | None = None,
                   layers: range | None = None, payload: bytes | None = None,
                   fit: Literal["tail"] | None = None) -> SidecarHandle:
        """Queue a chunk of ``request_id``'s pages for the receiver (see ``TransferService.send``)."""
        check_request_id(request_id)
        if fit not in (None, "tail"):  # the service's own check, here rather than a round trip later
            raise ValueError(f"fit must be None or 'tail', got {fit!r}")
        if receiver is not None and not (isinstance(receiver, str) and 0 < len(receiver) <= MAX_SENDER_CHARS):
            # the service checks the rest; a longer one would break the frame, and the connection
            raise ValueError(f"receiver must be 'host:port' (or a member's name) of at most {MAX_SENDER_CHARS} "
                             f"characters, got {receiver!r:.80}")
        idx = self.layout.check_pages(pages).tolist()
        if layers is not None and (not isinstance(layers, range) or layers.step != 1):
            raise ValueError(f"layers must be a non-empty range with step 1, got {layers!r}")
        span = (layers.start, layers.stop) if layers is not None else None
        req, reply = await self._request_call(
            "send", request_id, lambda n: Send(n, request_id, idx, last, timeout, span, payload, fit, receiver))
        assert isinstance(reply, SendReply)
        if reply.result is not None:
            self._link.finish(req, result_from_wire(reply.result))
        else:
            req.poll = KVPoll(reply.poll)
        return SidecarHandle(req)

    async def await_completion(self, handle: SidecarHandle, timeout: float | None = None) -> TransferResult:
        """Wait for ``handle``'s request to end; a ``timeout`` that passes first fails it ``TIMEOUT``."""
        req = handle._req
        if req.result is None and timeout is None:
            await req.done.wait()
        if req.result is not None:
            return req.result
        try:
            reply = await self._link.call(lambda n: AwaitCompletion(n, req.request_id, timeout))
        except Lost:
            if req.result is not None:
                return req.result
            raise
        assert isinstance(reply, ResultReply) and reply.result is not None
        self._link.finish(req, result_from_wire(reply.result))
        assert req.result is not None
        return req.result

    # -- receiving side ---------------------------------------------------------------------
    async def expect(self, request_id: str, pages: Pages, *, sender: str,
                     timeout: float | None = None, verify: bool | None = None,
                     member: str | None = None) -> None:
        """Announce that ``request_id`` goes into ``pages`` and tell ``sender`` (see ``TransferService.expect``)."""
        check_request_id(request_id)
        idx = self.layout.check_pages(pages).tolist()
        split_address(sender)  # the service's own check, here rather than a round trip later
        check = None if verify is None else bool(verify)
        req, reply = await self._request_call(
            "recv", request_id, lambda n: Expect(n, request_id, idx, sender, timeout, check, member))
        assert isinstance(reply, Done)
        if reply.poll is not None and req.result is None:
            req.poll = KVPoll(reply.poll)

    async def decline(self, request_id: str, *, sender: str, message: str = "") -> bool:
        """``TransferService.decline`` through the sidecar: ``sender``'s send of ``request_id``
        ends ``ABORTED`` at once; True once the daemon told it, False if it cannot reach it."""
        check_request_id(request_id)
        split_address(sender)  # the service's own check, here rather than a round trip later
        if not isinstance(message, str):
            raise ValueError(f"message must be a str, got {type(message).__name__}")
        message = text(message)  # the service cuts the Abort's text to this anyway
        reply = await self._link.call(lambda n: Decline(n, request_id, sender, message))
        assert isinstance(reply, Declined)
        return reply.queued

    async def await_settled(self, request_id: str, timeout: float | None = None) -> TransferResult:
        """``TransferService.await_settled`` through the sidecar: the result once nothing of
        ``request_id`` can land any more (its pages may be reused), or as it stands when
        ``timeout`` passes (``settled`` still False)."""
        check_request_id(request_id)  # the wire would refuse the frame, and the connection with it
        reply = await self._link.call(lambda n: AwaitSettled(n, request_id, timeout))
        assert isinstance(reply, ResultReply) and reply.result is not None
        return result_from_wire(reply.result)

    async def await_arrival(self, request_id: str, timeout: float | None = None) -> TransferResult:
        """Wait until every page of ``request_id`` has landed, or it failed."""
        check_request_id(request_id)  # the wire would refuse the frame, and the connection with it
        req = self._recv(request_id)
        if req is not None and req.result is None and timeout is None:
            await req.done.wait()
        if req is not None and req.result is not None:
            return req.result
        try:
            reply = await self._link.call(lambda n: AwaitArrival(n, request_id, timeout))
        except Lost:
            if req is not None and req.result is not None:
                return req.result
            raise
        assert isinstance(reply, ResultReply) and reply.result is not None
        result = result_from_wire(reply.result)
        if req is not None:
            self._link.finish(req, result)
        return result

    # -- either side ------------------------------------------------------------------------
    async def abort(self, request_id: str) -> TransferResult | None:
        """Abandon ``request_id`` and tell the peer (see ``TransferService.abort``)."""
        check_request_id(request_id)  # the wire would refuse the frame, and the connection with it
        reply = await self._link.call(lambda n: Abort(n, request_id))
        assert isinstance(reply, ResultReply)
        if reply.result is None:
            return None
        result = result_from_wire(reply.result)
        req = self._link.live.get(("send", request_id)) or self._link.live.get(("recv", request_id))
        if req is not None:
            self._link.finish(req, result)
        return result

    async def fetch_poll(self, handle: SidecarHandle) -> KVPoll:
        """The request's state in the daemon now (``handle.poll()`` then agrees until it changes)."""
        req = handle._req
        if req.result is None:
            reply = await self._link.call(lambda n: Poll(n, req.request_id, "send"))
            assert isinstance(reply, PollReply)
            if req.result is None:
                req.poll = KVPoll(reply.poll)
        return handle.poll()

    def poll_arrival(self, request_id: str) -> KVPoll:
        """Where ``request_id``'s arrival stands, as the daemon last said (see the module's
        notes); never blocks.  ``UnknownRequestError`` for an id this client did not expect
        (or one older than the daemon's ``results_kept`` most recent)."""
        req = self._recv(request_id)
        if req is None:
            raise UnknownRequestError(f"unknown request {request_id!r} (not expected through this client)")
        return req.poll if req.result is None else req.result.poll

    async def fetch_poll_arrival(self, request_id: str) -> KVPoll:
        """The arrival's state in the daemon now (``poll_arrival`` then agrees until it changes)."""
        check_request_id(request_id)  # the wire would refuse the frame, and the connection with it
        req = self._recv(request_id)
        if req is not None and req.result is not None:
            return req.result.poll
        reply = await self._link.call(lambda n: Poll(n, request_id, "recv"))
        assert isinstance(reply, PollReply)
        if req is not None and req.result is None:
            req.poll = KVPoll(reply.poll)
        return KVPoll(reply.poll)

    def _recv(self, request_id: str) -> RequestState | None:
        key = ("recv", request_id)
        return self._link.live.get(key) or self._link.done.get(key)

    # ``TransferService.expected``, ``expected_pages`` and ``expect_dropped``: the early
    # expects live in the daemon (one ``Expected`` call answers all three)
    async def expected(self, request_id: str) -> bool:
        return (await self._expected(request_id)).expected

    async def expected_pages(self, request_id: str) -> int | None:
        return (await self._expected(request_id)).pages

    async def expect_dropped(self, request_id: str) -> tuple[FailureReason, str] | None:
        dropped = (await self._expected(request_id)).dropped
        return None if dropped is None else (FailureReason(dropped[0]), dropped[1])

    async def _expected(self, request_id: str) -> ExpectedReply:
        check_request_id(request_id)  # the wire would refuse the frame, and the connection with it
        reply = await self._link.call(lambda n: Expected(n, request_id))
        assert isinstance(reply, ExpectedReply)
        return reply

    def status(self) -> SidecarStatus:
        """The daemon's status as of the last refresh (see ``fetch_status``)."""
        return self._status

    async def fetch_status(self) -> SidecarStatus:
        """The daemon's status now (``status()`` then answers it until the next refresh)."""
        reply = await self._link.call(lambda n: Status(n))
        assert isinstance(reply, StatusReply)
        self._status = SidecarStatus.from_mapping(reply.status)
        return self._status

    async def live_peers(self, role: str | None = None) -> list[Member]:
        """``TransferService.live_peers``: the daemon's discovery
        knows the cluster's live members (not the daemon itself); ``role`` filters.
        Empty with static discovery."""
        if role is not None and len(role) > MAX_ROLE_CHARS:
            return []  # no member has such a role (and the wire would refuse the frame)
        reply = await self._link.call(lambda n: LivePeers(n, role))
        assert isinstance(reply, PeersReply)
        return reply.members

    async def _refresh_status(self) -> None:
        while self._link.lost is None:
            await anyio.sleep(self._status_interval)
            try:
                await self.fetch_status()
            except KVServiceError:
                return

