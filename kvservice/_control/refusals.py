"""How a handshake is refused: the room it needs, and a refusal told, counted and closed.

Every refusal here is counted under its kind (``Stats.refuse``) and logged,
throttled per kind; the connection is told why in a ``Reject`` when it can hear
it, then closed.  Nothing a peer sends raises past these functions.
"""

from __future__ import annotations

from collections.abc import Mapping

import anyio

from .._config import ServiceConfig
from .._log import get_logger
from .._nixl.door import DoorError
from .._results import ProtocolError
from .._stats import Stats
from .._trust.vetting import MetadataVetter
from .links import CONNECTION_ERRORS, ControlStream, try_send
from .peers import NIXL_REFUSED, PEER_SOURCE_LIMIT, IncompatiblePeer, Peer
from .preauth import EVICTED, SOURCE_LIMIT, HandshakeSlots, budget_key
from .protocol import FrameError, Reject, text

__all__ = ["REJECT_SEND_S", "check_room", "handshake_failed", "refuse_handshake", "vet"]

log = get_logger("kvservice.control")

#: the longest a refused connection's Reject may take to write (it fits a new socket's buffer)
REJECT_SEND_S = 0.05


def check_room(peers: Mapping[str, Peer], config: ServiceConfig, source: str) -> None:
    """Room for one more peer, in all and from ``source`` (``max_peers_per_source``: agent
    names cost nothing, a member or, without identities, a source address does:
    ``preauth.charged_to``); ``ProtocolError`` saying which bound."""
    if len(peers) >= config.max_peers:
        raise ProtocolError(f"too many peers (max_peers = {config.max_peers})", "peer_limit")
    if sum(1 for p in peers.values() if p.source == source) >= config.max_peers_per_source:
        raise ProtocolError(f"too many peers from {source} (max_peers_per_source = "
                            f"{config.max_peers_per_source})", PEER_SOURCE_LIMIT)


async def vet(vetter: MetadataVetter | None, framed: ControlStream, metadata: bytes, source: str,
              dialled: str | None, stats: Stats) -> None:
    """Metadata that could abort this process is never loaded (``_trust.vetting``; ``None``:
    the door's metadata is not NIXL's).  Refused when dialling, the acceptor hears why and it
    is counted here (an acceptor's refusals are counted by ``handshake_failed``)."""
    refusal = None if vetter is None else await vetter.vet(metadata, source)
    if refusal is None:
        return
    if dialled is not None:
        await try_send(framed, Reject(text(refusal.message), refusal.kind))
        if (unlogged := stats.refuse(refusal.kind)) is not None:
            log.warning("peer.refused", side="dial", kind=refusal.kind, source=source, error=refusal.message,
                        unlogged=unlogged)
    raise ProtocolError(refusal.message, refusal.kind)


async def refuse_handshake(framed: ControlStream, kind: str, source: str, slots: HandshakeSlots,
                           stats: Stats) -> None:
    """Tell a connection the handshake pool refused it, count it, close it.  The Reject
    is tiny and the connection new, so it fits the socket's buffer; ``REJECT_SEND_S``
    only guards against waiting on a stranger."""
    charged = budget_key(source)
    if (unlogged := stats.refuse(kind)) is not None:
        log.warning("peer.refused", side="accept", kind=kind, source=source, charged=charged,
                    held=slots.held_by(source), limit=slots.per_source if kind == SOURCE_LIMIT else slots.total,
                    unlogged=unlogged)
    why = {SOURCE_LIMIT: f"too many handshakes from {charged} (max_handshakes_per_source = {slots.per_source})",
           EVICTED: "handshake ended: its slot went to a source holding fewer (max_handshakes = "
                    f"{slots.total})"}.get(kind, f"too many handshakes (max_handshakes = {slots.total})")
    with anyio.CancelScope(shield=True):
        await try_send(framed, Reject(why, kind), timeout=REJECT_SEND_S)
        await framed.aclose()


async def handshake_failed(side: str, framed: ControlStream, exc: Exception, stats: Stats) -> None:
    """A handshake raised ``exc``: tell the peer why where it may hear it, count, close."""
    if isinstance(exc, ProtocolError):
        kind = exc.kind
        told = exc.for_peer if isinstance(exc, IncompatiblePeer) else str(exc)
        await try_send(framed, Reject(text(told), kind))
    elif isinstance(exc, TimeoutError):
        kind = "handshake_timeout"
    elif isinstance(exc, FrameError):
        kind = "frame"
        await try_send(framed, Reject(text(str(exc)), kind))
    elif isinstance(exc, DoorError):
        kind = NIXL_REFUSED
        await try_send(framed, Reject(text(f"cannot load this agent into NIXL: {exc}"), kind))
    elif isinstance(exc, CONNECTION_ERRORS):
        kind = "handshake_incomplete"
    else:
        kind = "handler_error"
        log.error("peer.handshake_crashed", side=side, exc_info=exc)
    if (unlogged := stats.refuse(kind)) is not None:
        log.warning("peer.handshake_failed", side=side, kind=kind, error=_words(exc), unlogged=unlogged)
    await framed.aclose()


def _words(exc: Exception) -> str:
    """What went wrong, for the log: the error's own text, or what its kind means here
    (a handshake's deadline, anyio's stream errors, say nothing)."""
    if str(exc):
        return str(exc)
    if isinstance(exc, TimeoutError):
        return "the handshake did not complete within connect_timeout_s"
    if isinstance(exc, CONNECTION_ERRORS):
        return f"the connection was lost during the handshake ({type(exc).__name__})"
    return repr(exc)
