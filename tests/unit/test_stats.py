"""The latency histogram behind /metrics: each duration lands in the first bucket whose
upper bound holds it (Prometheus's ``le``), the rest in +Inf."""

from __future__ import annotations

import pytest

from kvservice import FailureReason, TransferResult, TransferStatus
from kvservice._log import Throttle
from kvservice._stats import LATENCY_BUCKETS, Stats


def result(duration: float) -> TransferResult:
    return TransferResult(request_id="r", status=TransferStatus.SUCCESS, bytes=10,
                          created_at=0.0, finished_at=duration)


@pytest.mark.parametrize(("duration", "bucket"), [
    (0.0005, 0), (LATENCY_BUCKETS[0], 0), (0.0011, 1), (LATENCY_BUCKETS[-1], len(LATENCY_BUCKETS) - 1),
    (11.0, len(LATENCY_BUCKETS)),
])
def test_a_duration_lands_in_its_bucket(duration: float, bucket: int) -> None:
    stats = Stats()
    stats.record("send", result(duration))
    assert stats.latency_buckets[bucket] == 1 and sum(stats.latency_buckets) == 1
    assert stats.latency_count == 1 and stats.bytes["send"] == 10


def test_receiving_side_and_failures_stay_out_of_the_histogram() -> None:
    stats = Stats()
    stats.record("recv", result(0.1))
    stats.record("send", TransferResult(request_id="f", status=TransferStatus.FAILED, reason=FailureReason.PEER_LOST,
                                        message="lost"))
    assert sum(stats.latency_buckets) == 0
    assert stats.outcomes[("recv", "SUCCESS")] == 1 and stats.outcomes[("send", "PEER_LOST")] == 1


def test_throttle_logs_a_burst_per_window_and_says_how_many_it_held_back() -> None:
    now = [0.0]
    t = Throttle(burst=3, window_s=10.0, clock=lambda: now[0])
    assert [t.allow("frame") for _ in range(5)] == [0, 0, 0, None, None]
    assert t.allow("auth") == 0  # per key
    now[0] = 9.9
    assert t.allow("frame") is None
    now[0] = 10.0  # a new window: the first line carries what was held back
    assert [t.allow("frame") for _ in range(4)] == [3, 0, 0, None]
    now[0] = 25.0
    assert t.allow("frame") == 1


def test_refusals_are_all_counted_but_logged_at_most_a_burst() -> None:
    stats = Stats()
    logged = [stats.refuse("frame") for _ in range(100)]
    assert stats.refused["frame"] == 100
    assert sum(x is not None for x in logged) == 10
