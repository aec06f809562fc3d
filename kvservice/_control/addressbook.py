"""Which linked agent answers at which address: proven, never claimed.

The address in a peer's ``Hello`` is a claim.  An address names an agent here only
when this service dialled it and authenticated that agent there, or probed the
address a peer claims (``Hello(probe=True)``: whoever listens there proves who it
is over our fresh nonce, and hangs up) and found that same agent answering.  One
probe per (agent, address) for the life of its link: concurrent askers share it,
and the answer, either way, is remembered until the link ends.

When a proof (or a dial) finds agent B at an address agent A was proven at, A no
longer answers there, and the address names B from then on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from .._log import get_logger
from .addresses import literal_canonical, resolve_canonical

log = get_logger("kvservice.control")

#: canonical forms remembered for addresses the engine named (cleared when exceeded)
_CANON_CACHE = 4096


@dataclass(eq=False, slots=True)
class _Entry:
    """One linked agent's addresses (a new link, a new entry)."""

    claimed: str  # the canonical form of the address its Hello claims
    proven: set[str] = field(default_factory=set)
    disproven: set[str] = field(default_factory=set)  # another agent, or nobody, answered there
    taken: set[str] = field(default_factory=set)  # of those, where another agent answered


class AddressBook:
    def __init__(self, probe: Callable[[str], Awaitable[str]]) -> None:
        self._probe = probe  # the agent answering at an address now (raises when none can be had)
        self._entries: dict[str, _Entry] = {}  # linked agent -> its addresses
        self._by_addr: dict[str, str] = {}  # proven canonical address -> agent
        self._proofs: dict[tuple[str, str], anyio.Event] = {}  # (agent, canonical) -> proof in progress
        self._canon: dict[str, str] = {}  # address as named by the engine -> canonical

    def known(self, address: str) -> str | None:
        """``address``'s canonical form if ``canonical`` has it already (no resolving)."""
        return self._canon.get(address)

    async def canonical(self, address: str) -> str:
        """``address``'s canonical form (resolved once per spelling); ``ValueError`` if malformed,
        ``OSError`` if its name does not resolve."""
        canon = self._canon.get(address)
        if canon is None:
            canon = literal_canonical(address) or await resolve_canonical(address)
            if len(self._canon) >= _CANON_CACHE:
                self._canon.clear()
            self._canon[address] = canon
        return canon

    # -- the table ----------------------------------------------------------------------
    def linked(self, agent: str, claimed: str, dialled: str | None) -> None:
        """``agent`` has a new link; its Hello claimed ``claimed``; ``dialled``: the address we
        dialled and authenticated it at (proven)."""
        self.unlinked(agent)
        self._entries[agent] = _Entry(claimed)
        if dialled is not None:
            self._bind(agent, dialled)

    def unlinked(self, agent: str) -> frozenset[str]:
        """``agent``'s link ended: forget its addresses; those it was proven at."""
        entry = self._entries.pop(agent, None)
        if entry is None:
            return frozenset()
        for canon in entry.proven:
            if self._by_addr.get(canon) == agent:
                del self._by_addr[canon]
        return frozenset(entry.proven)

    def agent_at(self, canon: str) -> str | None:
        """The agent proven at ``canon``, if any."""
        return self._by_addr.get(canon)

    def claimant(self, canon: str) -> str | None:
        """A linked agent that claims ``canon`` and was not found elsewhere (worth one probe)."""
        return next((agent for agent, e in self._entries.items()
                     if e.claimed == canon and canon not in e.disproven), None)

    def unproven_claim(self, agent: str) -> str | None:
        """``agent``'s claimed address while nothing is known of it either way."""
        entry = self._entries.get(agent)
        if entry is None or entry.claimed in entry.proven or entry.claimed in entry.disproven:
            return None
        return entry.claimed

    def open_claim(self, agent: str) -> str | None:
        """``agent``'s claimed address unless it is proven there or another agent answered
        there: where else to look for it once it is lost (a proof that failed unanswered, the
        agent stopped or cut off meanwhile, leaves it open)."""
        entry = self._entries.get(agent)
        if entry is None or entry.claimed in entry.proven or entry.claimed in entry.taken:
            return None
        return entry.claimed

    def at(self, agent: str, canon: str) -> bool | None:
        """Whether linked ``agent`` is proven to answer at ``canon``: True, False (another
        agent answered there, or it is not linked), or None (not known yet: ``prove``)."""
        entry = self._entries.get(agent)
        if entry is None or canon in entry.disproven:
            return False
        return True if canon in entry.proven else None

    def proven(self, agent: str) -> frozenset[str]:
        entry = self._entries.get(agent)
        return frozenset(entry.proven) if entry is not None else frozenset()

    # -- proof --------------------------------------------------------------------------
    async def prove(self, agent: str, canon: str) -> bool:
        """Whether ``agent`` answers at ``canon``: known, or found out by one probe."""
        entry = self._entries.get(agent)
        if entry is None:
            return False
        if canon in entry.proven or canon in entry.disproven:
            return canon in entry.proven
        key = (agent, canon)
        running = self._proofs.get(key)
        if running is not None:
            await running.wait()
        else:
            done = self._proofs[key] = anyio.Event()
            try:
                try:
                    answered: str | None = await self._probe(canon)
                except Exception as exc:  # noqa: BLE001 - unproven, whatever the reason
                    answered = None
                    log.info("peer.address_unproven", agent=agent, address=canon, error=str(exc) or repr(exc))
                if self._entries.get(agent) is entry:  # the same link: the answer is about it
                    if answered == agent:
                        self._bind(agent, canon)
                    else:
                        entry.disproven.add(canon)
                        if answered is not None:
                            entry.taken.add(canon)
                            log.warning("peer.address_claim_false", agent=agent, address=canon, answered=answered)
            finally:
                del self._proofs[key]
                done.set()
        return self.at(agent, canon) is True

    def _bind(self, agent: str, canon: str) -> None:
        """``canon`` is proven to be ``agent``'s now: whoever it named before no longer answers there."""
        old = self._by_addr.get(canon)
        if old is not None and old != agent and (prior := self._entries.get(old)) is not None:
            prior.proven.discard(canon)
        self._entries[agent].proven.add(canon)
        self._by_addr[canon] = agent
