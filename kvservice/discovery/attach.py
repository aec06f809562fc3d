"""What a ``TransferService`` does with discovery: its ``Member``, name resolution, and a
lost member turned into the control plane's own peer loss (nothing of its own).

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
    """Why a link was dropped on discovery's word (its lease lapsed, it restarted).

    Never raised: it is the ``error`` of the requests that fail ``PEER_LOST`` with the link."""


class Discovery:
    """A started service's discovery (``discovery = "etcd"``).

    ``load()`` answers (peers linked, requests in flight), read at each keep-alive;
    ``drop(agent, cause, address)`` drops the link to a member whose lease lapsed or that
    restarted, as the control plane drops a lost peer, and fails the sends pinned to the
    address it registered that no Expect bound yet."""

    def __init__(self, config: DiscoverySettings, stats: Stats, *, agent: str, address: str, memory: KVMemory,
                 load: Callable[[], tuple[int, int]], drop: Callable[[str, BaseException, str], None]) -> None:
        self._config = config
        self._agent = agent
        self._address = address
        self._memory = memory
        self._load = load
        self._drop = drop
        self.incarnation = incarnation()
        self.started_at = time.time()
        self.registry = Registry(config, self.member, self._lost, stats)

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

    def address_of(self, peer: str) -> str:
        """``peer`` as an address: a member's name resolves to where it registered; an
        address stays itself.  ``PeerUnknown`` for a name no live member has."""
        if ":" in peer:
            return peer
        address = self.registry.address_of(peer)
        if address is None:
            raise PeerUnknown(f"no live member named {peer!r} in cluster {self._config.cluster!r}")
        split_address(address)
        return address

    def _lost(self, member: Member, why: str) -> None:
        self._drop(member.agent, MemberLost(why), member.address)
