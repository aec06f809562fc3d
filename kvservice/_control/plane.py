"""The control plane: listener, dialling, admission of authenticated peers, and the peer table
(the handshake itself: ``handshakes``).

Identity.  A peer is its authenticated NIXL agent name (unique per process
incarnation), never a claimed address.  The table holds one ``Peer`` per live
agent, each with the ``generation`` of its link: frames from a link that is no
longer its agent's current one are ignored.  A second connection claiming a
live agent is refused.  Loading and dropping hold one lock, so a drop and a
reconnect of the same agent can interleave in any order without unloading the
fresh agent.

Addresses are proven, not claimed.  An address names an agent only when this
service dialled it and authenticated that agent there, or dialled the address
a peer claims back (``Hello(probe=True)``: the acceptor proves who it is and
hangs up) and found the same agent answering (``prove_address``).  A claim
alone binds nothing: it cannot pin a request, replace a peer, or settle
anything.  When a dial finds a *new* agent at an address a live peer was proven
at, that peer restarted: the old incarnation is dropped (its requests fail
``PEER_LOST``, its NIXL agent is unloaded) before the new one is loaded.  One
link per peer however it is addressed: ``localhost:p``, ``127.0.0.1:p`` and
the peer's proven address all map, by canonical form (``addressbook``), to the
same agent.

Secrets.  Each link derives from its handshake transcript (``LinkSecrets``) the
frame MAC, the Join's encryption and the keys that authenticate NIXL
notifications in each direction; a peer's recent inbound notification keys are
kept after its link ends, for the settle fences still on their way.

Containment.  Every connection's handshake runs under a guard that logs,
counts (``Stats.refuse``) and closes that connection whatever it raised, and
each link guards its own reader (``PeerLink``): nothing a peer sends reaches
the service's task group.  Bounds: ``max_handshakes`` connections in their
handshake, ``max_handshakes_per_source`` of them from one source IP, shared
fairly (``preauth``; a refused or evicted one gets a ``Reject`` saying so),
``max_peers`` peers (``max_peers_per_source`` of them from one source: its proven member,
else its IP; agent names cost nothing, members and addresses do), ``max_outbox_bytes`` per
link; ``accept()`` errors back off and go on (``accept``).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import anyio.abc

from .._config import ServiceConfig
from .._log import get_logger
from .._nixl.door import Door, DoorThread
from .._results import FailureReason, KVServiceError, ProtocolError
from .._stats import Stats
from .._transfer.requests import Recent
from .._trust import checks
from .._trust.identity import MEMBER, Identity, IdentityRefused
from .._trust.revocation import LIST_REFUSED, POLL_S, REVOKED, RevocationWatch
from .._trust.rotation import ROTATION_REFUSED, IdentityWatch
from .._trust.vetting import MetadataVetter
from ..memory._pairing import PeerKV
from ..memory._staging import area_from_wire
from .accept import accept_loop
from .addressbook import AddressBook
from .addresses import join_address
from .departures import Departures
from .handshakes import Handshakes, Met, send_join
from .links import CONNECTION_ERRORS, ControlStream, PeerLink, try_send
from .named import Names
from .peers import (
    IncompatiblePeer,
    LocalPeer,
    Peer,
    PeerEvents,
    dial_failure,
    endpoint_gone,
    load_peer,
)
from .preauth import EVICTED, NO_ADDRESS, HandshakeSlots, charged_to, source_of
from .protocol import (
    FrameError,
    Hello,
    Join,
    Message,
    Proof,
    Reject,
)
from .refusals import check_room, handshake_failed, refuse_handshake, vet
from .transport import ByteListener, TcpTransport, Transport

log = get_logger("kvservice.control")

#: inbound notification keys kept per agent: its current link's and the ones before
_NOTIF_KEYS_PER_AGENT = 2


@dataclass
class _Dial:
    done: anyio.Event = field(default_factory=anyio.Event)
    link: PeerLink | None = None
    error: BaseException | None = None


class ControlPlane:
    def __init__(
        self, config: ServiceConfig, thread: DoorThread, door: Door, events: PeerEvents, local: LocalPeer,
        stats: Stats, tg: anyio.abc.TaskGroup, transport: Transport | None = None,
        vetter: MetadataVetter | None = None,
    ) -> None:
        self._cfg = config
        self._transport = transport or TcpTransport()
        self._thread = thread
        self._door = door
        self._events = events
        self._local = local
        self._stats = stats
        self._tg = tg
        self._vetter = vetter  # None: the door's metadata is not NIXL's (the fake door)
        self._peers: dict[str, Peer] = {}  # agent -> peer
        #: agent -> (where it was, why) while its loss is being handled (``losing``)
        self._losing: dict[str, tuple[str, BaseException | None]] = {}
        self._handshakes = Handshakes(self._transport, config, local, lambda: self.address, stats.refuse)
        stats.identity = self._handshakes.own_member
        self._book = AddressBook(self._handshakes.probe)  # which agent is proven at which address
        self._names = Names(config.identity() is not None)  # which member the engine named at which address
        self._dials: dict[str, _Dial] = {}  # canonical address -> the dial in progress
        # agent -> inbound notification keys of its latest links, newest first
        self._notif_in: Recent[str, list[bytes]] = Recent(2 * config.max_peers)
        self._table_lock = anyio.Lock()  # loading and dropping peers
        self._generations = itertools.count(1)
        self._slots = HandshakeSlots(config.max_handshakes, config.max_handshakes_per_source)
        self._closing = False
        #: told each identity rotated in (``_trust.rotation``): what else signs with it
        self.rotation_listeners: list[Callable[[Identity], None]] = []
        self._listeners: list[ByteListener] = []
        self.address = ""
        self._departures = Departures(
            config, thread, door, events, tg, self._table_lock,
            linked=lambda agent: agent in self._peers or agent in self._losing,
            closing=lambda: self._closing, probe=self._handshakes.probe, gone=self._gone,
            remembered=self._notif_in.__contains__)  # every agent linked has an entry until forgotten

    # -- listening ---------------------------------------------------------------
    async def listen(self) -> str:
        cfg = self._cfg
        port, listeners = await self._transport.listen(cfg.host, cfg.port)
        self._listeners = listeners
        self.address = join_address(cfg.advertise_host or cfg.host, port)
        for listener in listeners:
            self._tg.start_soon(self._serve, listener)
        if self._handshakes.identity_watch is not None:
            self._tg.start_soon(self._watch_trust_files, self._handshakes.identity_watch,
                                self._handshakes.revocations)
        return self.address

    async def _watch_trust_files(self, identity: IdentityWatch, revocations: RevocationWatch | None) -> None:
        """Until the service's task group ends: every ``POLL_S``, the files of the trust
        in force looked at, in one worker thread.  A new revocation list in force closes
        the links of the members it revokes (their requests fail with its reason), no
        other's; a rotated identity proves this service in new handshakes, links made
        before are left alone; either refused is counted.  The expiry warning is said
        again each time."""
        while True:
            await anyio.sleep(POLL_S)
            listed, pair = await anyio.to_thread.run_sync(
                lambda: (revocations.read() if revocations is not None else None, identity.read()))
            if isinstance(pair, ValueError):
                self._stats.refuse(ROTATION_REFUSED)
            if identity.apply(pair):
                self._handshakes.rotated(identity.current)
                self._stats.identity = identity.current.member
                for listener in self.rotation_listeners:
                    listener(identity.current)
            identity.expiry()
            if revocations is None:
                continue
            if isinstance(listed, ValueError):
                self._stats.refuse(LIST_REFUSED)
            if not revocations.apply(listed):
                continue
            for agent in list(self._peers):
                member = self._handshakes.members.get(agent)
                if member is not None and (why := revocations.current.refusal(member)) is not None:
                    self._stats.refuse(REVOKED)
                    log.warning("peer.revoked", agent=agent, member=member.uri, why=str(why))
                    self.drop_peer(agent, why)

    async def _serve(self, listener: ByteListener) -> None:
        """Until the service's task group ends.  The port stays open after that, until
        ``close_listeners``: the service calls it once its NIXL agent is closed, so a
        peer that finds the port refusing knows no WRITE of ours can land any more."""
        await accept_loop(listener, self._accept, self._tg, self._accept_failed, name="control")

    async def close_listeners(self) -> None:
        with anyio.CancelScope(shield=True):
            for listener in self._listeners:
                with contextlib.suppress(*CONNECTION_ERRORS):
                    await listener.aclose()
            self._listeners = []

    def _accept_failed(self, kind: str, exc: BaseException) -> None:
        self._stats.refuse(kind)  # accept_loop has logged it

    def refuse_new_peers(self) -> None:
        """Shutting down: handshakes from now on get ``Reject("shutting_down")``."""
        self._closing = True

    async def _accept(self, stream: anyio.abc.ByteStream) -> None:
        source = source_of(stream)
        slot = self._slots.take(source)
        framed = ControlStream(stream, self._cfg.max_frame_bytes)
        if isinstance(slot, str):
            await refuse_handshake(framed, slot, source, self._slots, self._stats)
            return
        if self._closing:
            self._slots.give_back(slot)
            await try_send(framed, Reject("this service is shutting down", "shutting_down"))
            await framed.aclose()
            return
        peer: Peer | None = None
        probed = False
        try:
            with slot.scope:
                if self._vetter is not None:  # its first start is not the peer's delay
                    await self._vetter.ready()
                with anyio.fail_after(self._cfg.connect_timeout_s):
                    peer = await self._handshake_as_acceptor(framed)
                    probed = peer is None
        except Exception as exc:  # noqa: BLE001 - one connection's failure is that connection's
            await handshake_failed("accept", framed, exc, self._stats)
            return
        finally:
            self._slots.give_back(slot)
        if probed:  # a probe: answered
            await framed.aclose()
            return
        if peer is None:  # evicted: a source holding fewer slots took this one's
            await refuse_handshake(framed, EVICTED, source, self._slots, self._stats)
            return
        await peer.link.run()

    async def _handshake_as_acceptor(self, framed: ControlStream) -> Peer | None:
        met = await self._handshakes.accept(framed)
        if met is None:  # a probe, answered
            return None
        peer = await self._admit(framed, met)
        try:
            await send_join(framed, self._local.join, met.secrets)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._drop(peer.agent, ConnectionResetError("handshake broke off"), graceful=False)
            raise
        return peer

    # -- dialling -------------------------------------------------------------------
    async def canonical(self, address: str) -> str:
        """``address``'s canonical form (``AddressBook.canonical``)."""
        return await self._book.canonical(address)

    def at_address(self, agent: str, canon: str) -> bool | None:
        """Whether linked ``agent`` is proven to answer at canonical ``canon`` (``AddressBook.at``),
        and proves the member named there, if one was (``named``; the caller counts its refusal)."""
        at = self._book.at(agent, canon)
        if at and self._names.refusal(canon, agent, self._handshakes.members.get(agent)) is not None:
            return False
        return at

    def name_member(self, canon: str, member: str) -> None:
        """The engine names ``member`` as the one at canonical ``canon`` (``named``)."""
        self._names.name(canon, member)

    def _named_refusal(self, canon: str, agent: str) -> IdentityRefused | None:
        refusal = self._names.refusal(canon, agent, self._handshakes.members.get(agent))
        if refusal is not None and (unlogged := self._stats.refuse(MEMBER)) is not None:
            log.warning("peer.member_refused", agent=agent, address=canon, error=str(refusal), unlogged=unlogged)
        return refusal

    def address_of(self, agent: str) -> str | None:
        """Where ``agent`` is, to name it in a message: an address it is proven at, else the one
        it advertises (a claim: shown, never acted on); ``None`` when it is not linked."""
        proven = self._book.proven(agent)
        if proven:
            return min(proven)
        peer = self._peers.get(agent)
        return peer.address if peer is not None else None

    def proven_addresses(self, agent: str) -> frozenset[str]:
        """The canonical addresses ``agent`` is proven at (empty when not linked)."""
        return self._book.proven(agent)

    def proven_at(self, canon: str) -> str | None:
        """The linked agent proven to answer at canonical ``canon``, if any."""
        return self._book.agent_at(canon)

    async def prove_address(self, agent: str, canon: str) -> bool:
        """Whether ``agent`` answers at ``canon``: known, or found out by one probe (shared)."""
        return await self._book.prove(agent, canon)

    def notif_key_to(self, agent: str) -> bytes | None:
        """The key our notifications to linked ``agent`` carry their MAC under."""
        peer = self._peers.get(agent)
        return peer.secrets.notif_out if peer is not None else None

    def notif_keys_from(self, agent: str) -> list[bytes]:
        """The keys a notification from ``agent`` may be sealed under (its recent links')."""
        return self._notif_in.get(agent) or []

    def linked_now(self, address: str) -> bool:
        """Whether ``link_to(address)`` returns without waiting: the address's canonical form is
        known and the agent proven there is linked (one that does not prove the member named
        there is refused as quickly)."""
        canon = self._book.known(address)
        agent = self._book.agent_at(canon) if canon is not None else None
        peer = self._peers.get(agent) if agent is not None else None
        return peer is not None and not peer.link.closed

    async def link_to(self, address: str) -> PeerLink:
        """The live link to ``address``, dialling once however many callers wait.

        Raises what the dial raised (classify with ``dial_failure``); raises
        ``KVServiceError`` if the service shuts down first, ``IdentityRefused`` when the
        agent there does not prove the member named at ``address`` (``named``)."""
        canon = await self.canonical(address)
        link = await self._link_to(address, canon)
        if (refusal := self._named_refusal(canon, link.agent)) is not None:
            raise refusal
        return link

    async def _link_to(self, address: str, canon: str) -> PeerLink:
        agent = self._book.agent_at(canon)
        if agent is None:
            # A peer that dialled us and claims this address: prove the claim
            # (one probe), and its link serves; otherwise dial.
            claimant = self._book.claimant(canon)
            if claimant is not None and await self._book.prove(claimant, canon):
                agent = claimant
        if agent is not None:
            peer = self._peers.get(agent)
            if peer is not None and not peer.link.closed:
                return peer.link
        if self._closing:
            raise KVServiceError("service is shutting down")
        attempt = self._dials.get(canon)
        if attempt is None:
            attempt = self._dials[canon] = _Dial()
            self._tg.start_soon(self._dial, address, canon, attempt)
        await attempt.done.wait()
        if attempt.error is not None:
            raise attempt.error
        assert attempt.link is not None
        return attempt.link

    async def _dial(self, address: str, canon: str, attempt: _Dial) -> None:
        peer: Peer | None = None
        try:
            peer = await self._dial_and_admit(address, canon)
        except Exception as exc:  # noqa: BLE001 - handed to every waiter, classified there
            attempt.error = exc
            kind = exc.kind if isinstance(exc, ProtocolError) else type(exc).__name__
            log.warning("peer.dial_failed", address=address, kind=kind, error=str(exc) or repr(exc))
        finally:
            self._dials.pop(canon, None)
            if peer is None and attempt.error is None:  # cancelled: the service is shutting down
                attempt.error = KVServiceError("service shut down while connecting")
            attempt.link = peer.link if peer is not None else None
            attempt.done.set()
        if peer is not None:
            await peer.link.run()

    async def _dial_and_admit(self, address: str, canon: str) -> Peer:
        if self._vetter is not None:  # its first start is not the peer's delay
            await self._vetter.ready()
        with self._handshakes.deadline(address):
            framed = await self._handshakes.connect(address)
            try:
                return await self._admit(framed, await self._handshakes.dial(framed, address), dialled=canon)
            except BaseException:
                await framed.aclose()
                raise

    async def probe(self, address: str) -> str:
        """The agent that answers at ``address`` now (``handshakes.probe``)."""
        return await self._handshakes.probe(address)

    def dial_failure(self, exc: BaseException) -> FailureReason:
        return dial_failure(exc)

    # -- the handshake ---------------------------------------------------------------
    async def _admit(self, framed: ControlStream, met: Met, dialled: str | None = None) -> Peer:
        """Check an authenticated peer's pool, load it into NIXL and link it (raises
        ``ProtocolError``).  ``dialled``: the canonical address we dialled and found it at."""
        hello, join, secrets, version = met.hello, met.join, met.secrets, met.version
        memory, why, theirs = checks.check_memory(self._local.memory, join.memory)
        if memory is None:
            why = why or "invalid KV memory"
            if theirs is not None:  # a real peer of another model: its engine waits on us
                self._events.on_incompatible(hello.agent, dialled or hello.address, dialled is not None, why)
            raise IncompatiblePeer(why, theirs or why)
        try:
            staging_there = area_from_wire(join.memory.staging_addr, join.memory.staging_bytes)
        except ValueError as exc:
            raise ProtocolError(f"invalid KV memory: {exc}", "incompatible") from exc
        kv = PeerKV.of(self._local.memory, memory, self._local.staging, staging_there)
        try:
            canon = await self.canonical(hello.address)
        except (OSError, ValueError) as exc:
            raise ProtocolError(f"advertised address {hello.address!r} does not resolve: {exc}",
                                "hello_invalid") from exc
        agent = hello.agent
        inside = self._door.metadata_agent(join.metadata)
        if inside != agent:
            raise ProtocolError(f"NIXL metadata names agent {inside!r}, not {agent!r}", "metadata_mismatch")
        current = self._peers.get(agent)
        if current is not None and not await self._outlived(current.link):  # checked again below
            raise ProtocolError(f"agent {agent!r} is already connected", "agent_live")
        # Outside the table lock: a vetting child restarting after bad metadata (seconds)
        # delays this peer only, not every other admit and drop.
        source = framed.source
        await vet(self._vetter, framed, join.metadata, source, dialled, self._stats)
        async with self._table_lock:
            current = self._peers.get(agent)
            if current is not None:
                if not current.link.closed:
                    raise ProtocolError(f"agent {agent!r} is already connected", "agent_live")
                # Its old link has ended and its drop waits for this lock: do it now.
                await self._drop_locked(agent, current.link, ConnectionResetError("reconnected"), graceful=False)
            # Under the lock: its old link's drop may have started the drain just now (bounded;
            # a peer linking again is alive, so its WRITEs end soon).
            await self._departures.let_drain_end(agent)
            charged = charged_to(source, met.member)
            check_room(self._peers, self._cfg, charged)
            old = self._book.agent_at(dialled) if dialled is not None else None
            if old is not None and old != agent:
                # We dialled the address and a new agent proved itself there: the old
                # incarnation's listener is closed, and a service closes its port only
                # after its NIXL agent (``TransferService.__aexit__``).
                log.info("peer.restarted", address=dialled, old_agent=old, agent=agent)
                await self._drop_locked(old, None, ConnectionResetError("peer restarted"), graceful=False,
                                        gone=True, restarted=True)
            with anyio.CancelScope(shield=True):  # a load half done must be recorded, or undone
                await self._thread.call(load_peer, self._door, agent, join, kv, framed.hung_up)  # DoorError: refused
            link = PeerLink(
                framed, agent=agent, address=hello.address, generation=next(self._generations),
                on_message=self._on_message, on_lost=self._on_lost, on_refused=self._stats.refuse,
                heartbeat_interval=self._cfg.heartbeat_interval_s, peer_timeout=self._cfg.peer_timeout_s,
                max_outbox_bytes=self._cfg.max_outbox_bytes,
            )
            peer = Peer(agent, hello.address, kv, link, secrets, version, charged)
            self._peers[agent] = peer
            self._stats.peers.linked(agent, hello.address)
            self._book.linked(agent, canon, dialled)
            keys = self._notif_in.get(agent) or []
            self._notif_in.put(agent, [secrets.notif_in, *keys][:_NOTIF_KEYS_PER_AGENT])
        log.info("peer.connected", peer=hello.address, agent=agent, generation=link.generation,
                 authenticated=self._local.key is not None, version=version)
        if self._book.unproven_claim(agent) is not None and not self._closing:
            # It dialled us: find out now whether it answers where it says it does, so a
            # request pinned to that address binds without waiting.
            self._tg.start_soon(self._book.prove, agent, canon)
        self._events.on_peer_linked(agent)
        return peer

    def source_of(self, agent: str) -> str:
        """What linked ``agent``'s use of shared bounds is charged to (``preauth.charged_to``:
        the member it proved, else the IP address its link comes from; ``NO_ADDRESS`` when
        not linked)."""
        peer = self._peers.get(agent)
        return peer.source if peer is not None else NO_ADDRESS

    async def _outlived(self, link: PeerLink) -> bool:
        """``link``'s agent links again: whether the old link is dead (``PeerLink.outlived``),
        waited for within the handshake's deadline, a heartbeat left to answer in."""
        hb = self._cfg.heartbeat_interval_s
        left = anyio.current_effective_deadline() - anyio.current_time() - hb
        return await link.outlived(min(left, self._cfg.peer_timeout_s + 2 * hb))

    # -- links ----------------------------------------------------------------------
    def _on_message(self, link: PeerLink, msg: Message) -> None:
        peer = self._peers.get(link.agent)
        if peer is None or peer.link is not link:
            self._stats.refuse("stale_frame")  # an older generation of this agent's link
            return
        if isinstance(msg, Hello | Proof | Join | Reject):
            link.close(FrameError(f"unexpected {type(msg).__name__} after handshake"))
            return
        self._events.on_message(link.agent, msg)

    async def _on_lost(self, link: PeerLink, cause: BaseException | None, graceful: bool) -> None:
        await self._drop(link.agent, cause, graceful, link=link)

    async def _drop(self, agent: str, cause: BaseException | None, graceful: bool,
                    link: PeerLink | None = None) -> None:
        async with self._table_lock:
            await self._drop_locked(agent, link, cause, graceful)

    async def _drop_locked(self, agent: str, link: PeerLink | None, cause: BaseException | None,
                           graceful: bool, gone: bool = False, restarted: bool = False) -> None:
        """Forget ``agent`` (only if ``link`` is still its current link, when given).

        Before unloading it, NIXL is asked whether its process is gone (a notification
        to a dead endpoint fails ``REMOTE_DISCONNECT``): what it could still write into
        our pages depends on it (``_transfer.settle``)."""
        peer = self._peers.get(agent)
        if peer is None or (link is not None and peer.link is not link):
            return
        del self._peers[agent]
        # Where to find out later whether it is gone for good (``departures``): where it was
        # proven; else where it claimed to be, unless another agent answered there (its proof
        # still running or failed unanswered leaves the claim open).
        claimed = self._book.open_claim(agent)
        proven = self._book.unlinked(agent)
        watch = proven or (frozenset({claimed}) if claimed is not None else frozenset())
        (log.info if graceful else log.warning)(
            "peer.lost", peer=peer.address, agent=agent, graceful=graceful, cause=repr(cause))
        self._losing[agent] = (min(proven) if proven else peer.address, cause)
        try:
            # The peer's last WRITEs may have landed with their notifications not collected
            # yet (its Bye can overtake them): take them first, so what arrived succeeds.
            self._events.on_notifs(await self._thread.call(self._door.notifs))
            if not graceful and not gone:
                gone = await self._thread.call(endpoint_gone, self._door, agent)
        finally:
            del self._losing[agent]
        self._events.on_peer_lost(agent, peer.address, cause, graceful, gone, proven)
        self._stats.peers.lost(agent)  # after its requests' ends were recorded under it
        peer.link.close(cause)
        # Gone for good (``departures``): NIXL's word that its endpoint is disconnected is not
        # enough (a broken transport between live processes says the same): probed instead.
        why = "a new agent proved itself at its address" if restarted else "it said Bye" if graceful else None
        await self._departures.left(agent, why, watch)

    def _gone(self, agent: str, why: str) -> None:
        """``agent`` is unloaded and gone for good (``departures``): forget it."""
        if agent in self._peers or agent in self._losing:
            return
        self._notif_in.pop(agent)
        log.info("peer.gone", agent=agent, why=why)
        self._events.on_peer_gone(agent)

    # -- used by the service ------------------------------------------------------------
    def generation_of(self, agent: str) -> int | None:
        """The generation of ``agent``'s current link (None when not linked)."""
        peer = self._peers.get(agent)
        return peer.link.generation if peer is not None else None

    def version_of(self, agent: str) -> int | None:
        """The protocol version ``agent``'s link speaks (None when not linked)."""
        peer = self._peers.get(agent)
        return peer.version if peer is not None else None

    def speaks(self, agent: str, version: int) -> bool:
        """Whether ``agent`` is linked and its link speaks ``version`` or newer: a message
        newer than its version would end the link (an unknown tag is a ``FrameError``)."""
        peer = self._peers.get(agent)
        return peer is not None and peer.version >= version

    def losing(self, agent: str) -> tuple[str, BaseException | None] | None:
        """Where ``agent`` was and why its link was lost, while that loss is being handled
        (it left the table, its requests are not failed yet): what a request that meets
        it meanwhile fails with."""
        return self._losing.get(agent)

    def peer_kv(self, agent: str) -> PeerKV | None:
        peer = self._peers.get(agent)
        return peer.kv if peer is not None else None

    def drop_peer(self, agent: str, cause: BaseException, *, tell: bool = False) -> None:
        """Close the link to ``agent``; its loss is then handled as any other.  ``tell``:
        the peer is alive and reading (its NIXL endpoint broke, not its link), so what is
        queued for it goes out first, within ``peer_timeout_s``: the ``Failed`` of the
        requests the break ended tell it why.  The next request to it links afresh (a handshake,
        its metadata loaded again, a new endpoint)."""
        peer = self._peers.get(agent)
        if peer is None:
            return
        if tell and not peer.link.closed:
            self._tg.start_soon(peer.link.tell_and_close, cause, self._cfg.peer_timeout_s)
        else:
            peer.link.close(cause)

    def send_to(self, agent: str, msg: Message) -> None:
        peer = self._peers.get(agent)
        if peer is not None:
            peer.link.send(msg)

    def peer_addresses(self) -> list[str]:
        return sorted(peer.address for peer in self._peers.values())

    def peer_versions(self) -> dict[str, int]:
        """Live links by the protocol version they speak (``status()["peer_versions"]``)."""
        return dict(sorted(collections.Counter(str(peer.version) for peer in self._peers.values()).items()))

    async def close_all(self, timeout: float) -> None:
        self._closing = True
        async with anyio.create_task_group() as tg:
            for peer in list(self._peers.values()):
                tg.start_soon(peer.link.flush_and_close, timeout)
