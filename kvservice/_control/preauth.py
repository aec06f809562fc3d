"""Pre-authentication slots: how many connections may be in their handshake, and whose.

Anyone who reaches the control port can open connections and say nothing; each
holds a slot until its handshake's deadline (``connect_timeout_s``).  Two bounds
keep one source from locking the others out:

* **per source** (``max_handshakes_per_source``): a source's connection beyond
  it is refused (``handshake_source_limit``);
* **in all** (``max_handshakes``): when every slot is held, a connection from a
  source holding fewer slots than the heaviest source takes the slot of that
  source's oldest handshake, which is ended (``handshake_evicted``); otherwise
  it is refused (``handshake_limit``).

So a source is refused for the pool being full only while it holds as many
slots as any other, and its handshakes are evicted only while it holds the
most: a source filling the pool (up to its bound, reopening what is closed)
cannot keep out one that holds fewer.  Among sources tied for the most, the one
whose oldest handshake is oldest loses it.

A source is what an address costs to have (``budget_key``): an IPv4 address; an
IPv6 address's /64 prefix, since a host is given a whole /64 (an IPv4-mapped IPv6
address counts as the IPv4 one); and, since every local process has all of
127.0.0.0/8, its addresses but 127.0.0.1 together as one.  127.0.0.1 (and ``::1``)
stays a source of its own: it is what a local dialer connects from unless it binds
another, so one host's peers keep their share, and a process that connects from
many loopback addresses holds two shares at most.  Anything without an address (a
Unix socket, an in-memory stream) counts as one source.  This is the budget before
the handshake only.  Once authenticated, a peer's use of the shared bounds
(``max_peers_per_source`` and the early-Expect bounds) is charged to what it proved
(``charged_to``): with member identities, its member, whatever addresses it links from,
so a member holds one share however many addresses and agent names it uses, and two
members behind one address each hold theirs; without one, its IP address (``source_of``).
"""

from __future__ import annotations

import collections
import ipaddress
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import anyio.abc

if TYPE_CHECKING:
    from .._trust.identity import Member

__all__ = ["EVICTED", "LIMIT", "SOURCE_LIMIT", "HandshakeSlots", "Slot", "budget_key", "charged_to", "source_of"]

#: refusal kinds (``Stats.refuse``, the ``Reject`` the connection gets)
LIMIT, SOURCE_LIMIT, EVICTED = "handshake_limit", "handshake_source_limit", "handshake_evicted"
#: the source of a stream with no remote IP address
NO_ADDRESS = "-"
#: one IPv6 host's addresses: the prefix a handshake's budget is charged to
V6_PREFIX = 64
#: the loopback addresses a local dialer does not connect from unless it binds them
_LOOPBACK_V4 = ipaddress.IPv4Network("127.0.0.0/8")
_LOCAL_DIALER = ipaddress.IPv4Address("127.0.0.1")

_order = itertools.count()


@dataclass(eq=False)
class Slot:
    """One connection's place in the handshake pool.  ``scope`` wraps its handshake:
    an eviction cancels it (``evicted`` then says why)."""

    source: str  # the budget it is charged to (``budget_key``)
    seq: int = field(default_factory=lambda: next(_order))
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    evicted: bool = False
    held: bool = True


def budget_key(source: str) -> str:
    """The source whose handshake budget a connection from ``source`` (``source_of``: an
    IP address, or ``NO_ADDRESS``) is charged to; see the module docstring."""
    try:
        ip = ipaddress.ip_address(source)
    except ValueError:
        return source
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.is_loopback:
            return str(ip)
        return str(ipaddress.IPv6Network((ip, V6_PREFIX), strict=False))
    if ip in _LOOPBACK_V4 and ip != _LOCAL_DIALER:
        return str(_LOOPBACK_V4)
    return str(ip)


class HandshakeSlots:
    """The pool; see the module docstring for the policy.  Sources are charged by
    ``budget_key``: callers pass the connection's ``source_of``."""

    def __init__(self, total: int, per_source: int) -> None:
        self.total = total
        self.per_source = per_source
        self._held = 0
        self._by_source: dict[str, collections.deque[Slot]] = {}  # each oldest first, never empty

    def __len__(self) -> int:
        return self._held

    def held_by(self, source: str) -> int:
        """Slots held by ``source``'s budget (``budget_key``)."""
        return len(self._by_source.get(budget_key(source), ()))

    def take(self, source: str) -> Slot | str:
        """A slot for a new connection from ``source``, or the refusal kind."""
        source = budget_key(source)
        mine = self.held_by(source)
        if mine >= self.per_source:
            return SOURCE_LIMIT
        if self._held >= self.total:
            heaviest = min(self._by_source.values(), key=lambda q: (-len(q), q[0].seq))
            if len(heaviest) <= mine:
                return LIMIT
            victim = heaviest[0]
            self.give_back(victim)
            victim.evicted = True
            victim.scope.cancel()
        slot = Slot(source)
        self._by_source.setdefault(source, collections.deque()).append(slot)
        self._held += 1
        return slot

    def give_back(self, slot: Slot) -> None:
        """The handshake ended (or was evicted); a second call does nothing."""
        if not slot.held:
            return
        slot.held = False
        self._held -= 1
        queue = self._by_source[slot.source]
        queue.remove(slot)  # at most per_source entries
        if not queue:
            del self._by_source[slot.source]


def source_of(stream: anyio.abc.ByteStream) -> str:
    """The remote IP address of ``stream`` (IPv4-mapped IPv6 as IPv4), else ``NO_ADDRESS``."""
    remote = stream.extra(anyio.abc.SocketAttribute.remote_address, None)
    if not isinstance(remote, tuple) or not remote or not isinstance(remote[0], str):
        return NO_ADDRESS
    try:
        ip = ipaddress.ip_address(remote[0].split("%", 1)[0])
    except ValueError:
        return NO_ADDRESS
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def charged_to(source: str, member: Member | None) -> str:
    """What a peer linked from ``source`` is charged to in the shared bounds: the member it
    proved (its URI), else ``source``.  Addresses and agent names cost a member nothing
    more: its share is its member's."""
    return member.uri if member is not None else source
