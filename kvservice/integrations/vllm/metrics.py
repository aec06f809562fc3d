"""The connector's stats in vLLM's own classes: ``KVServiceStats`` (what vLLM aggregates
and logs) and ``KVServicePromMetrics`` (the ``vllm:kvservice_*`` families of vLLM's
``/metrics``).  The payload and its arithmetic are ``stats``'s; names are listed in
docs/vllm.md ("Stats and metrics").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .stats import is_empty, merge, payload_from, summary

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # isort: skip
    KVConnectorPromMetrics, KVConnectorStats)

__all__ = ["KVServicePromMetrics", "KVServiceStats"]

#: seconds: a load waits for the prefill's WRITE as long as a hand-off lives (30 s by default)
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: bytes: 2 KiB to 8 GiB, by 4
BYTE_BUCKETS = tuple(float(2 ** (11 + 2 * i)) for i in range(12))


@dataclass
class KVServiceStats(KVConnectorStats):
    """One interval's counts and transfer times (``data``: a ``stats`` payload)."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.data = payload_from(self.data)

    def reset(self) -> None:
        self.data = payload_from(None)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge(self.data, payload_from(other.data))
        return self

    def reduce(self) -> dict[str, int | float]:
        return summary(self.data)

    def is_empty(self) -> bool:
        return is_empty(self.data)


class KVServicePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvservice_events_total{event}`` (every counter of ``counts``, by name) and
    histograms of the successful loads' and sends' times and bytes."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._events = self._counter_cls(
            name="vllm:kvservice_events",
            documentation="kvservice connector events by name (hand-offs, loads, failures, refusals: "
                          "the connector's counts)",
            labelnames=[*labelnames, "event"])
        self._series: dict[str, dict[int, Any]] = {}
        for name, what, unit, buckets in (
                ("load_s", "successful loads, from the decode's expect to the last block landed",
                 "time_seconds", TIME_BUCKETS),
                ("send_s", "successful sends, from the first WRITE posted to completion", "time_seconds",
                 TIME_BUCKETS),
                ("load_bytes", "successful loads, bytes per request", "bytes", BYTE_BUCKETS),
                ("send_bytes", "successful sends, bytes per request", "bytes", BYTE_BUCKETS)):
            side = name.split("_")[0]
            family = self._histogram_cls(name=f"vllm:kvservice_{side}_{unit}", documentation=f"kvservice {what}",
                                         buckets=list(buckets), labelnames=labelnames)
            self._series[name] = {idx: family.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = payload_from(transfer_stats_data)
        labels = self.per_engine_labelvalues[engine_idx]
        for event, n in data["counts"].items():
            self._events.labels(*labels, event).inc(n)
        for name, children in self._series.items():
            for value in data[name]:
                children[engine_idx].observe(value)
