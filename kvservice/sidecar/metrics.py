"""``/metrics``: the daemon's ``prometheus_client`` registry in the Prometheus text
format.  The registry holds the process, platform and GC collectors every Python
target exports (``process_resident_memory_bytes``, ``process_cpu_seconds_total``,
``process_open_fds``, ``python_info``, ...) and ``SidecarCollector``, which reads
the service's and the sidecar's counters when scraped, so nothing on the transfer
path touches a metric.  Names and labels are a stable interface (docs/sidecar.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from .._metrics import refused_family, service_families, service_refusals
from .._service import TransferService
from .http import OpsServer
from .server import SidecarServer

#: the text format 0.0.4, as before; every family here has a name that format allows
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

__all__ = ["CONTENT_TYPE", "SidecarCollector", "registry", "render"]


class SidecarCollector(Collector):
    """``kvservice_up``, the service's families (none until it is up), the worker socket's,
    and one ``kvservice_refused_total`` for the service, the workers and the endpoint."""

    def __init__(self, svc: Callable[[], TransferService | None], server: Callable[[], SidecarServer | None],
                 ops: Callable[[], OpsServer | None], ready: Callable[[], bool]) -> None:
        self._svc, self._server, self._ops, self._ready = svc, server, ops, ready

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("kvservice_up", "1 while the daemon serves, 0 while it drains",
                                value=1 if self._ready() else 0)
        svc, server, ops = self._svc(), self._server(), self._ops()
        if svc is None:
            return  # starting
        yield from service_families(svc)
        refused = service_refusals(svc)
        if server is not None:
            c = server.counters
            yield GaugeMetricFamily("kvservice_sidecar_workers_connected", "Workers connected on the Unix socket",
                                    value=len(server.conns))
            yield CounterMetricFamily("kvservice_sidecar_connections_total", "Worker connections accepted",
                                      value=c.connections_total)
            yield CounterMetricFamily("kvservice_sidecar_connections_refused_total",
                                      "Worker connections refused (uid, too many, bad hello, shutting down)",
                                      value=c.connections_refused_total)
            yield CounterMetricFamily("kvservice_sidecar_frames_rejected_total",
                                      "Malformed or oversized worker frames", value=c.frames_rejected_total)
            yield CounterMetricFamily("kvservice_sidecar_disconnect_aborts_total",
                                      "Requests aborted because their worker disconnected",
                                      value=c.aborted_on_disconnect_total)
            calls = CounterMetricFamily("kvservice_sidecar_calls_total", "Worker API calls, by operation",
                                        labels=["op"])
            for op, n in sorted(c.calls.items()):
                calls.add_metric([op], n)
            yield calls
            refused += [("workers", kind, n) for kind, n in sorted(c.refused.items())]
        if ops is not None:
            refused += [("http", kind, n) for kind, n in sorted(ops.refused.items())]
        yield refused_family(refused)


def registry(collector: Collector) -> CollectorRegistry:
    """A registry of ``collector`` beside the process, platform and GC collectors (what
    ``prometheus_client``'s default registry holds, but the daemon's own: nothing else
    in the process can add to it)."""
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    GCCollector(registry=reg)
    reg.register(collector)
    return reg


def render(svc: TransferService | None, server: SidecarServer | None, ops: OpsServer | None, *,
           ready: bool) -> str:
    """The text of one scrape of these parts (what ``/metrics`` serves, without the
    process collectors: see ``registry``)."""
    reg = CollectorRegistry()
    reg.register(SidecarCollector(lambda: svc, lambda: server, lambda: ops, lambda: ready))
    return generate_latest(reg).decode()
