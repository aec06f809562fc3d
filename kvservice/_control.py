"""The control plane: listener, dialing, handshake, and the table of live peers.

A peer is known by its agent name (unique per service instance) and by the
control address it advertises.  A Hello from an address we already know under
another agent name means the peer restarted: the old incarnation is dropped
(its requests fail ``PEER_LOST``, its NIXL agent is unloaded), then the new
one is loaded with fresh metadata and descriptor lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import structlog

from ._door import Door, DoorError, DoorThread
from ._layout import KVLayout
from ._peers import CONNECTION_ERRORS, FramedStream, PeerLink, control_stream, dial, split_address
from ._protocol import PROTOCOL_VERSION, FrameError, Hello, Message, Reject
from ._results import FailureReason, ProtocolError

if TYPE_CHECKING:
    from ._service import TransferService

log = structlog.get_logger("kvservice.control")

HANDSHAKE_ERRORS: tuple[type[BaseException], ...] = (
    *CONNECTION_ERRORS, FrameError, ProtocolError, TimeoutError, DoorError,
)


@dataclass
class _Dial:
    done: anyio.Event = field(default_factory=anyio.Event)
    link: PeerLink | None = None
    error: BaseException | None = None


class ControlPlane:
    def __init__(
        self, service: TransferService, thread: DoorThread, door: Door, metadata: bytes,
        tg: anyio.abc.TaskGroup,
    ) -> None:
        self._svc = service
        self._cfg = service.config
        self._thread = thread
        self._door = door
        self._metadata = metadata
        self._tg = tg
        self._links: dict[str, PeerLink] = {}  # agent -> link
        self._by_addr: dict[str, str] = {}  # address -> agent
        self._layouts: dict[str, KVLayout] = {}  # agent -> its pool layout
        self._dials: dict[str, _Dial] = {}
        self._listen_scope = anyio.CancelScope()
        self._hello: Hello | None = None

    # -- listening ---------------------------------------------------------------
    async def listen(self) -> str:
        cfg = self._cfg
        listener = await anyio.create_tcp_listener(local_host=cfg.host, local_port=cfg.port)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        address = f"{cfg.advertise_host or cfg.host}:{port}"
        kv = self._svc.kv
        self._hello = Hello(
            version=PROTOCOL_VERSION, agent=self._svc.agent_name, address=address,
            metadata=self._metadata, layout=dict(kv.layout.wire_shape()),
            num_pages=kv.layout.num_pages, base_addr=kv.base_addr, device_id=kv.device_id,
        )
        self._tg.start_soon(self._serve, listener)
        return address

    async def _serve(self, listener: anyio.abc.Listener[Any]) -> None:
        with self._listen_scope:
            async with listener:
                await listener.serve(self._accept, task_group=self._tg)

    def stop_listening(self) -> None:
        self._listen_scope.cancel()

    async def _accept(self, stream: anyio.abc.ByteStream) -> None:
        framed = control_stream(stream, self._cfg.max_frame_bytes)
        try:
            with anyio.fail_after(self._cfg.connect_timeout_s):
                hello = await framed.recv()
                if not isinstance(hello, Hello):
                    raise FrameError(f"expected hello, got {type(hello).__name__}")
                problem = self._check_hello(hello)
                if problem is not None:
                    await framed.send(Reject(problem))
                    raise ProtocolError(problem)
                await self._load_peer(hello)
                assert self._hello is not None
                await framed.send(self._hello)
        except HANDSHAKE_ERRORS as exc:
            log.warning("peer.handshake_failed", side="accept", error=repr(exc))
            await framed.aclose()
            return
        await self._make_link(framed, hello).run()

    # -- dialing -------------------------------------------------------------------
    def check_address(self, address: str) -> None:
        split_address(address)

    async def link_to(self, address: str) -> PeerLink:
        """The live link to ``address``, dialling once however many callers wait."""
        agent = self._by_addr.get(address)
        if agent is not None and not self._links[agent].closed:
            return self._links[agent]
        attempt = self._dials.get(address)
        if attempt is None:
            attempt = self._dials[address] = _Dial()
            self._tg.start_soon(self._dial, address, attempt)
        await attempt.done.wait()
        if attempt.error is not None:
            raise attempt.error
        assert attempt.link is not None
        return attempt.link

    async def _dial(self, address: str, attempt: _Dial) -> None:
        assert self._hello is not None
        try:
            try:
                framed, reply = await dial(address, self._hello, timeout=self._cfg.connect_timeout_s,
                                           max_frame_bytes=self._cfg.max_frame_bytes)
            except TimeoutError as exc:
                raise TimeoutError(f"connecting to {address} timed out") from exc
            try:
                if isinstance(reply, Reject):
                    raise ProtocolError(f"{address} refused us: {reply.message}")
                if not isinstance(reply, Hello):
                    raise ProtocolError(f"{address} answered {type(reply).__name__}, not hello")
                problem = self._check_hello(reply)
                if problem is not None:
                    raise ProtocolError(problem)
                await self._load_peer(reply)
            except BaseException:
                await framed.aclose()
                raise
        except Exception as exc:  # noqa: BLE001 - handed to every waiter, classified there
            attempt.error = exc
            log.warning("peer.dial_failed", address=address, error=repr(exc))
            return
        finally:
            self._dials.pop(address, None)
            if attempt.error is not None:
                attempt.done.set()
        link = self._make_link(framed, reply)
        attempt.link = link
        attempt.done.set()
        await link.run()

    def dial_failure(self, exc: BaseException) -> FailureReason:
        if isinstance(exc, ProtocolError):
            return FailureReason.INCOMPATIBLE
        if isinstance(exc, DoorError):
            return exc.reason
        return FailureReason.PEER_LOST

    # -- the handshake ---------------------------------------------------------------
    def _check_hello(self, hello: Hello) -> str | None:
        if hello.version != PROTOCOL_VERSION:
            return f"protocol version {hello.version}, this service speaks {PROTOCOL_VERSION}"
        if hello.agent == self._svc.agent_name:
            return "a service cannot peer with itself"
        try:
            theirs = KVLayout(num_pages=hello.num_pages, **hello.layout)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            return f"invalid layout: {exc}"
        why = self._svc.layout.compatible_with(theirs)
        return None if why is None else f"incompatible KV layout: {why}"

    async def _load_peer(self, hello: Hello) -> None:
        old = self._by_addr.get(hello.address)
        if old is not None and old != hello.agent:
            log.info("peer.restarted", address=hello.address, old_agent=old, agent=hello.agent)
            await self._drop(old, ConnectionResetError("peer restarted"), graceful=False)
        if hello.agent in self._layouts and hello.agent in self._links:
            # A second connection from the same live incarnation: already loaded.  Loading
            # it again would release its in-flight handles under the watchdog.
            return
        layout = KVLayout(num_pages=hello.num_pages, **hello.layout)  # type: ignore[arg-type]
        table = layout.descriptor_table(hello.base_addr, hello.device_id)
        await self._thread.call(self._door.add_peer, hello.agent, hello.metadata, table)
        self._layouts[hello.agent] = layout

    def _make_link(self, framed: FramedStream[Message], hello: Hello) -> PeerLink:
        prior = self._links.get(hello.agent)
        if prior is not None:  # a second connection from the same incarnation replaces the first
            self._links.pop(hello.agent)
            prior.close(ConnectionResetError("replaced by a new connection"))
        link = PeerLink(
            framed, hello, on_message=self._on_message, on_lost=self._on_lost,
            heartbeat_interval=self._cfg.heartbeat_interval_s, peer_timeout=self._cfg.peer_timeout_s,
        )
        self._links[hello.agent] = link
        self._by_addr[hello.address] = hello.agent
        log.info("peer.connected", peer=hello.address, agent=hello.agent)
        return link

    def _on_message(self, link: PeerLink, msg: Message) -> None:
        if isinstance(msg, Hello | Reject):
            link.close(FrameError(f"unexpected {type(msg).__name__} after handshake"))
            return
        self._svc.on_message(link.agent, msg)

    async def _on_lost(self, link: PeerLink, cause: BaseException | None, graceful: bool) -> None:
        if self._links.get(link.agent) is not link:
            return  # superseded by a newer link of the same agent
        await self._drop(link.agent, cause, graceful)

    async def _drop(self, agent: str, cause: BaseException | None, graceful: bool) -> None:
        link = self._links.pop(agent, None)
        if link is None:
            return
        if self._by_addr.get(link.address) == agent:
            del self._by_addr[link.address]
        (log.info if graceful else log.warning)(
            "peer.lost", peer=link.address, agent=agent, graceful=graceful, cause=repr(cause))
        # The peer's last WRITEs may have landed with their notifications not collected
        # yet (its Bye can overtake them): take them first, so what arrived succeeds.
        self._svc.on_notifs(await self._thread.call(self._door.notifs))
        self._svc.on_peer_lost(agent, link.address, cause, graceful)
        link.close(cause)
        released = await self._thread.call(self._door.remove_peer, agent)
        self._layouts.pop(agent, None)
        self._svc.released_by_door(released)

    # -- used by the service ------------------------------------------------------------
    def remote_layout(self, agent: str) -> KVLayout:
        return self._layouts[agent]

    def drop_peer(self, agent: str, cause: BaseException) -> None:
        """Close the link to ``agent``; its loss is then handled as any other."""
        link = self._links.get(agent)
        if link is not None:
            link.close(cause)

    def send_to(self, agent: str, msg: Message) -> None:
        link = self._links.get(agent)
        if link is not None:
            link.send(msg)

    def peer_addresses(self) -> list[str]:
        return sorted(link.address for link in self._links.values())

    async def close_all(self, timeout: float) -> None:
        async with anyio.create_task_group() as tg:
            for link in list(self._links.values()):
                tg.start_soon(link.flush_and_close, timeout)
