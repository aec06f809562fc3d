"""Live requests ordered by deadline, so the watchdog's scan costs what is due, not what is live.

The scan runs every ``DEADLINE_SCAN_S`` (10 ms).  Walking every live request
each time cost ~80 us per scan with 1,000 requests expected on a receiver, and
grows with the in-flight count; a heap answers "anything due?" by looking at
its top.

Each request has one entry that counts, its newest: a deadline that moves gets a
new entry (``push``), and the one before it no longer names the request.  A request
that ends lets go of its entry at once (``discard``): its heap pair stays behind,
naming nobody, but nothing here keeps the request alive, so refcounting frees it
(and what it holds) as soon as its caller lets go, instead of the cyclic GC walking
it, thousands of ended requests at a time, until its entry pops.  A popped entry is
checked against its request: a deadline that moved later is filed again.  So the
heap may hold a few pairs per live request plus those of ended ones.

Its size is bounded at every step, not only when someone tidies it: the requests
filed (``_filed``) are live ones (a request that ends is discarded at once), and
whenever a ``push``, ``discard`` or ``pop_due`` leaves more than
``SLACK * filed + FLOOR`` pairs, the heap is rebuilt from them at once.  A rebuild
costs O(filed) and leaves one pair per filed request, and at least
``(filed + FLOOR) / SLACK`` more calls must pass before the next, so each call stays
O(1) amortised (plus the heap's log).  The bound is an invariant that anyone may
check between any two calls (the soak's probe does).

The heap holds ``(deadline, number)`` pairs and the requests sit in a dict by that
number: a pair of a float and an int is a tuple the cyclic GC stops tracking after
its first collection, where a tuple holding the request would be walked by every
full collection, one per live request.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, Protocol, TypeVar


class Timed(Protocol):
    @property
    def finished(self) -> bool: ...

    def due_at(self) -> float:
        """When this request times out, as things stand now (``time.monotonic()``)."""


R = TypeVar("R", bound=Timed)


class Deadlines(Generic[R]):
    #: rebuild when the heap exceeds ``SLACK * live + FLOOR`` entries
    SLACK = 2
    FLOOR = 256

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []
        self._filed: dict[int, R] = {}  # each request's newest entry: its number -> the request
        self._newest: dict[int, int] = {}  # id() of each request in ``_filed`` -> its entry's number
        self._seq = itertools.count()  # ties break by insertion, never by comparing requests

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, req: R) -> None:
        """File ``req`` at its current ``due_at()``.  Call again whenever that moves."""
        n = next(self._seq)
        old = self._newest.get(id(req))
        if old is not None:  # that entry's pair stays in the heap, naming nobody
            del self._filed[old]
        self._newest[id(req)] = n
        self._filed[n] = req
        heapq.heappush(self._heap, (req.due_at(), n))
        self._fit()

    def discard(self, req: R) -> None:
        """``req`` has ended: hold it no longer (its pair in the heap names nobody now)."""
        n = self._newest.pop(id(req), None)
        if n is not None:
            del self._filed[n]
            self._fit()

    def pop_due(self, now: float) -> list[R]:
        """Live requests whose deadline is before ``now``, each once, earliest first."""
        due: list[R] = []
        heap = self._heap
        while heap and heap[0][0] < now:
            req = self._filed.pop(heapq.heappop(heap)[1], None)
            if req is None:  # superseded by a newer entry, or its request was discarded
                continue
            del self._newest[id(req)]
            if req.finished:
                continue
            if req.due_at() < now:
                due.append(req)
            else:  # its deadline moved later since this entry was filed
                self.push(req)
        self._fit()
        return due

    def next_due(self) -> float | None:
        """The earliest deadline filed, None if none: a request's own, or earlier where it
        moved later since (``pop_due`` then files it again).  Pairs naming nobody on top of the
        heap are dropped on the way."""
        heap = self._heap
        while heap and heap[0][1] not in self._filed:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    @property
    def bound(self) -> int:
        """The most pairs the heap holds between any two calls: ``SLACK * filed + FLOOR``."""
        return self.SLACK * len(self._filed) + self.FLOOR

    def _fit(self) -> None:
        """Rebuild the heap from the filed requests once it is past ``bound``."""
        if len(self._heap) > self.bound:
            # in place: ``pop_due`` may be walking this list while it re-files a request
            self._heap[:] = [(req.due_at(), n) for n, req in self._filed.items()]
            heapq.heapify(self._heap)
