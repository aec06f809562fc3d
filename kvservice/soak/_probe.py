"""What a service holds now, table by table: the soak's leak accounting reads it in each
child (the ``tables`` command of ``kvservice.testing.peer``) every sample.

``status()`` already says what an operator polls (requests live, early expects, unsettled
pages, handles, linked peers); this adds the tables behind it that a long run could grow:
kept results, per-agent ledgers, the NIXL door's loaded remote agents.  It reads private
state by name, so it lives beside the soak and nowhere else: a table renamed or removed
under it reads as ``None`` (shown as "gone" in the leak table) rather than failing a soak,
and ``tests/system/test_soak.py`` fails on any ``None`` so a rename is seen.

Each table is a ``Table``: its size now and, where the code bounds it, its capacity.  A
table with a capacity cannot grow without bound; the leak verdict checks it stays within
it instead of judging its slope (``_leaks``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict

from .._nixl.agent import KEPT_MAX
from .._transfer.drain import MAX_LET_GO


class Table(TypedDict):
    size: int | None  #: entries now; None if the probe found no such table (renamed, removed)
    cap: int | None  #: the most it may hold, where the code bounds it


#: each table the probe reads, with one line on what it holds (the leak table's legend)
TABLES: dict[str, str] = {
    "requests": "live sends and receives",
    "deadlines": "requests with a deadline armed",
    "results": "finished requests' results kept for late callers (sends + receives)",
    "dropped": "ids of requests dropped, kept to answer late messages",
    "done_peers": "finished requests' peers",
    "early_expects": "expects held for a send() not made yet",
    "settle_held": "failed receives whose pages a sender may still write (the settle ledger)",
    "settle_waiters": "await_settled() callers waiting",
    "proving": "requests whose proof of no more WRITEs is being asked for",
    "proofs_unproven": "sends whose end could not be proven to their receiver (the proofs ledger)",
    "proofs_incomplete": "receiver agents whose unproven list overflowed",
    "heal_answered": "agents whose Ask was answered (heal)",
    "heal_lost": "agents lost with requests to prove (heal)",
    "drain_agents": "receiver agents with a drain deadline or waiter (watchdog)",
    "fences_forgotten": "agents whose settle fences were forgotten, on the ticks in flight (watchdog)",
    "peers": "linked peers (control plane)",
    "address_book": "linked agents' addresses (control plane)",
    "dials": "connections being dialled",
    "notif_in": "agents with notifications buffered before their link",
    "nixl_remote_agents": "remote agents loaded into the NIXL agent (the door)",
    "nixl_kept_agents": "remote agents kept loaded after their link was lost (the door)",
    "let_go": "handles of ended requests still checked for their proof (watchdog)",
    "nixl_live_handles": "NIXL transfer handles not yet released (the door)",
    "registry": "cluster members known and lapsed (etcd discovery only)",
}


def _read(fn: Callable[[], int], cap: Callable[[], int] | None = None) -> Table:
    try:
        size: int | None = int(fn())
    except AttributeError:
        size = None
    limit = None
    if cap is not None:
        try:
            limit = int(cap())
        except AttributeError:
            limit = None
    return Table(size=size, cap=limit)


def service_tables(service: Any) -> dict[str, Table]:
    """The size of every table in ``TABLES`` of ``service`` (a started ``TransferService``).
    Called on its event loop: nothing here awaits, so nothing changes while it reads."""
    p = service._plane
    if p is None:
        return {name: Table(size=None, cap=None) for name in TABLES}
    wd, ctl = p.watchdog, p.control
    heal = p.inbound._heal
    door = service._door
    disc = service._discovery
    out = {
        "requests": _read(lambda: len(p.sends) + len(p.recvs)),
        # a heap that keeps itself within SLACK x filed + FLOOR entries at every call, and the
        # requests filed are live ones (``_transfer.deadlines``): a bound true at any sample
        "deadlines": _read(lambda: len(p.deadlines),
                           lambda: p.deadlines.SLACK * (len(p.sends) + len(p.recvs)) + p.deadlines.FLOOR),
        "results": _read(lambda: len(p.sends_done) + len(p.recvs_done),
                         lambda: p.sends_done._kept._cap + p.recvs_done._kept._cap),
        "dropped": _read(lambda: len(p.dropped), lambda: p.dropped._cap),
        "done_peers": _read(lambda: len(p.done_peers), lambda: p.done_peers._cap),
        "early_expects": _read(lambda: len(p.early)),
        "settle_held": _read(lambda: len(p.settlement._held)),
        "settle_waiters": _read(lambda: len(p.settlement._waiters)),
        "proving": _read(lambda: len(p.proving)),
        "proofs_unproven": _read(lambda: len(wd.proofs),
                                 lambda: wd.proofs._per_agent * wd.proofs._agents),
        "proofs_incomplete": _read(lambda: len(wd.proofs._incomplete)),
        "heal_answered": _read(lambda: len(heal._answered), lambda: heal._answered._cap),
        "heal_lost": _read(lambda: len(heal._lost_at), lambda: heal._lost_at._cap),
        "drain_agents": _read(lambda: len(wd._drains.until.keys() | wd._drains.drained.keys())),
        "fences_forgotten": _read(lambda: sum(len(t.forgotten) for t in (wd._ahead, wd._queued) if t is not None)),
        "peers": _read(lambda: len(ctl._peers)),
        "address_book": _read(lambda: len(ctl._book._entries) + len(ctl._book._by_addr)),
        "dials": _read(lambda: len(ctl._dials)),
        "notif_in": _read(lambda: len(ctl._notif_in), lambda: ctl._notif_in._cap),
        "nixl_remote_agents": _read(lambda: len(door._peers)),
        "nixl_kept_agents": _read(lambda: door.kept_agents, lambda: KEPT_MAX),
        "let_go": _read(lambda: len(wd._drains._ended_with), lambda: MAX_LET_GO),
        "nixl_live_handles": _read(lambda: door.live_xfers()),
        # static discovery has no registry: none held, none can be
        "registry": (_read(lambda: disc.registry.status()["members"] + len(disc.registry.status()["lapsed"]))
                     if disc is not None else Table(size=0, cap=0)),
    }
    assert out.keys() == TABLES.keys()
    return out
