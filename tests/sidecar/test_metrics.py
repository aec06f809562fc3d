"""``/metrics`` text from the counters, without daemons: every refusal kind of the
service, the worker socket and the ops endpoint, under one family."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvservice._stats import Stats
from kvservice.sidecar import metrics
from kvservice.sidecar.connection import ServerCounters


class Service:
    """What ``render`` reads of a ``TransferService``."""

    def __init__(self) -> None:
        self.stats = Stats()

    def status(self) -> dict[str, Any]:
        return {"sending": 0, "receiving": 0, "live_nixl_handles": 0, "peers": [], "unsettled_pages": 7}


def test_refusals_of_every_part_are_exported_by_where_and_kind() -> None:
    svc = Service()
    svc.stats.refuse("auth")
    svc.stats.refuse("auth")
    counters = ServerCounters()
    counters.refused.update({"not_owner": 3, "uid": 1, "hello_invalid": 2, "frame": 1, "accept_error": 4})
    server = SimpleNamespace(counters=counters, conns=set())
    ops = SimpleNamespace(refused={"bad_request": 5})
    text = metrics.render(svc, server, ops, ready=True)  # type: ignore[arg-type]
    samples = {line.rpartition(" ")[0]: line.rpartition(" ")[2] for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples['kvservice_refused_total{where="service",kind="auth"}'] == "2"
    assert samples['kvservice_refused_total{where="workers",kind="not_owner"}'] == "3"
    assert samples['kvservice_refused_total{where="workers",kind="accept_error"}'] == "4"
    assert samples['kvservice_refused_total{where="http",kind="bad_request"}'] == "5"
    # the older families are sums of their kinds
    assert samples["kvservice_sidecar_connections_refused_total"] == "3"  # uid + hello_invalid
    assert samples["kvservice_sidecar_frames_rejected_total"] == "3"  # hello_invalid + frame
    assert text.count("# TYPE kvservice_refused_total counter") == 1
    assert samples["kvservice_up"] == "1"
    assert samples["kvservice_unsettled_pages"] == "7"
