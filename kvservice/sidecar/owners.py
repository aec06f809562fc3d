"""Request ids belong to the worker that started them.

Several workers share one sidecar, and so one ``TransferService``: without a
rule, any of them could abort, wait on, poll or continue another's request.
The rule: the first worker to use an id, by ``send`` or by ``expect``, owns the
id, both its sides; every other worker's call naming it, on either side,
raises ``NotOwnerError`` (counted as refused, kind ``not_owner``), and the
owner's request goes on untouched.  (Owning one side is owning both: a worker
refused on the receiving side cannot start the sending side of the same id and
then abort, or read, what the service holds under it.)

Ownership lives as long as anything it guards: while either side's request is
live, and after both ended for as long as the service remembers the id (either
side's result among its ``service.results_kept`` most recent, or a sticky
failure: ``TransferService.remembers``), so nobody else can read an ended
request's result or reuse its id meanwhile.  It is asked, not counted here: the
two lifetimes cannot drift apart.  When a worker disconnects, the daemon aborts
its unfinished requests; its ids stay its own as long, and another worker
naming one is told that their owner left.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from .._results import KVServiceError

SEND, RECV = "send", "recv"
#: (side, request id)
Key = tuple[str, str]
#: ids looked at (and forgotten if the service has) per request that ends: the ended
#: ones held stay within twice what the service remembers
_PRUNE_STEPS = 2


class NotOwnerError(KVServiceError):
    """A worker named a request id that another worker of the same sidecar started.

    Raised (through ``SidecarClient``) by the call naming it; nothing changed.  Request
    ids must be unique across the workers sharing a sidecar."""


@dataclass
class _Owned:
    conn: int
    used: set[str] = field(default_factory=set)  # sides this id was started on
    live: set[str] = field(default_factory=set)  # of those, the ones not ended


class Owners:
    """Who owns each request id; ``remembers(id)``: whether the service still holds
    anything of it (ended ids are owned exactly that long)."""

    def __init__(self, remembers: Callable[[str], bool]) -> None:
        self._remembers = remembers
        self._ids: dict[str, _Owned] = {}
        self._by_conn: dict[int, set[str]] = {}  # connected worker -> its ids with a live side
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()  # no live side, oldest first

    def connected(self, conn: int) -> None:
        self._by_conn[conn] = set()

    def owner(self, request_id: str) -> int | None:
        rec = self._ids.get(request_id)
        if rec is None:
            return None
        if not rec.live and not self._remembers(request_id):
            self._forget(request_id)
            return None
        return rec.conn

    def check(self, conn: int, request_id: str) -> None:
        """Raise ``NotOwnerError`` unless ``conn`` owns ``request_id`` or nobody does."""
        owner = self.owner(request_id)
        if owner is None or owner == conn:
            return
        raise NotOwnerError(
            f"request {request_id!r} belongs to another worker of this sidecar"
            + (", which disconnected (its unfinished requests were aborted)" if owner not in self._by_conn else ""))

    def claim(self, conn: int, key: Key) -> bool:
        """``conn`` starts ``key``'s side of its id (owning the id if nobody did); True the
        first time that side is started.  Raises ``NotOwnerError`` if another worker owns it."""
        side, rid = key
        self.check(conn, rid)
        rec = self._ids.setdefault(rid, _Owned(conn))
        if side in rec.used:
            return False
        rec.used.add(side)
        rec.live.add(side)
        self._by_conn[conn].add(rid)
        self._ended.pop(rid, None)
        return True

    def unclaim(self, key: Key) -> None:
        """Undo a ``claim`` (that returned True) whose call registered nothing."""
        side, rid = key
        rec = self._ids.get(rid)
        if rec is None:
            return
        rec.used.discard(side)
        rec.live.discard(side)
        if not rec.used:
            self._forget(rid)
        elif not rec.live:
            self._end(rid, rec)

    def ended(self, key: Key) -> None:
        """The request behind ``key`` has ended: its id stays owned while the service remembers it."""
        side, rid = key
        rec = self._ids.get(rid)
        if rec is not None and side in rec.live:
            rec.live.discard(side)
            if not rec.live:
                self._end(rid, rec)

    def disconnected(self, conn: int) -> list[Key]:
        """``conn`` is gone: the keys it owned that had not ended (to abort), now ended."""
        keys: list[Key] = []
        for rid in sorted(self._by_conn.pop(conn, set())):
            rec = self._ids[rid]
            keys += [(side, rid) for side in sorted(rec.live)]
            rec.live.clear()
            self._end(rid, rec)
        return keys

    def __len__(self) -> int:
        """Ids owned, live or ended (ended ones the service forgot included until pruned)."""
        return len(self._ids)

    def _end(self, rid: str, rec: _Owned) -> None:
        owned = self._by_conn.get(rec.conn)
        if owned is not None:
            owned.discard(rid)
        self._ended[rid] = None
        self._prune()

    def _forget(self, rid: str) -> None:
        rec = self._ids.pop(rid)
        owned = self._by_conn.get(rec.conn)
        if owned is not None:
            owned.discard(rid)
        self._ended.pop(rid, None)

    def _prune(self) -> None:
        """Forget the oldest ended ids the service no longer remembers; one it still
        does goes to the back of the line (a settlement can keep it longer)."""
        for _ in range(_PRUNE_STEPS):
            if not self._ended:
                return
            rid = next(iter(self._ended))
            if self._remembers(rid):
                self._ended.move_to_end(rid)
            else:
                self._forget(rid)
