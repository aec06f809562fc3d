"""Sources whose metadata cost a vetting child: refused for a while, then vetted apart.

A Join whose metadata kills the vetting child (UCX aborted on it) or taints it
(NIXL refused it, and a refused load may leave state behind) costs that child: it
is replaced, ~2 s of CPU and a start every first link in the meantime waits for.
Agent names cost a key holder nothing, so each such Join is charged to the one
thing it cannot mint, its source (the IP address its connection comes from):

* after the first, its metadata is vetted on a child of its own (``MetadataVetter``'s
  second lane), never again on the one other peers' first links are vetted on;
* after each further one, its Joins are refused (``VETTING_BACKOFF``) for a
  backoff that doubles with each, from ``base_s`` up to ``max_s``.  (Not after
  the first: peers of one host share its source, and on loopback every peer is
  one source, so one incident does not lock the honest ones out);
* a cost the network may have caused rather than the bytes (``escalate=False``:
  NIXL refusing the load, whose connect to the peer failed, as for a peer cut off
  mid-handshake; or a load that hung) escalates only when it follows the source's
  last charge within ``window_s``: a peer whose handshakes a flaky network breaks
  now and then stays vetted apart, never refused, and one that costs the child
  again and again backs off as above;
* a source with nothing charged for ``2 * max_s`` is forgotten, and at most
  ``remembered`` sources are kept (the oldest charged goes first).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

__all__ = ["BACKOFF_MAX_S", "BACKOFF_S", "NETWORK_WINDOW_S", "Strikes"]

#: the first backoff: about what a child's start costs here (benchmarks/vetting_cost.py)
BACKOFF_S = 2.0
BACKOFF_MAX_S = 300.0
#: a cost the network may have caused escalates only this soon (seconds) after the last charge
NETWORK_WINDOW_S = 60.0
REMEMBERED_SOURCES = 4096


@dataclass(slots=True)
class _Record:
    strikes: int
    until: float  # refused before this (monotonic seconds)
    last: float  # when it was last charged


class Strikes:
    """The table; see the module docstring for the policy."""

    def __init__(self, base_s: float = BACKOFF_S, max_s: float = BACKOFF_MAX_S,
                 remembered: int = REMEMBERED_SOURCES, window_s: float = NETWORK_WINDOW_S) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.window_s = window_s
        self._remembered = remembered
        self._d: collections.OrderedDict[str, _Record] = collections.OrderedDict()  # oldest charged first

    def charge(self, source: str, now: float, *, escalate: bool = True) -> tuple[int, float]:
        """``source``'s metadata cost a child at ``now``: its strikes and its backoff (s) now.
        ``escalate=False``: the network may be to blame, so a source with a strike already
        gets none more (it stays vetted apart, its backoff as it was) unless its last charge
        was less than ``window_s`` ago."""
        record = self._get(source, now)
        if record is not None and not escalate and now - record.last >= self.window_s:
            record.last = now
            self._d.move_to_end(source)
            return record.strikes, max(0.0, record.until - now)
        strikes = 1 if record is None else record.strikes + 1
        backoff = 0.0 if strikes == 1 else min(self.base_s * 2 ** min(strikes - 2, 32), self.max_s)
        self._d[source] = _Record(strikes, now + backoff, now)
        self._d.move_to_end(source)
        while len(self._d) > self._remembered:
            self._d.popitem(last=False)
        return strikes, backoff

    def refused(self, source: str, now: float) -> tuple[int, float] | None:
        """While ``source`` backs off: its strikes and the seconds left; else ``None``."""
        record = self._get(source, now)
        if record is None or now >= record.until:
            return None
        return record.strikes, record.until - now

    def count(self, source: str, now: float) -> int:
        """``source``'s strikes (0: none, or forgotten)."""
        record = self._get(source, now)
        return 0 if record is None else record.strikes

    def struck(self, source: str, now: float) -> bool:
        """Whether ``source`` is charged with any (then its metadata is vetted apart)."""
        return self._get(source, now) is not None

    def _get(self, source: str, now: float) -> _Record | None:
        record = self._d.get(source)
        if record is not None and now - record.last >= 2 * self.max_s:
            del self._d[source]
            return None
        return record

    def __len__(self) -> int:
        return len(self._d)
