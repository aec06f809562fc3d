"""Per-peer transfer histograms with a bounded label set (``Stats.peers``).

Two timings, named after NIXL's own telemetry (``agent_xfer_time``,
``agent_xfer_post_time``) and exported as ``kvservice_xfer_time_seconds`` and
``kvservice_xfer_post_time_seconds`` (docs/operations.md, "Per-peer transfer times"):

* **time per transfer**, of each successful request, by side: the sender's from
  its first NIXL post to completion, the receiver's from sending its Expect to
  arrival (``TransferResult.transfer_s``).  A failed request is not timed (how
  long a failure took to notice is not a transfer time); it is counted, by side
  and peer, in ``failed``.
* **time to post**: how long each NIXL post call (create the handle and post
  the WRITE, chunks and settle fences alike, failed or not) took on the door
  thread, by peer.

Labels are the peers' advertised addresses (as ``status()["peers"]`` shows
them), at most ``limit`` of them; past that, peers share ``peer="other"``.  A
peer that leaves keeps its series (its counts stay, so rates over it fall to
zero) until a new address needs a label while all ``limit`` are taken: then the
series of the address gone longest are dropped and its counts added to
``other`` (sums over peers never go down).  A link's agent maps to its series
while linked, so memory is bounded by ``limit`` series plus one entry per
linked peer.  Recording is a dict lookup, a bisect over a tuple and three adds.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from typing import Any

from ._results import TransferResult

#: upper bounds (seconds) of the time-per-transfer buckets (100 µs .. 10 s)
XFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0)
#: upper bounds (seconds) of the time-to-post buckets (10 µs .. 1 s: a post may copy)
POST_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                0.025, 0.05, 0.1, 0.25, 1.0)
OTHER = "other"
#: ``ServiceConfig.metrics_peer_labels``' default
PEER_LABELS = 32
SIDES = ("send", "recv")


class Histogram:
    """Counts per bucket (the last is ``+Inf``), their sum and count."""

    __slots__ = ("bounds", "buckets", "count", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.buckets[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def add(self, other: Histogram) -> None:
        for i, n in enumerate(other.buckets):
            self.buckets[i] += n
        self.sum += other.sum
        self.count += other.count

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs as Prometheus wants them, ``+Inf`` last (the count).  Summed
        from one copy of the buckets, so a scrape racing the loop still reads them monotone."""
        out, total = [], 0
        buckets = list(self.buckets)
        for bound, n in zip(self.bounds, buckets, strict=False):
            total += n
            out.append((repr(bound), total))
        out.append(("+Inf", total + buckets[-1]))
        return out

    def snapshot(self) -> dict[str, Any]:
        return {"count": self.count, "sum_s": self.sum}


class PeerSeries:
    """One label's histograms and failure counts."""

    __slots__ = ("failed", "left_at", "live", "post", "xfer")

    def __init__(self) -> None:
        self.xfer = {side: Histogram(XFER_BUCKETS) for side in SIDES}
        self.post = Histogram(POST_BUCKETS)
        self.failed = dict.fromkeys(SIDES, 0)
        self.live = 0  # agents linked under this label now
        self.left_at = 0.0  # when the last of them went

    def add(self, other: PeerSeries) -> None:
        for side in SIDES:
            self.xfer[side].add(other.xfer[side])
            self.failed[side] += other.failed[side]
        self.post.add(other.post)

    def snapshot(self) -> dict[str, Any]:
        """Counts and sums only (``status()`` is polled, and sent to sidecar workers)."""
        return {"xfer_time": {side: h.snapshot() for side, h in self.xfer.items()},
                "post_time": self.post.snapshot(), "failed": dict(self.failed)}

    def histograms(self) -> dict[str, Any]:
        """Everything, buckets cumulative (``_metrics.peer_families``)."""
        return {"xfer_time": {side: (h.cumulative(), h.sum) for side, h in self.xfer.items()},
                "post_time": (self.post.cumulative(), self.post.sum), "failed": dict(self.failed)}


class PeerTimes:
    """The per-peer series of one service (see the module's docstring)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.series: dict[str, PeerSeries] = {}  # label -> series: at most ``limit``, then OTHER
        self._agents: dict[str, PeerSeries] = {}  # linked agent -> its series

    # -- peers come and go (the control plane) --------------------------------------
    def linked(self, agent: str, address: str) -> None:
        series = self.series.get(address) or self._label(address)
        series.live += 1
        self._agents[agent] = series

    def lost(self, agent: str) -> None:
        series = self._agents.pop(agent, None)
        if series is not None:
            series.live -= 1
            series.left_at = time.monotonic()

    def _label(self, address: str) -> PeerSeries:
        if len(self.series) - (OTHER in self.series) >= self.limit:
            gone = [(s.left_at, label) for label, s in self.series.items() if label != OTHER and s.live <= 0]
            if not gone:
                return self._other()
            self._other().add(self.series.pop(min(gone)[1]))
        series = self.series[address] = PeerSeries()
        return series

    def _other(self) -> PeerSeries:
        series = self.series.get(OTHER)
        if series is None:
            series = self.series[OTHER] = PeerSeries()
        return series

    def _of(self, agent: str) -> PeerSeries:
        """``agent``'s series; OTHER for one not linked (it went meanwhile)."""
        return self._agents.get(agent) or self._other()

    # -- recorded (the event loop) -------------------------------------------------
    def transfer(self, side: str, agent: str, result: TransferResult) -> None:
        series = self._of(agent)
        if not result.ok:
            series.failed[side] += 1
        elif result.started_at is not None:
            series.xfer[side].observe(result.finished_at - result.started_at)

    def posts(self, timed: Iterable[tuple[str, float]]) -> None:
        """``(agent, seconds)`` of each NIXL post call of a tick (``TickOutcome.post_times``)."""
        for agent, seconds in timed:
            self._of(agent).post.observe(seconds)

    def snapshot(self) -> dict[str, Any]:
        """By label: counts and sums (``status()["peer_times"]``)."""
        return {label: series.snapshot() for label, series in sorted(self.series.items())}

    def histograms(self) -> dict[str, Any]:
        """By label: the histograms with their buckets, copied (read at scrape time)."""
        return {label: series.histograms() for label, series in sorted(self.series.items())}
