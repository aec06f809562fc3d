"""``/metrics`` in the Prometheus text format (0.0.4), from the service's ``Stats``
and the sidecar's own counters.  Names and labels are a stable interface."""

from __future__ import annotations

import math
from collections.abc import Iterable

from .._results import FailureReason
from .._service import TransferService
from .._stats import LATENCY_BUCKETS
from .http import OpsServer
from .server import SidecarServer

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(**labels: str) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str, samples: Iterable[tuple[str, dict[str, str], float]]) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")
        for suffix, labels, value in samples:
            self.lines.append(f"{name}{suffix}{_labels(**labels)} {_num(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(svc: TransferService, server: SidecarServer | None, ops: OpsServer | None, *, ready: bool) -> str:
    stats = svc.stats
    snap = svc.status()
    w = _Writer()
    w.family("kvservice_up", "gauge", "1 while the daemon serves, 0 while it drains",
             [("", {}, 1 if ready else 0)])
    transfers = []
    for side in ("send", "recv"):
        transfers.append(("", {"side": side, "status": "SUCCESS", "reason": ""},
                          stats.outcomes.get((side, "SUCCESS"), 0)))
        for reason in FailureReason:
            transfers.append(("", {"side": side, "status": "FAILED", "reason": reason.value},
                              stats.outcomes.get((side, reason.value), 0)))
    w.family("kvservice_transfers_total", "counter",
             "Requests ended, by side (send: this sidecar sent; recv: it received), status and failure reason",
             transfers)
    w.family("kvservice_transfer_bytes_total", "counter", "Bytes of successful transfers, by side",
             [("", {"side": "send"}, stats.bytes["send"]), ("", {"side": "recv"}, stats.bytes["recv"])])
    w.family("kvservice_transfers_in_flight", "gauge", "Requests not yet ended, by side",
             [("", {"side": "send"}, snap["sending"]), ("", {"side": "recv"}, snap["receiving"])])
    w.family("kvservice_nixl_handles_live", "gauge", "NIXL transfer handles not yet released",
             [("", {}, snap["live_nixl_handles"])])
    buckets: list[tuple[str, dict[str, str], float]] = []
    cumulative = 0
    for bound, count in zip(LATENCY_BUCKETS, stats.latency_buckets, strict=False):
        cumulative += count
        buckets.append(("_bucket", {"le": repr(bound)}, cumulative))
    buckets.append(("_bucket", {"le": "+Inf"}, stats.latency_count))
    buckets.append(("_sum", {}, stats.latency_sum))
    buckets.append(("_count", {}, stats.latency_count))
    w.family("kvservice_transfer_duration_seconds", "histogram",
             "Successful sends, from the first send() to completion", buckets)
    w.family("kvservice_peers_connected", "gauge", "Peer services with a live control link",
             [("", {}, len(snap["peers"]))])
    w.family("kvservice_unsettled_pages", "gauge",
             "Pages of failed requests a sender may still write into (not reusable yet)",
             [("", {}, snap["unsettled_pages"])])
    w.family("kvservice_event_loop_lag_seconds", "gauge", "How late the event loop wakes a 10 ms sleeper",
             [("", {"quantile": "0.99"}, stats.lag_quantile(0.99)), ("", {"quantile": "1"}, stats.max_lag_s)])
    w.family("kvservice_stale_notifications_total", "counter", "NIXL notifications matching no live request",
             [("", {}, stats.stale_notifs)])
    if server is not None:
        c = server.counters
        w.family("kvservice_sidecar_workers_connected", "gauge", "Workers connected on the Unix socket",
                 [("", {}, len(server.conns))])
        w.family("kvservice_sidecar_connections_total", "counter", "Worker connections accepted",
                 [("", {}, c.connections_total)])
        w.family("kvservice_sidecar_connections_refused_total", "counter",
                 "Worker connections refused (uid, too many, bad hello, shutting down)",
                 [("", {}, c.connections_refused_total)])
        w.family("kvservice_sidecar_frames_rejected_total", "counter", "Malformed or oversized worker frames",
                 [("", {}, c.frames_rejected_total)])
        w.family("kvservice_sidecar_disconnect_aborts_total", "counter",
                 "Requests aborted because their worker disconnected", [("", {}, c.aborted_on_disconnect_total)])
        w.family("kvservice_sidecar_calls_total", "counter", "Worker API calls, by operation",
                 [("", {"op": op}, n) for op, n in sorted(c.calls.items())])
    refused = [("", {"where": "service", "kind": kind}, n) for kind, n in sorted(stats.refused.items())]
    for where, counts in (("workers", server.counters.refused if server else {}),
                          ("http", ops.refused if ops else {})):
        refused.extend(("", {"where": where, "kind": kind}, n) for kind, n in sorted(counts.items()))
    w.family("kvservice_refused_total", "counter",
             "What a peer (where=service), a worker (workers) or an HTTP client (http) tried and was refused, "
             "by kind", refused)
    return w.text()
