"""Live requests ordered by deadline, so the watchdog's scan costs what is due, not what is live.

The scan runs every ``DEADLINE_SCAN_S`` (10 ms).  Walking every live request
each time cost ~80 us per scan with 1,000 requests expected on a receiver, and
grows with the in-flight count; a heap answers "anything due?" by looking at
its top.

Entries are never removed eagerly.  A deadline that moves gets a new entry
(``push``); a popped entry is checked against its request: ended requests are
dropped, a deadline that moved later is filed again.  So the heap may hold a
few entries per live request plus those of ended ones; ``compact`` rebuilds it
from the live set once the ended outnumber the live, which bounds its size by
O(live) and keeps no ended request alive for long.

The heap holds ``(deadline, number)`` pairs and the requests sit in a dict by that
number: a pair of a float and an int is a tuple the cyclic GC stops tracking after
its first collection, where a tuple holding the request would be walked by every
full collection, one per live request.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
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
        self._filed: dict[int, R] = {}  # each entry's request, by the entry's number
        self._seq = itertools.count()  # ties break by insertion, never by comparing requests

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, req: R) -> None:
        """File ``req`` at its current ``due_at()``.  Call again whenever that moves."""
        n = next(self._seq)
        self._filed[n] = req
        heapq.heappush(self._heap, (req.due_at(), n))

    def pop_due(self, now: float) -> list[R]:
        """Live requests whose deadline is before ``now``, each once, earliest first."""
        due: list[R] = []
        seen: set[int] = set()  # a request may have several entries
        heap = self._heap
        while heap and heap[0][0] < now:
            req = self._filed.pop(heapq.heappop(heap)[1])
            if req.finished or id(req) in seen:
                continue
            if req.due_at() < now:
                due.append(req)
                seen.add(id(req))
            else:  # its deadline moved later since this entry was filed
                self.push(req)
        return due

    def compact(self, live: Iterable[R], nlive: int) -> None:
        """Rebuild from ``live`` (``nlive`` of them) if ended entries dominate."""
        if len(self._heap) > self.SLACK * nlive + self.FLOOR:
            self._heap, self._filed = [], {}
            for req in live:
                n = next(self._seq)
                self._filed[n] = req
                self._heap.append((req.due_at(), n))
            heapq.heapify(self._heap)
