"""What a ``TransferService`` does with discovery: its ``Member``, name resolution, and a
lost member turned into the control plane's own peer loss (nothing of its own)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio.abc

from .._control.addresses import split_address
from .._log import get_logger
from .._results import KVServiceError
from .member import Member
from .registry import Registry, incarnation

if TYPE_CHECKING:
    from .._service import TransferService

log = get_logger("kvservice.discovery")


class PeerUnknown(KVServiceError):
    """A peer was named that no live member of the cluster has."""


class MemberLost(KVServiceError):
    """Why a link was dropped on discovery's word (its lease lapsed, it restarted)."""


class Discovery:
    """A started service's discovery (``discovery = "etcd"``)."""

    def __init__(self, svc: TransferService) -> None:
        self._svc = svc
        self.incarnation = incarnation()
        self.started_at = time.time()
        self.registry = Registry(svc.config.discovery_settings, self.member, self._lost, svc.stats)

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Registered once this returns (or raises, ``etcd_unreachable = "fail"``)."""
        await tg.start(self.registry.run)

    def member(self) -> Member:
        """What this service registers (read at each keep-alive: a status snapshot is cheap)."""
        svc = self._svc
        memory = svc.memory
        status = svc.status()
        return Member(
            name=svc.config.discovery_name or svc.agent_name, address=svc.address, agent=svc.agent_name,
            incarnation=self.incarnation, role=svc.config.discovery_role,
            memory={"bytes": memory.nbytes, "pages": memory.num_pages, "regions": len(memory.regions)},
            started_at=self.started_at, linked=len(status["peers"]),
            inflight=status["sending"] + status["receiving"])

    def address_of(self, peer: str) -> str:
        """``peer`` as an address: a member's name resolves to where it registered; an
        address stays itself.  ``PeerUnknown`` for a name no live member has."""
        if ":" in peer:
            return peer
        address = self.registry.address_of(peer)
        if address is None:
            raise PeerUnknown(f"no live member named {peer!r} in cluster {self._svc.config.cluster!r}")
        split_address(address)
        return address

    def _lost(self, member: Member, why: str) -> None:
        self._svc.drop_agent(member.agent, MemberLost(why))
