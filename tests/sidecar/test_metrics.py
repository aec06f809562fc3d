"""``/metrics`` text from the counters, without daemons: every refusal kind of the
service, the worker socket and the ops endpoint, under one family; and the
in-process service's collector on an engine's own registry."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from kvservice._metrics import ServiceCollector
from kvservice._results import FailureReason, TransferResult, TransferStatus
from kvservice._stats import RequestCounts, ServiceStatus, Stats
from kvservice.sidecar import metrics
from kvservice.sidecar.connection import ServerCounters

from .daemons import parse_metrics


class Service:
    """What the collectors read of a ``TransferService``."""

    def __init__(self) -> None:
        self.stats = Stats()

    def status(self) -> ServiceStatus:
        return self.stats.snapshot(RequestCounts(
            sending=0, receiving=2, expects_before_send=0, unsettled_pages=7, inflight_handles=0,
            live_nixl_handles=0, staging_held_bytes=0), ["a:1", "b:2", "c:3"], {"5": 1, "6": 2})


def test_refusals_of_every_part_are_exported_by_where_and_kind() -> None:
    svc = Service()
    svc.stats.refuse("auth")
    svc.stats.refuse("auth")
    counters = ServerCounters()
    counters.refused.update({"not_owner": 3, "uid": 1, "hello_invalid": 2, "frame": 1, "accept_error": 4})
    server = SimpleNamespace(counters=counters, conns=set())
    ops = SimpleNamespace(refused={"bad_request": 5})
    text = metrics.render(svc, server, ops, ready=True)  # type: ignore[arg-type]
    got = parse_metrics(text)
    assert got['kvservice_refused_total{where="service",kind="auth"}'] == 2
    assert got['kvservice_refused_total{where="workers",kind="not_owner"}'] == 3
    assert got['kvservice_refused_total{where="workers",kind="accept_error"}'] == 4
    assert got['kvservice_refused_total{where="http",kind="bad_request"}'] == 5
    # the older families are sums of their kinds
    assert got["kvservice_sidecar_connections_refused_total"] == 3  # uid + hello_invalid
    assert got["kvservice_sidecar_frames_rejected_total"] == 3  # hello_invalid + frame
    assert text.count("# TYPE kvservice_refused_total counter") == 1
    assert got["kvservice_up"] == 1
    assert got["kvservice_unsettled_pages"] == 7


def test_a_starting_daemon_exports_only_that_it_is_not_up() -> None:
    got = parse_metrics(metrics.render(None, None, None, ready=False))
    assert dict(got) == {"kvservice_up": 0}


def test_the_in_process_service_collector_on_an_engines_registry() -> None:
    svc = Service()
    ok = TransferResult(request_id="r", status=TransferStatus.SUCCESS, bytes=4096, created_at=1.0, finished_at=1.003)
    svc.stats.record("send", ok)
    svc.stats.record("recv", TransferResult(request_id="s", status=TransferStatus.FAILED,
                                            reason=FailureReason.PEER_LOST, message="lost"))
    svc.stats.refuse("auth")
    engine = CollectorRegistry()
    engine.register(ServiceCollector(svc))  # type: ignore[arg-type]
    got = parse_metrics(generate_latest(engine).decode())
    assert got['kvservice_transfers_total{side="send",status="SUCCESS",reason=""}'] == 1
    assert got['kvservice_transfers_total{side="recv",status="FAILED",reason="PEER_LOST"}'] == 1
    assert got['kvservice_transfer_bytes_total{side="send"}'] == 4096
    assert got['kvservice_transfers_in_flight{side="recv"}'] == 2
    assert got['kvservice_transfer_duration_seconds_bucket{le="0.005"}'] == 1
    assert got['kvservice_transfer_duration_seconds_bucket{le="0.0025"}'] == 0
    assert got["kvservice_transfer_duration_seconds_count"] == 1
    assert got["kvservice_peers_connected"] == 3
    assert got['kvservice_peer_links{protocol="5"}'] == 1  # a rolling upgrade half done
    assert got['kvservice_peer_links{protocol="6"}'] == 2
    assert got['kvservice_refused_total{where="service",kind="auth"}'] == 1
    assert "kvservice_up" not in got  # the daemon's, not the service's
