"""What a ``TransferService`` does with discovery: its ``Member``, name resolution, and a
lost member turned into the control plane's own peer loss (nothing of its own).

Discovery acts only on what it vouched for.  Anyone who can write to etcd can register
a member naming any agent, so a registration's word is never enough to drop a link:
a member judged lost (its lease lapsed, or it registered again as a new incarnation)
fails only the sends named to it, and drops the link to its agent only when the engine
*named* that member (``expect(sender=name)``, ``send(receiver=name)``) while it was
registered with that agent, and that agent is proven (dialled, or probed) to answer at
the address the member registered.  A link the engine made by address, or that a peer
dialled in, for a member it never named, is the link's own: its heartbeats and the data
path judge it.

Discovery is attached through values and callables (what the service is, how loaded it
is, how to drop a link), never the service object: discovery is a layer below it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio.abc

from .._control.addresses import split_address
from .._log import get_logger
from .._results import KVServiceError
from .._stats import Stats
from .._trust.identity import Identity
from ..memory._regions import KVMemory
from .member import Member
from .registry import Registry, incarnation
from .settings import DiscoverySettings

log = get_logger("kvservice.discovery")


class PeerUnknown(KVServiceError):
    """A peer was named that no live member of the cluster has.

    Never raised to a caller: ``send(receiver=)`` or ``expect(sender=)`` naming it
    fails the request ``PEER_LOST`` with this as ``error``, as a peer that died."""


class MemberLost(KVServiceError):
    """Why a link to a member the engine named was dropped (its lease lapsed, it restarted).

    Never raised: it is the ``error`` of the requests that fail ``PEER_LOST`` with the link."""


class Discovery:
    """A started service's discovery (``discovery = "etcd"``).

    ``load()`` answers (peers linked, requests in flight), read at each keep-alive;
    ``drop(agent, cause, member, address)``, for a member the engine named, judged lost,
    fails the sends named to ``member`` that no Expect bound yet and drops the link to
    ``agent`` as the control plane drops a lost peer, if that agent is proven to answer
    at ``address`` (where the member registered)."""

    def __init__(self, config: DiscoverySettings, stats: Stats, *, agent: str, address: str, memory: KVMemory,
                 load: Callable[[], tuple[int, int]],
                 drop: Callable[[str, BaseException, str, str], None], identity: Identity | None = None,
                 allow_unsigned: bool = False) -> None:
        self._config = config
        self._agent = agent
        self._address = address
        self._memory = memory
        self._load = load
        self._drop = drop
        #: member name -> the agent it was registered with when the engine last named it:
        #: what discovery vouches for (one entry per member named, gone with its loss)
        self._named: dict[str, str] = {}
        self.incarnation = incarnation()
        self.started_at = time.time()
        self.registry = Registry(config, self.member, self._lost, stats, identity, allow_unsigned)

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Registered once this returns (or raises, ``etcd_unreachable = "fail"``)."""
        await tg.start(self.registry.run)

    def member(self) -> Member:
        """What this service registers (read at each keep-alive)."""
        cfg, memory = self._config, self._memory
        linked, inflight = self._load()
        return Member(
            name=cfg.discovery_name or self._agent, address=self._address, agent=self._agent,
            incarnation=self.incarnation, role=cfg.discovery_role,
            memory={"bytes": memory.nbytes, "pages": memory.num_pages, "regions": len(memory.regions)},
            started_at=self.started_at, linked=linked, inflight=inflight)

    def resolve(self, peer: str) -> tuple[str, str | None]:
        """``peer`` as (address, the member it names): a member's name resolves to where it
        registered (and discovery vouches for that member's agent from then on); an address
        stays itself, naming no member.  ``PeerUnknown`` for a name no live member has."""
        if ":" in peer:
            return peer, None
        if peer == self.registry.name:
            return self._address, None
        m = self.registry.member(peer)
        if m is None:
            raise PeerUnknown(f"no live member named {peer!r} in cluster {self._config.cluster!r}")
        split_address(m.address)
        self._named[peer] = m.agent
        return m.address, peer

    def _lost(self, member: Member, why: str) -> None:
        named = self._named.get(member.name)
        if named != member.agent:
            log.info("discovery.loss_ignored", peer=member.name, agent=member.agent,
                     detail="no request named this member while it was registered with this agent: "
                            "nothing is dropped on its registration's word (links made by address, or "
                            "dialled in, are judged by their own liveness)")
            return
        del self._named[member.name]
        self._drop(member.agent, MemberLost(why), member.name, member.address)
