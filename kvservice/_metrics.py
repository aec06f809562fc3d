"""A ``TransferService``'s Prometheus metrics, read when scraped.

``ServiceCollector`` is a ``prometheus_client`` collector: nothing on the transfer
path updates a metric; each scrape reads the counters the service keeps anyway
(``svc.stats``, ``svc.status()``).  An engine registers it on its own registry and
serves that however it serves metrics::

    from prometheus_client import REGISTRY
    REGISTRY.register(svc.metrics)          # once per service

The sidecar (``kvservice serve``) exports the same families from its own registry,
with its own beside them.  Names and labels are a stable interface, listed in
docs/sidecar.md ("Operations").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ._results import FailureReason
from ._stats import LANDING_RESULTS, LATENCY_BUCKETS, Stats


class Measured(Protocol):
    """What the metrics read of a service (``TransferService``): its counters and its
    status.  The service owns its collector; the collector does not know the service's type."""

    @property
    def stats(self) -> Stats: ...
    def status(self) -> Mapping[str, Any]: ...

__all__ = ["ServiceCollector", "discovery_families", "peer_families", "refused_family", "service_families",
           "service_refusals"]

#: a scrape from another thread may meet a dict or deque the loop is changing; read again
_READ_TRIES = 3


def _snapshot(svc: Measured) -> tuple[Any, dict[str, Any]]:
    stats = svc.stats
    return stats, {**svc.status(), "outcomes_by_key": dict(stats.outcomes), "bytes_by_side": dict(stats.bytes),
                   "latency_buckets": list(stats.latency_buckets), "peer_histograms": stats.peers.histograms()}


def _read(svc: Measured) -> tuple[Any, dict[str, Any]]:
    """The service's status and its counters, copied."""
    for _ in range(_READ_TRIES - 1):
        try:
            return _snapshot(svc)
        except RuntimeError:  # "changed size during iteration": the loop moved on meanwhile
            continue
    return _snapshot(svc)


def service_families(svc: Measured) -> list[Metric]:
    """Every family of the transfer service except ``kvservice_refused_total`` (which the
    sidecar extends with its own kinds): see ``refused_family``."""
    stats, snap = _read(svc)
    outcomes, nbytes = snap["outcomes_by_key"], snap["bytes_by_side"]
    transfers = CounterMetricFamily(
        "kvservice_transfers_total",
        "Requests ended, by side (send: this sidecar sent; recv: it received), status and failure reason",
        labels=["side", "status", "reason"])
    for side in ("send", "recv"):
        transfers.add_metric([side, "SUCCESS", ""], outcomes.get((side, "SUCCESS"), 0))
        for reason in FailureReason:
            transfers.add_metric([side, "FAILED", reason.value], outcomes.get((side, reason.value), 0))
    moved = CounterMetricFamily("kvservice_transfer_bytes_total", "Bytes of successful transfers, by side",
                                labels=["side"])
    in_flight = GaugeMetricFamily("kvservice_transfers_in_flight", "Requests not yet ended, by side",
                                  labels=["side"])
    for side, key in (("send", "sending"), ("recv", "receiving")):
        moved.add_metric([side], nbytes.get(side, 0))
        in_flight.add_metric([side], snap[key])
    cumulative, buckets = 0, []
    for bound, count in zip(LATENCY_BUCKETS, snap["latency_buckets"], strict=False):
        cumulative += count
        buckets.append((repr(bound), cumulative))
    buckets.append(("+Inf", stats.latency_count))
    duration = HistogramMetricFamily("kvservice_transfer_duration_seconds",
                                     "Successful sends, from the first send() to completion")
    duration.add_metric([], buckets, stats.latency_sum)
    lag = GaugeMetricFamily("kvservice_event_loop_lag_seconds", "How late the event loop wakes a 10 ms sleeper",
                            labels=["quantile"])
    lag.add_metric(["0.99"], snap["loop_lag_p99_s"])
    lag.add_metric(["1"], snap["loop_lag_max_s"])
    peer_versions = GaugeMetricFamily("kvservice_peer_links", "Live control links by the protocol version they speak",
                                      labels=["protocol"])
    for version, n in snap["peer_versions"].items():
        peer_versions.add_metric([version], n)
    landings = CounterMetricFamily(
        "kvservice_landing_checks_total",
        "Landing checks of received requests (verify_landing): checked (matched), mismatched (CORRUPTED), "
        "unchecked (the sender sent no checksum)", labels=["result"])
    for kind in LANDING_RESULTS:
        landings.add_metric([kind], snap["landings"].get(kind, 0))
    return [
        *peer_families(snap["peer_histograms"]),
        *discovery_families(snap.get("discovery")),
        transfers, moved, in_flight,
        GaugeMetricFamily("kvservice_nixl_handles_live", "NIXL transfer handles not yet released",
                          value=snap["live_nixl_handles"]),
        duration,
        GaugeMetricFamily("kvservice_peers_connected", "Peer services with a live control link",
                          value=len(snap["peers"])),
        peer_versions,
        GaugeMetricFamily("kvservice_unsettled_pages",
                          "Pages of failed requests a sender may still write into (not reusable yet)",
                          value=snap["unsettled_pages"]),
        lag,
        CounterMetricFamily("kvservice_stale_notifications_total", "NIXL notifications matching no live request",
                            value=snap["stale_notifs"]),
        landings,
    ]


