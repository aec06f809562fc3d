"""The latency histogram behind /metrics: each duration lands in the first bucket whose
upper bound holds it (Prometheus's ``le``), the rest in +Inf."""

from __future__ import annotations

import pytest

from kvservice import TransferResult, TransferStatus
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
    stats.record("send", TransferResult(request_id="f", status=TransferStatus.FAILED))
    assert sum(stats.latency_buckets) == 0
    assert stats.outcomes[("recv", "SUCCESS")] == 1 and stats.outcomes[("send", "UNKNOWN")] == 1
