"""``Results``: the results of a side's most recent ended requests, kept for look-ups
after the end (``await_arrival`` of an ended request, a late ``send``, a peer's
question), the oldest falling out past ``results_kept``.

A success is kept as a plain tuple of its fields (its status as its value) and made a
``TransferResult`` again when looked up.  Why: a service keeps up to ``results_kept``
(10,000) of them per side, and every full cyclic-GC collection walks every object it
tracks.  A ``TransferResult`` is such an object, and its fields point at distinct
strings and floats the collector reads in turn; a tuple of those plain values is one
the collector stops tracking at its first collection.  Measured with 10,000 kept: a
full collection's CPU 1.40 ms more with results, 0.16 ms with tuples.  A look-up
builds a new, equal ``TransferResult``.  A failure is kept as it is, the same object
on every look-up (a sticky failure's later ``send`` calls hand it out): failures are
few, and one holding its error would stay tracked as a tuple too.
"""

from __future__ import annotations

from collections.abc import Iterator

from .._results import FailureReason, TransferResult, TransferStatus
from .requests import Recent

#: a result's fields, in ``TransferResult``'s order, its status and reason as their values
Packed = tuple[str, str, str | None, BaseException | None, str, str | None, int, int, float,
               float | None, float, bool, bytes | None]

_STATUS = {s.value: s for s in TransferStatus}
_REASON = {r.value: r for r in FailureReason}


def pack(r: TransferResult) -> Packed:
    return (r.request_id, r.status.value, None if r.reason is None else r.reason.value, r.error, r.message,
            r.peer, r.bytes, r.pages, r.created_at, r.started_at, r.finished_at, r.settled, r.payload)


def unpack(p: Packed) -> TransferResult:
    rid, status, reason, error, message, peer, nbytes, pages, created, started, finished, settled, payload = p
    return TransferResult(request_id=rid, status=_STATUS[status], reason=None if reason is None else _REASON[reason],
                          error=error, message=message, peer=peer, bytes=nbytes, pages=pages, created_at=created,
                          started_at=started, finished_at=finished, settled=settled, payload=payload)


class Results:
    """A bounded, insertion-ordered map of request id -> result: a ``requests.Recent`` of
    packed successes and failures as they are."""

    def __init__(self, capacity: int) -> None:
        self._kept: Recent[str, Packed | TransferResult] = Recent(capacity)

    def put(self, request_id: str, result: TransferResult) -> None:
        self._kept.put(request_id, pack(result) if result.ok else result)

    def get(self, request_id: str) -> TransferResult | None:
        p = self._kept.get(request_id)
        return unpack(p) if isinstance(p, tuple) else p

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._kept

    def __len__(self) -> int:
        return len(self._kept)

    def __iter__(self) -> Iterator[str]:
        """The request ids whose results are kept, oldest first."""
        return iter(self._kept)
