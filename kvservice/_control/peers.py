"""Who a peer is, as the control plane keeps it, and what the plane tells the service.

``LocalPeer`` is this service as peers see it; ``Peer`` one linked peer (its claimed
address is shown, never acted on: ``addressbook``).  The checks of a Hello before
the key is proved, the reading of a peer's refusal, and what a failed dial means
to a request (``dial_failure``) live here too, beside the two door-thread helpers
that load a peer into NIXL and ask NIXL whether its endpoint is gone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import anyio

from .._nixl.door import PROBE_NOTIF, Door, DoorError
from .._results import AuthenticationError, FailureReason, KVServiceError, ProtocolError
from .._trust import checks
from .._trust.handshake import (
    DIALER,
    EXCHANGE_SINCE,
    NONCE_BYTES,
    Agreement,
    Exchange,
    LinkSecrets,
    transcript,
)
from .._trust.vetting import VETTING_BACKOFF
from ..memory._pairing import PeerKV
from ..memory._regions import KVMemory
from ..memory._staging import StagingArea
from .links import PeerLink
from .preauth import EVICTED, LIMIT, SOURCE_LIMIT
from .protocol import Hello, Join, Message, Reject, negotiate

#: a handshake past its source's share of ``max_peers``
PEER_SOURCE_LIMIT = "peer_source_limit"
#: a handshake whose end failed to load the other's NIXL agent (NIXL's or UCX's error there)
NIXL_REFUSED = "nixl_refused"
#: refusals that mean "not allowed" rather than "cannot work together"
REFUSED_KINDS = frozenset({"auth", "identity", "identity_missing", "identity_member", "identity_revoked", "agent_live",
                           "peer_limit", PEER_SOURCE_LIMIT, LIMIT, SOURCE_LIMIT, EVICTED, VETTING_BACKOFF})


class PeerEvents(Protocol):
    """What the control plane tells its owner (the service)."""

    def on_message(self, agent: str, msg: Message) -> None: ...
    def on_notifs(self, notifs: Mapping[str, list[bytes]]) -> None: ...
    def on_peer_lost(self, agent: str, address: str, cause: BaseException | None, graceful: bool,
                     gone: bool, proven: frozenset[str]) -> None: ...
    def on_peer_linked(self, agent: str) -> None: ...
    def on_incompatible(self, agent: str, address: str, proven: bool, why: str) -> None: ...
    def released_by_door(self, xids: list[int]) -> None: ...
    def draining(self, agent: str) -> anyio.Event | None:
        """Set once the handles of a lost ``agent`` ended (None: none left): unload it then."""
    def holds(self, agent: str) -> bool:
        """Whether this side holds pages that lost ``agent`` may still write into: its endpoint
        stays loaded meanwhile, so that those WRITEs can end on its side."""
    def on_peer_gone(self, agent: str) -> None:
        """Lost ``agent`` is unloaded and gone for good (``departures``): it never links again."""


@dataclass(frozen=True)
class LocalPeer:
    """This service as peers see it."""

    agent: str
    memory: KVMemory
    join: Join  # our NIXL metadata and KV memory, sent to authenticated peers only
    key: bytes | None  # the cluster's shared key; None: unauthenticated (loopback)
    staging: StagingArea | None = None  # sends may gather through it (_transfer.staging)


@dataclass(eq=False)
class Peer:
    agent: str
    address: str  # as it advertises itself (a claim: shown, never acted on)
    kv: PeerKV  # its KV memory, paired with ours
    link: PeerLink
    secrets: LinkSecrets
    version: int  # the protocol version the link speaks (``protocol.negotiate``)
    source: str  # the IP address its link comes from (``preauth.source_of``): what shared bounds charge


def check_hello(hello: Hello, own_agent: str) -> int:
    """Pre-authentication checks of a Hello (raises ``ProtocolError``); the version a
    link with its sender speaks."""
    version = negotiate(hello)
    if len(hello.nonce) != NONCE_BYTES:
        raise ProtocolError(f"nonce must be {NONCE_BYTES} bytes, got {len(hello.nonce)}", "hello_invalid")
    why = checks.check_agent(hello.agent, own_agent) or checks.check_address(hello.address)
    if why is not None:
        raise ProtocolError(why, "hello_invalid")
    return version


def agree(version: int, mine: Hello, theirs: Hello, exchange: Exchange, role: str) -> Agreement:
    """What our Hello ``mine`` and the peer's checked ``theirs`` settle for a link of
    ``version`` when we play ``role``: the transcript and, from version 6, the shared
    secret of the key exchange (raises ``ProtocolError`` for a share that is not a key)."""
    dialer, acceptor = (mine, theirs) if role == DIALER else (theirs, mine)
    shared = None
    if version >= EXCHANGE_SINCE:
        try:
            shared = exchange.shared(theirs.share)
        except ValueError as exc:
            raise ProtocolError(str(exc), "hello_invalid") from exc
    script = transcript((dialer.agent, dialer.address, dialer.nonce),
                        (acceptor.agent, acceptor.address, acceptor.nonce), version, (dialer.share, acceptor.share))
    return Agreement(version, script, shared)


def dial_failure(exc: BaseException) -> FailureReason:
    """What a failed dial (or handshake) means for the requests that waited on it."""
    if isinstance(exc, ProtocolError):
        if exc.kind == NIXL_REFUSED:  # the peer's NIXL failed (its network, its UCX), not the pair
            return FailureReason.BACKEND
        return FailureReason.REFUSED if exc.kind in REFUSED_KINDS else FailureReason.INCOMPATIBLE
    if isinstance(exc, DoorError):
        return exc.reason
    if type(exc) is KVServiceError:  # the family's root itself: the service shut down meanwhile
        return FailureReason.SHUTDOWN
    return FailureReason.PEER_LOST  # the link broke: connection errors, a FrameError


def load_peer(door: Door, agent: str, join: Join, kv: PeerKV, hung_up: Callable[[], bool]) -> None:
    """On the door thread: the descriptor tables of the pair, then the peer's NIXL agent,
    unless the peer's link has ``hung_up`` meanwhile (``ConnectionResetError``).

    A peer that died after its Join is not loaded: NIXL's load connects to the peer's UCX
    listener at once, and where that connect is refused on the spot (the peer's host is this
    one, or a namespace of it) UCX never closes the socket it made (``uct_tcp_ep_create``
    returns the error without destroying its endpoint), one file held for the agent's
    lifetime per load.  The check just before the load leaves that to a peer dying within
    the load itself."""
    if hung_up():
        raise ConnectionResetError("the peer closed its link before its NIXL agent was loaded")
    remote, local = kv.tables()
    door.add_peer(agent, join.metadata, remote, None if local is None else (kv.local_key, local))


def endpoint_gone(door: Door, agent: str) -> bool:
    """On the door thread: whether NIXL reports ``agent``'s endpoint disconnected."""
    try:
        door.send_notif(agent, PROBE_NOTIF)
    except DoorError as exc:
        return exc.reason is FailureReason.REMOTE_DISCONNECT
    return False


class IncompatiblePeer(ProtocolError):
    """A peer's KV memory does not pair with ours (another model, dtype or layout);
    ``for_peer`` says why from its side.

    Raised in the handshake: the link is refused and the requests that waited on it
    fail ``INCOMPATIBLE`` with it as ``error``.  Pair services of the same model."""

    def __init__(self, message: str, for_peer: str) -> None:
        super().__init__(message, "incompatible")
        self.for_peer = for_peer

    def __reduce__(self) -> tuple[object, ...]:  # pickle rebuilds it from __init__'s arguments
        return type(self), (str(self), self.for_peer), self.__dict__


def rejected_by(address: str, reject: Reject) -> ProtocolError:
    message = f"{address} refused us: {reject.message}"
    return AuthenticationError(message) if reject.kind == "auth" else ProtocolError(message, reject.kind or "rejected")