def peer_families(histograms: dict[str, Any]) -> list[Metric]:
    """The per-peer histograms from ``PeerTimes.histograms()`` (``_peertimes``)."""
    xfer = HistogramMetricFamily(
        "kvservice_xfer_time_seconds",
        "Time per successful transfer, by side and peer: the sender's from its first NIXL post to "
        "completion, the receiver's from its Expect to arrival (NIXL's agent_xfer_time)",
        labels=["side", "peer"])
    post = HistogramMetricFamily(
        "kvservice_xfer_post_time_seconds",
        "Time each NIXL post call (make the handle, post the WRITE) took on the door thread, by peer "
        "(NIXL's agent_xfer_post_time)", labels=["peer"])
    failed = CounterMetricFamily("kvservice_xfer_failed_total", "Failed transfers, by side and peer",
                                 labels=["side", "peer"])
    for peer, series in histograms.items():
        for side, (buckets, total) in series["xfer_time"].items():
            xfer.add_metric([side, peer], buckets, total)
            failed.add_metric([side, peer], series["failed"][side])
        buckets, total = series["post_time"]
        post.add_metric([peer], buckets, total)
    return [xfer, post, failed]


def discovery_families(discovery: Mapping[str, Any] | None) -> list[Metric]:
    """``kvservice_discovery_ignored_total{why}``, with ``discovery = "etcd"`` (``status()
    ["discovery"]``): entries in etcd that are no valid member, by why (each also counted
    once in ``kvservice_refused_total{kind="discovery_member"}``)."""
    if discovery is None:
        return []
    ignored = CounterMetricFamily(
        "kvservice_discovery_ignored_total",
        "Entries under the cluster's etcd prefix that discovery ignored (no valid member), by why",
        labels=["why"])
    for why, n in sorted(discovery["ignored"].items()):
        ignored.add_metric([why], n)
    return [ignored]


def refused_family(samples: Iterable[tuple[str, str, int]]) -> CounterMetricFamily:
    """``kvservice_refused_total{where, kind}`` from (where, kind, count) samples."""
    family = CounterMetricFamily(
        "kvservice_refused_total",
        "What a peer (where=service), a worker (workers) or an HTTP client (http) tried and was refused, by kind",
        labels=["where", "kind"])
    for where, kind, count in samples:
        family.add_metric([where, kind], count)
    return family


def service_refusals(svc: Measured) -> list[tuple[str, str, int]]:
    """The service's own refusals, as ``refused_family`` samples."""
    return [("service", kind, n) for kind, n in sorted(dict(svc.stats.refused).items())]


class ServiceCollector(Collector):
    """The transfer service's families, read from ``svc`` at each scrape."""

    def __init__(self, svc: Measured) -> None:
        self._svc = svc

    def collect(self) -> Iterator[Metric]:
        yield from service_families(self._svc)
        yield refused_family(service_refusals(self._svc))
