"""Expects that arrived before the matching ``send()``: held, bounded, charged to their source.

A peer may announce requests this side has not sent yet (the normal race), but
not without limit.  Each bound refuses the Expect that would pass it (nothing is
stored) and says which:

* per peer (an agent): ``per_peer`` entries, ``pages_per_peer`` pages;
* per source (the member its link proved, else the IP address its link comes from:
  ``ControlPlane.source_of``): ``per_source`` entries, ``pages_per_source`` pages, for
  all its agents together.  A key holder mints agent names for nothing (one NIXL
  agent's metadata renamed four times filled the total in seconds and every decode's
  early Expect was refused); a member identity or an address it cannot mint, so a
  source holds at most its share and the others keep the rest;
* in total: ``pages_total`` pages.

An entry older than ``ttl`` is dropped by ``expire``.  Several peers may announce
the same id: each entry is its own, and which one binds is the service's choice
(the pinned receiver, else the first).  Entries are kept in arrival order, so
expiry looks only at the oldest.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from .._config import ServiceConfig
from ..memory._layout import PageIndex

__all__ = ["PEER_LIMIT", "SOURCE_LIMIT", "EarlyExpects", "ExpectRefused"]

#: refusal kinds (``Stats.refuse``): a peer's or the total bound; a source's share
PEER_LIMIT, SOURCE_LIMIT = "unknown_expect_limit", "unknown_expect_source_limit"


@dataclass(frozen=True, slots=True)
class ExpectRefused:
    kind: str  # PEER_LIMIT or SOURCE_LIMIT
    why: str  # which bound, with its key and value


@dataclass(slots=True)
class _Entry:
    pages: PageIndex
    arrived: float
    source: str
    verify: bool = False  # it asks for landing checks (``_transfer.landing``)


class EarlyExpects:
    """The held Expects; see the module docstring for the bounds."""

    def __init__(self, per_peer: int, ttl: float, pages_per_peer: int, pages_total: int, *,
                 per_source: int | None = None, pages_per_source: int | None = None) -> None:
        self._per_peer = per_peer
        self._ttl = ttl
        self._pages_per_peer = pages_per_peer
        self._pages_total = pages_total
        self._per_source = per_source
        self._pages_per_source = pages_per_source
        self._d: dict[tuple[str, str], _Entry] = {}  # (rid, agent) -> its entry
        self._by_rid: dict[str, list[str]] = {}  # rid -> agents, in arrival order
        self._count: collections.Counter[str] = collections.Counter()
        self._pages: collections.Counter[str] = collections.Counter()
        self._source_count: collections.Counter[str] = collections.Counter()
        self._source_pages: collections.Counter[str] = collections.Counter()
        self.pages = 0  # held for all peers

    @classmethod
    def configured(cls, cfg: ServiceConfig) -> EarlyExpects:
        """The bounds ``cfg`` names (``max_unknown_expect*``, ``unknown_expect_ttl_s``)."""
        return cls(cfg.max_unknown_expects, cfg.unknown_expect_ttl_s, cfg.max_unknown_expect_pages,
                   cfg.max_unknown_expect_pages_total, per_source=cfg.max_unknown_expects_per_source,
                   pages_per_source=cfg.max_unknown_expect_pages_per_source)

    def add(self, rid: str, agent: str, pages: PageIndex, now: float, source: str = "-",
            verify: bool = False) -> ExpectRefused | None:
        """Remember ``agent``'s Expect (its link comes from ``source``; ``verify``: it asks
        for landing checks); if a bound stops it, which one (nothing is stored)."""
        n = int(pages.size)
        if self._count[agent] >= self._per_peer:
            return ExpectRefused(PEER_LIMIT, f"{self._count[agent]} expects held for requests not sent yet "
                                             f"(max_unknown_expects)")
        if self._pages[agent] + n > self._pages_per_peer:
            return ExpectRefused(PEER_LIMIT, f"{self._pages[agent]} pages held for expects not sent yet, {n} more "
                                             f"exceed max_unknown_expect_pages ({self._pages_per_peer})")
        if self._per_source is not None and self._source_count[source] >= self._per_source:
            return ExpectRefused(SOURCE_LIMIT, f"{self._source_count[source]} expects held for peers from {source} "
                                               f"(max_unknown_expects_per_source = {self._per_source})")
        held = self._source_pages[source]
        if self._pages_per_source is not None and held + n > self._pages_per_source:
            return ExpectRefused(SOURCE_LIMIT, f"{held} pages held for peers from {source}, {n} more exceed "
                                               f"max_unknown_expect_pages_per_source ({self._pages_per_source})")
        if self.pages + n > self._pages_total:
            return ExpectRefused(PEER_LIMIT, f"{self.pages} pages held for all peers' expects not sent yet, {n} "
                                             f"more exceed max_unknown_expect_pages_total ({self._pages_total})")
        self._d[(rid, agent)] = _Entry(pages, now, source, verify)
        self._by_rid.setdefault(rid, []).append(agent)
        self._count[agent] += 1
        self._pages[agent] += n
        self._source_count[source] += 1
        self._source_pages[source] += n
        self.pages += n
        return None

    def agents(self, rid: str) -> list[str]:
        """The peers that expect ``rid``, first come first."""
        return list(self._by_rid.get(rid, ()))

    def has(self, rid: str, agent: str) -> bool:
        return (rid, agent) in self._d

    def pages_of(self, rid: str, agent: str) -> PageIndex | None:
        entry = self._d.get((rid, agent))
        return entry.pages if entry is not None else None

    def verifies(self, rid: str, agent: str) -> bool:
        """Whether ``agent``'s Expect for ``rid`` asks for landing checks."""
        entry = self._d.get((rid, agent))
        return entry is not None and entry.verify

    def held_by_source(self, source: str) -> tuple[int, int]:
        """The entries and pages held for peers from ``source``."""
        return self._source_count[source], self._source_pages[source]

    def pop(self, rid: str, agent: str) -> PageIndex | None:
        entry = self._d.pop((rid, agent), None)
        if entry is None:
            return None
        self._forget(rid, agent, entry)
        return entry.pages

    def drop_peer(self, agent: str) -> list[str]:
        """Forget ``agent``'s entries; their request ids."""
        rids = [rid for (rid, a) in self._d if a == agent]
        for rid in rids:
            self.pop(rid, agent)
        return rids

    def expire(self, now: float) -> list[tuple[str, str]]:
        """Drop entries older than ``ttl``: their (request id, agent)."""
        gone: list[tuple[str, str]] = []
        while self._d:
            (rid, agent), entry = next(iter(self._d.items()))
            if now - entry.arrived < self._ttl:
                break
            del self._d[(rid, agent)]
            self._forget(rid, agent, entry)
            gone.append((rid, agent))
        return gone

    def _forget(self, rid: str, agent: str, entry: _Entry) -> None:
        agents = self._by_rid[rid]
        agents.remove(agent)
        if not agents:
            del self._by_rid[rid]
        n = int(entry.pages.size)
        self.pages -= n
        _take(self._count, agent, 1)
        _take(self._pages, agent, n)
        _take(self._source_count, entry.source, 1)
        _take(self._source_pages, entry.source, n)

    def __contains__(self, rid: object) -> bool:
        return rid in self._by_rid

    def __len__(self) -> int:
        return len(self._d)


def _take(counter: collections.Counter[str], key: str, n: int) -> None:
    """Count ``n`` fewer for ``key``; a key at zero is forgotten (no table of every agent or
    source ever seen)."""
    left = counter[key] - n
    if left > 0:
        counter[key] = left
    else:
        del counter[key]
