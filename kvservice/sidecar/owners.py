"""Request ids belong to the worker that started them.

Several workers share one sidecar, and so one ``TransferService``: without a
rule, any of them could abort, wait on, poll or continue another's request.
The rule: the first worker to ``send`` an id owns its sending side, the first
to ``expect`` it its receiving side; every other worker's call naming that side
raises ``NotOwnerError`` (counted as refused, kind ``not_owner``), and the
owner's request goes on untouched.  ``abort`` names both sides: it is allowed
to a worker owning either, refused when another worker owns one and the caller
neither.

Ownership outlives the request for as long as the daemon remembers results
(``service.results_kept`` ended requests, the most recent), so nobody else can
read an ended request's result or reuse its id meanwhile.  When a worker
disconnects, the daemon aborts its unfinished requests; its ids stay its own,
and another worker naming one is told that their owner left.
"""

from __future__ import annotations

from collections.abc import Iterable

from .._requests import Recent
from .._results import KVServiceError

SEND, RECV = "send", "recv"
#: (side, request id)
Key = tuple[str, str]


class NotOwnerError(KVServiceError):
    """A worker named a request id that another worker of the same sidecar started."""


class Owners:
    """Who owns each request id's sides: live requests always, ended ones while ``kept``."""

    def __init__(self, kept: int) -> None:
        self._live: dict[Key, int] = {}
        self._by_conn: dict[int, set[Key]] = {}
        self._ended: Recent[Key, int] = Recent(kept)

    def connected(self, conn: int) -> None:
        self._by_conn[conn] = set()

    def owner(self, key: Key) -> int | None:
        owner = self._live.get(key)
        return self._ended.get(key) if owner is None else owner

    def check(self, conn: int, request_id: str, sides: Iterable[str]) -> None:
        """Raise ``NotOwnerError`` unless ``conn`` owns one of ``sides`` of ``request_id``
        or nobody owns any of them."""
        owners = {o for side in sides if (o := self.owner((side, request_id))) is not None}
        if not owners or conn in owners:
            return
        left = all(o not in self._by_conn for o in owners)
        raise NotOwnerError(
            f"request {request_id!r} belongs to another worker of this sidecar"
            + (", which disconnected (its unfinished requests were aborted)" if left else ""))

    def claim(self, conn: int, key: Key) -> bool:
        """Make ``conn`` the owner of ``key`` unless someone is; True if it was nobody's."""
        if self.owner(key) is not None:
            return False
        self._live[key] = conn
        self._by_conn[conn].add(key)
        return True

    def unclaim(self, key: Key) -> None:
        """Undo a ``claim`` whose call registered nothing."""
        conn = self._live.pop(key, None)
        if conn is not None:
            self._by_conn[conn].discard(key)

    def ended(self, key: Key) -> None:
        """The request behind ``key`` has ended: keep its owner as long as results are kept."""
        conn = self._live.pop(key, None)
        if conn is not None:
            self._by_conn[conn].discard(key)
            self._ended.put(key, conn)

    def disconnected(self, conn: int) -> list[Key]:
        """``conn`` is gone: the keys it owned that had not ended (to abort), now ended."""
        keys = sorted(self._by_conn.pop(conn, set()))
        for key in keys:
            self._live.pop(key, None)
            self._ended.put(key, conn)
        return keys
