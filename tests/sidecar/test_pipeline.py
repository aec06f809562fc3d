"""Prefill worker -> prefill sidecar -> decode sidecar -> decode worker, with real
daemons, real NIXL and real shared memory; many workers; a worker that dies
mid-request; malformed frames; /metrics that count what the tests did.

One pair of daemons serves the whole module; each test compares metrics
before and after, so the numbers it checks are its own.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
from collections.abc import Iterator

import anyio
import msgspec
import pytest
import torch

from kvservice import FailureReason, KVPoll, KVServiceError, SidecarClient
from kvservice.sidecar.wire import SIDECAR_OLDEST_VERSION, SIDECAR_PROTOCOL_VERSION, Error, Hello, Status, encode
from kvservice.testing import pattern
from tests.helpers import eventually

from .daemons import REPO, Sidecar, aget, frame, metrics, raw_exchange, short_tmpdir, sidecars, wait_bound

pytestmark = pytest.mark.nixl

MAX_CLIENTS = 10


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Sidecar, Sidecar]]:
    with sidecars("prefill", "decode", env={"KVSERVICE_SIDECAR_MAX_CLIENTS": str(MAX_CLIENTS)}) as (p, d):
        yield p, d


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


SEND_OK = 'kvservice_transfers_total{side="send",status="SUCCESS",reason=""}'
RECV_OK = 'kvservice_transfers_total{side="recv",status="SUCCESS",reason=""}'


async def test_bytes_travel_worker_to_worker_and_metrics_count_them(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = pair
    before_p, before_d = await metrics(prefill.http), await metrics(decode.http)
    n, npages = 6, 3
    async with SidecarClient(prefill.socket) as pw, SidecarClient(decode.socket) as dw:
        assert pw.address == prefill.address and dw.roles == ("decode",)
        handles = []
        for i in range(n):
            rid = f"pipe-{i}"
            src, dst = [i * npages + k for k in range(npages)], [60 - i * npages - k for k in range(npages)]
            pw.kv.write(src, pattern(pw.layout, rid, npages))  # straight into the daemon's pool
            await dw.expect(rid, dst, sender=pw.address)
            if i == 0:  # one request in two chunks
                await pw.send(rid, src[:1], last=False)
                handles.append(await pw.send(rid, src[1:], last=True))
            else:
                handles.append(await pw.send(rid, src, last=True))
        for h in handles:
            result = await pw.await_completion(h)
            assert result.ok, result
            assert result.bytes == npages * pw.layout.page_bytes and result.pages == npages
            assert h.poll() is KVPoll.Success
        for i in range(n):
            rid, dst = f"pipe-{i}", [60 - i * npages - k for k in range(npages)]
            arrived = await dw.await_arrival(rid, timeout=30)
            assert arrived.ok, arrived
            assert torch.equal(dw.kv.pages(dst), pattern(dw.layout, rid, npages)), rid
    after_p, after_d = await metrics(prefill.http), await metrics(decode.http)
    page_bytes = pw.layout.page_bytes
    assert delta(after_p, before_p, SEND_OK) == n
    assert delta(after_d, before_d, RECV_OK) == n
    assert delta(after_p, before_p, 'kvservice_transfer_bytes_total{side="send"}') == n * npages * page_bytes
    assert delta(after_d, before_d, 'kvservice_transfer_bytes_total{side="recv"}') == n * npages * page_bytes
    assert delta(after_p, before_p, "kvservice_transfer_duration_seconds_count") == n
    assert delta(after_p, before_p, 'kvservice_transfer_duration_seconds_bucket{le="+Inf"}') == n
    assert delta(after_p, before_p, 'kvservice_sidecar_calls_total{op="send"}') == n + 1
    # the per-peer series, re-exported by the daemon: labelled by the other daemon's address
    to_decode, from_prefill = f'peer="{decode.address}",side="send"', f'peer="{prefill.address}",side="recv"'
    assert delta(after_p, before_p, f"kvservice_xfer_time_seconds_count{{{to_decode}}}") == n
    assert delta(after_d, before_d, f"kvservice_xfer_time_seconds_count{{{from_prefill}}}") == n
    assert delta(after_d, before_d, f'kvservice_xfer_time_seconds_bucket{{le="+Inf",{from_prefill}}}') == n
    assert delta(after_p, before_p, f'kvservice_xfer_post_time_seconds_count{{peer="{decode.address}"}}') == n + 1
    assert delta(after_d, before_d, 'kvservice_sidecar_calls_total{op="expect"}') == n
    assert after_p['kvservice_transfers_in_flight{side="send"}'] == 0
    assert after_p["kvservice_peers_connected"] == 1 and after_d["kvservice_peers_connected"] == 1
    assert after_p["kvservice_up"] == 1
    assert "kvservice_event_loop_lag_seconds{quantile=\"0.99\"}" in after_p


async def test_many_workers_at_once(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = pair
    workers = MAX_CLIENTS - 1  # plus the decode side's one client... on the other daemon
    before = await metrics(prefill.http)
    async with SidecarClient(decode.socket) as dw:
        async def worker(w: int) -> None:
            async with SidecarClient(prefill.socket, name=f"w{w}") as pw:
                for j in range(2):
                    rid, src = f"many-{w}-{j}", [w * 4 + j * 2, w * 4 + j * 2 + 1]
                    dst = src
                    pw.kv.write(src, pattern(pw.layout, rid, 2))
                    await dw.expect(rid, dst, sender=pw.address)
                    result = await pw.await_completion(await pw.send(rid, src, last=True), timeout=30)
                    assert result.ok, result
                    assert (await dw.await_arrival(rid, timeout=30)).ok
                    assert torch.equal(dw.kv.pages(dst), pattern(dw.layout, rid, 2))

        async with anyio.create_task_group() as tg:
            for w in range(workers):
                tg.start_soon(worker, w)
    after = await metrics(prefill.http)
    assert delta(after, before, SEND_OK) == workers * 2
    assert delta(after, before, "kvservice_sidecar_connections_total") == workers


async def test_too_many_workers_are_refused_and_others_unaffected(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, _ = pair
    before = await metrics(prefill.http)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(SidecarClient(prefill.socket, name=f"full-{i}"))
                   for i in range(MAX_CLIENTS)]
        with pytest.raises(KVServiceError, match="too many workers"):
            async with SidecarClient(prefill.socket):
                pass
        assert (await clients[0].fetch_status())["workers"] == MAX_CLIENTS
    after = await metrics(prefill.http)
    assert delta(after, before, "kvservice_sidecar_connections_refused_total") == 1


async def test_worker_killed_mid_request_has_its_requests_aborted_only(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = pair
    before = await metrics(prefill.http)
    async with SidecarClient(prefill.socket, name="survivor") as pw, SidecarClient(decode.socket) as dw:
        await dw.expect("doomed", [20, 21, 22, 23], sender=pw.address)
        await dw.expect("fine", [30, 31], sender=pw.address)
        pw.kv.write([40, 41], pattern(pw.layout, "fine", 2))
        h = await pw.send("fine", [40], last=False)  # the survivor's request, half sent
        doomed = subprocess.Popen(  # noqa: ASYNC220 - a plain child we SIGKILL by pid
            [sys.executable, "-m", "tests.sidecar.worker", prefill.socket, "doomed", "10", "11"],
            stdout=subprocess.PIPE, cwd=REPO)
        try:
            assert doomed.stdout is not None
            line = await anyio.to_thread.run_sync(doomed.stdout.readline)
            assert line.strip() == b"sent", line
        finally:
            doomed.kill()  # SIGKILL: no goodbye from the worker
            doomed.wait(timeout=30)
            if doomed.stdout is not None:
                doomed.stdout.close()
        arrival = await dw.await_arrival("doomed", timeout=30)
        assert arrival.reason is FailureReason.ABORTED, arrival
        # the other worker's request goes on as if nothing happened
        assert (await pw.fetch_poll(h)) in (KVPoll.WaitingForInput, KVPoll.Transferring)
        result = await pw.await_completion(await pw.send("fine", [41], last=True), timeout=30)
        assert result.ok, result
        assert (await dw.await_arrival("fine", timeout=30)).ok
        assert torch.equal(dw.kv.pages([30, 31]), pattern(dw.layout, "fine", 2))
    after = await metrics(prefill.http)
    assert delta(after, before, "kvservice_sidecar_disconnect_aborts_total") == 1
    assert delta(after, before, 'kvservice_transfers_total{side="send",status="FAILED",reason="ABORTED"}') == 1
    aborted = [e for e in prefill.events("sidecar.request_aborted") if e.get("request_id") == "doomed"]
    assert aborted and aborted[0]["why"] == "worker disconnected"


async def test_decode_worker_leaving_aborts_its_expects(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = pair
    before = await metrics(decode.http)
    async with SidecarClient(prefill.socket) as pw:
        async with SidecarClient(decode.socket, drain_grace_s=0) as dw:
            await dw.expect("left-behind", [40, 41], sender=pw.address)
            handle = await pw.send("left-behind", [5], last=False)
            await wait_bound(pw, handle)
        # the decode worker is gone: its sidecar aborts the expect and tells the sender
        result = await pw.await_completion(handle, timeout=30)
        assert result.reason is FailureReason.ABORTED and "receiver aborted" in result.message, result
    after = await metrics(decode.http)
    assert delta(after, before, "kvservice_sidecar_disconnect_aborts_total") == 1


async def test_a_cancelled_wait_is_withdrawn_in_the_daemon(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = pair
    async with SidecarClient(prefill.socket) as pw, SidecarClient(decode.socket) as dw:

        async def calls_waiting(n: int) -> None:
            async def waiting() -> bool:
                return bool((await dw.fetch_status())["worker_calls_waiting"] == n)

            await eventually(waiting, 30, 0.01, what=f"{n} worker calls waiting in the decode daemon")

        await dw.expect("patient", [50], sender=pw.address)
        async with anyio.create_task_group() as tg:
            tg.start_soon(dw.await_arrival, "patient", 3600.0)  # with a timeout: a call in the daemon
            await calls_waiting(1)
            tg.cancel_scope.cancel()  # the caller is cancelled: the daemon's call goes too ...
        await calls_waiting(0)
        assert await dw.poll_arrival("patient") is KVPoll.WaitingForInput  # ... and the request lives on
        pw.kv.write([50], pattern(pw.layout, "patient", 1))
        assert (await pw.await_completion(await pw.send("patient", [50], last=True), timeout=30)).ok
        assert (await dw.await_arrival("patient", timeout=30)).ok


async def test_malformed_and_oversized_frames_never_hurt_the_daemon(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, _ = pair
    before = await metrics(prefill.http)
    cases = [
        (frame(b"\xc1 not msgpack"), True, "malformed frame"),
        (frame(msgspec.msgpack.encode({"type": "send", "call": 1, "request_id": "", "pages": []})), True,
         "malformed frame"),
        (frame(msgspec.msgpack.encode({"type": "launch", "call": 1})), True, "malformed frame"),
        ((1 << 30).to_bytes(4, "big"), True, "exceeds the limit"),
        (encode(Status(1)), False, "expected hello"),
        (encode(Hello(SIDECAR_OLDEST_VERSION - 1, "past")), False, "protocol version"),
        (encode(Hello(SIDECAR_PROTOCOL_VERSION, "twice")), True, "hello after the handshake"),
    ]
    for payload, hello, message in cases:
        replies = await raw_exchange(prefill.socket, payload, hello=hello)
        errors = [r for r in replies if isinstance(r, Error)]
        assert errors and errors[-1].call == 0 and message in errors[-1].message, (payload[:40], replies)
    # a frame cut short, then the connection closed: nothing to answer, nothing broken
    await raw_exchange(prefill.socket, (100).to_bytes(4, "big") + b"short", hang_up=True)
    async with SidecarClient(prefill.socket) as pw:  # still serving
        assert (await pw.fetch_status())["roles"] == ["prefill"]
    assert prefill.proc is not None and prefill.proc.poll() is None
    after = await metrics(prefill.http)
    assert delta(after, before, "kvservice_sidecar_frames_rejected_total") == len(cases)
    assert prefill.events("sidecar.frame_rejected")


async def test_bad_calls_get_error_replies_and_the_connection_stays(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, _ = pair
    async with SidecarClient(prefill.socket) as pw:
        with pytest.raises(KVServiceError, match="does not serve the decode role"):
            await pw.expect("nope", [1], sender="127.0.0.1:1")
        with pytest.raises(ValueError, match="out of range"):
            await pw.send("nope", [pw.layout.num_pages], last=True)
        h = await pw.send("ok-after-errors", [1], last=False)
        assert (await pw.abort("ok-after-errors")) is not None
        assert h.poll() is KVPoll.Failed


async def test_socket_is_private_and_ops_endpoints_answer(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, _ = pair
    assert stat.S_IMODE(os.stat(prefill.socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(f"/dev/shm/{prefill.shm}").st_mode) == 0o600
    assert await aget(prefill.http, "/healthz") == (200, "ok\n")
    assert await aget(prefill.http, "/readyz") == (200, "ready\n")
    assert (await aget(prefill.http, "/nope"))[0] == 404
    for raw, code in ((b"GARBAGE\r\n\r\n", b"400"), (b"GET /" + b"x" * 9000, b"431"),
                      (b"POST /metrics HTTP/1.1\r\n\r\n", b"405")):
        host, port = prefill.http.rsplit(":", 1)
        async with await anyio.connect_tcp(host, int(port)) as tcp:
            await tcp.send(raw)
            with anyio.fail_after(30):
                assert (await tcp.receive()).startswith(b"HTTP/1.1 " + code)
    assert await aget(prefill.http, "/healthz") == (200, "ok\n")
    events = {e["event"] for e in prefill.events()}
    assert {"shm.created", "service.started", "sidecar.ready"} <= events


async def test_client_without_a_daemon_fails_clearly() -> None:
    workdir = short_tmpdir()
    with pytest.raises(KVServiceError, match="cannot connect to the sidecar"):
        async with SidecarClient(os.path.join(workdir, "none.sock"), connect_timeout=5):
            pass
    os.rmdir(workdir)


#: every family /metrics exported before prometheus_client, with its type and labels: a stable interface
KVSERVICE_FAMILIES = {
    "kvservice_up": ("gauge", set()),
    "kvservice_transfers": ("counter", {"side", "status", "reason"}),
    "kvservice_transfer_bytes": ("counter", {"side"}),
    "kvservice_transfers_in_flight": ("gauge", {"side"}),
    "kvservice_nixl_handles_live": ("gauge", set()),
    "kvservice_transfer_duration_seconds": ("histogram", set()),
    "kvservice_xfer_time_seconds": ("histogram", {"side", "peer"}),
    "kvservice_xfer_post_time_seconds": ("histogram", {"peer"}),
    "kvservice_xfer_failed": ("counter", {"side", "peer"}),
    "kvservice_peers_connected": ("gauge", set()),
    "kvservice_peer_links": ("gauge", {"protocol"}),
    "kvservice_unsettled_pages": ("gauge", set()),
    "kvservice_event_loop_lag_seconds": ("gauge", {"quantile"}),
    "kvservice_stale_notifications": ("counter", set()),
    "kvservice_landing_checks": ("counter", {"result"}),
    "kvservice_sidecar_workers_connected": ("gauge", set()),
    "kvservice_sidecar_connections": ("counter", set()),
    "kvservice_sidecar_connections_refused": ("counter", set()),
    "kvservice_sidecar_frames_rejected": ("counter", set()),
    "kvservice_sidecar_disconnect_aborts": ("counter", set()),
    "kvservice_sidecar_calls": ("counter", {"op"}),
    "kvservice_refused": ("counter", {"where", "kind"}),
}


async def test_metrics_are_prometheus_text_with_the_process_collectors(pair: tuple[Sidecar, Sidecar]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    prefill, _ = pair
    async with SidecarClient(prefill.socket) as pw:
        await pw.fetch_status()  # a call, so that calls_total has a sample
    status, body = await aget(prefill.http, "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body)}
    for name in ("process_resident_memory_bytes", "process_cpu_seconds", "process_open_fds",
                 "process_start_time_seconds", "python_info"):
        assert name in families, sorted(families)
    assert families["process_resident_memory_bytes"].samples[0].value > 0
    for name, (kind, labels) in KVSERVICE_FAMILIES.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
        for sample in families[name].samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample)
    assert {f for f in families if f.startswith("kvservice_")} == set(KVSERVICE_FAMILIES)
    assert families["kvservice_up"].samples[0].value == 1
    calls = {s.labels["op"] for s in families["kvservice_sidecar_calls"].samples}
    assert "status" in calls, calls
    # and every one of them is in the operators' documentation
    doc = (REPO / "docs" / "sidecar.md").read_text()
    undocumented = [name for name, (kind, _) in KVSERVICE_FAMILIES.items()
                    if f"`{name}{'_total' if kind == 'counter' else ''}`" not in doc]
    assert not undocumented, undocumented
