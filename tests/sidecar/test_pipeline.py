"""Prefill worker -> prefill sidecar -> decode sidecar -> decode worker, with real
daemons, real NIXL and real shared memory; many workers; a worker that dies
mid-request; malformed frames; /metrics that count what the tests did.

One pair of daemons serves the whole module; each test compares metrics
before and after, so the numbers it checks are its own.  The tests of how the
daemon watches requests (a done callback each, one pusher per worker) run a
daemon in this process as well, to look at its connections and its loop's tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import anyio
import anyio.lowlevel
import msgspec
import pytest
import torch

from kvservice import FailureReason, KVPoll, KVServiceError, SidecarClient, TransferService
from kvservice.sidecar import server as server_mod
from kvservice.sidecar.connection import Connection
from kvservice.sidecar.local import daemon_env
from kvservice.sidecar.server import SidecarServer
from kvservice.sidecar.settings import load
from kvservice.sidecar.shm import Segment
from kvservice.sidecar.wire import (
    SIDECAR_OLDEST_VERSION,
    SIDECAR_PROTOCOL_VERSION,
    Error,
    Finished,
    Hello,
    Status,
    decode_server,
    encode,
)
from kvservice.testing import pattern
from tests.helpers import eventually

from .daemons import (
    CONFIG,
    REPO,
    SMALL_LAYOUT,
    TEST_ENV,
    Sidecar,
    aget,
    frame,
    metrics,
    raw_exchange,
    short_tmpdir,
    sidecars,
    wait_bound,
)

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
        assert await dw.fetch_poll_arrival("patient") is KVPoll.WaitingForInput  # ... and the request lives on
        pw.kv.write([50], pattern(pw.layout, "patient", 1))
        assert (await pw.await_completion(await pw.send("patient", [50], last=True), timeout=30)).ok
        assert (await dw.await_arrival("patient", timeout=30)).ok


async def test_a_cancelled_send_or_expect_ends_aborted_even_when_the_daemon_had_done_it(
        pair: tuple[Sidecar, Sidecar]) -> None:
    """A send, or an expect to a linked sender, is done in the daemon's reader before the
    worker's Cancel is read; a caller cancelled while it waits for the reply still gets what
    a cancelled call leaves in process, nothing going on: the request ends ABORTED, its peer's
    too, and nothing of it lands.  The daemon is stopped (SIGSTOP) while the caller waits, so
    it reads the call, the Cancel and the client's Abort in that order once it goes on."""
    prefill, decode = pair
    async with SidecarClient(prefill.socket) as pw, SidecarClient(decode.socket) as dw:
        await _roundtrip(pw, dw, "cancel-warm", 40, 40)  # linked: the expect runs inline
        dw.kv.write([41, 43], torch.zeros_like(dw.kv.pages([41, 43])))
        pw.kv.write([41], pattern(pw.layout, "cancel-expect", 1))
        pw.kv.write([43], pattern(pw.layout, "cancel-send", 1))

        async def cancelled(daemon: Sidecar, call: Callable[[], Awaitable[object]]) -> None:
            daemon.proc.send_signal(signal.SIGSTOP)
            try:
                with anyio.move_on_after(0.2) as scope:
                    await call()
                assert scope.cancelled_caught  # the call's reply never came: the daemon is stopped
            finally:
                daemon.proc.send_signal(signal.SIGCONT)

        with anyio.fail_after(30):
            await cancelled(decode, functools.partial(dw.expect, "cancel-expect", [41], sender=pw.address))
            arrival = await dw.await_arrival("cancel-expect")
            assert arrival.reason is FailureReason.ABORTED, arrival

            async def dropped() -> bool:  # the prefill has heard both the Expect and the Abort
                return await pw.expect_dropped("cancel-expect") is not None

            await eventually(dropped, 10, 0.01, what="the expect dropped on the prefill")
            sent = await pw.await_completion(await pw.send("cancel-expect", [41], last=True))
            assert sent.reason is FailureReason.ABORTED, sent

            await cancelled(prefill, functools.partial(pw.send, "cancel-send", [43], last=True))
            aborted = await pw.abort("cancel-send")  # answered after the send and its Abort
            assert aborted is not None and aborted.reason is FailureReason.ABORTED, aborted
            await dw.expect("cancel-send", [43], sender=pw.address)
            arrival = await dw.await_arrival("cancel-send")
            assert arrival.reason is FailureReason.ABORTED, arrival
        assert not dw.kv.pages([41, 43]).any()  # nothing landed
        await _roundtrip(pw, dw, "cancel-after", 42, 42)


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


# -- a daemon in this process: its connections and its loop's tasks, seen from the test -------


@contextlib.asynccontextmanager
async def daemon_here(roles: str = "prefill,decode") -> AsyncIterator[tuple[SidecarServer, str]]:
    """A sidecar daemon in this process, wired as ``Daemon`` wires one (segment, service,
    server on a Unix socket, the tests' settings): a test can look at its connections and
    count the tasks of its loop, which is the test's."""
    workdir = short_tmpdir()
    sock, shm = os.path.join(workdir, "here.sock"), f"kvs-test-{uuid.uuid4().hex[:10]}"
    cfg = load(CONFIG / "decode.toml", daemon_env(sock, shm, role=roles, layout=SMALL_LAYOUT, base={}, **TEST_ENV))
    try:
        with Segment.create(shm, cfg.layout) as segment:
            async with TransferService(cfg.service, pool=segment.tensor) as svc:
                server = SidecarServer(svc, cfg, segment.name)
                async with anyio.create_task_group() as tg:
                    await tg.start(server.serve, await anyio.create_unix_listener(sock, mode=0o600))
                    try:
                        yield server, sock
                    finally:
                        with anyio.CancelScope(shield=True):
                            await server.close()
                        tg.cancel_scope.cancel()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def connection(server: SidecarServer, client: SidecarClient) -> Connection:
    return next(c for c in server.conns if c.client == client.name)


async def test_a_worker_s_requests_are_watched_without_a_task_each(pair: tuple[Sidecar, Sidecar]) -> None:
    """N requests a worker sent and N it expects, none ended: the daemon holds no task for
    any of them (a done callback on the service's future each); then every one ends, and
    the worker hears of each by its Finished frame, bytes exact on both sides."""
    prefill, decode = pair
    n = 24  # sends in pages 0..n-1 of the daemon here, expects in n..2n-1, a warm-up in 62, 63
    async with daemon_here() as (server, sock), SidecarClient(sock, name="watched") as hw, \
            SidecarClient(prefill.socket) as pw, SidecarClient(decode.socket) as dw:
        await _roundtrip(hw, dw, "watch-warm-out", 62, 62)  # both links up: their tasks are there before
        await _roundtrip(pw, hw, "watch-warm-in", 63, 63)
        conn = connection(server, hw)
        before = len(asyncio.all_tasks())
        handles = []
        for i in range(n):
            hw.kv.write([i], pattern(hw.layout, f"watch-out-{i}", 1))
            handles.append(await hw.send(f"watch-out-{i}", [i], last=True))  # no receiver yet: waits for one
            await hw.expect(f"watch-in-{i}", [n + i], sender=pw.address)
        assert all(h.result is None for h in handles)
        assert len(asyncio.all_tasks()) - before < 4, "a task per request in the daemon"
        assert len(conn.watched) == conn.watching == 2 * n
        with anyio.fail_after(60):
            for i in range(n):
                await dw.expect(f"watch-out-{i}", [i], sender=hw.address)
                pw.kv.write([i], pattern(pw.layout, f"watch-in-{i}", 1))
                await pw.send(f"watch-in-{i}", [i], last=True)
            for i, handle in enumerate(handles):  # no timeout: answered by the Finished frames alone
                assert (result := await hw.await_completion(handle)).ok, result
                assert (arrival := await hw.await_arrival(f"watch-in-{i}")).ok, arrival
                assert (await dw.await_arrival(f"watch-out-{i}", timeout=30)).ok
                assert torch.equal(dw.kv.pages([i]), pattern(dw.layout, f"watch-out-{i}", 1))
                assert torch.equal(hw.kv.pages([n + i]), pattern(hw.layout, f"watch-in-{i}", 1))
        await eventually(lambda: conn.watching == 0, 10, what="every Finished frame written")
        assert not conn.watched and not conn.outbox and not conn.sending


async def test_an_expect_runs_in_the_reader_only_when_its_sender_is_linked(pair: tuple[Sidecar, Sidecar]) -> None:
    """An expect whose sender is linked ends in the reader's turn: no task, no scope, the
    bytes still exact.  One whose sender must be dialled runs in a task of its own: a dial
    that hangs (a listener that never answers) holds up none of the worker's other calls,
    and the expect is aborted without waiting for it."""
    prefill, _ = pair
    async with daemon_here() as (server, sock), SidecarClient(sock, name="inline") as hw, \
            SidecarClient(prefill.socket) as pw:
        ran: list[tuple[str, bool]] = []
        run_call = server._run_call

        async def spy(conn: Connection, msg: object, scope: anyio.CancelScope | None) -> None:
            ran.append((type(msg).__name__, scope is None))
            await run_call(conn, msg, scope)  # type: ignore[arg-type]

        server._run_call = spy  # type: ignore[method-assign]
        await _roundtrip(pw, hw, "inline-warm", 0, 0)  # the first expect dials: a task
        assert ("Expect", False) in ran, ran
        ran.clear()
        await _roundtrip(pw, hw, "inline-linked", 1, 1)
        assert ("Expect", True) in ran and ("Expect", False) not in ran, ran
        with socket.create_server(("127.0.0.1", 0)) as mute:  # accepts (the backlog), never speaks
            ran.clear()
            async with anyio.create_task_group() as tg:
                muted = f"127.0.0.1:{mute.getsockname()[1]}"
                tg.start_soon(functools.partial(hw.expect, "inline-mute", [2], sender=muted))
                await eventually(lambda: ("Expect", False) in ran, 10, what="the expect's task")
                with anyio.fail_after(5):  # the reader is free: another call is answered meanwhile
                    await hw.fetch_status()
                    assert (await hw.abort("inline-mute")) is not None
            assert hw.poll_arrival("inline-mute") is KVPoll.Failed
        await _roundtrip(pw, hw, "inline-after", 3, 3)


async def test_a_burst_of_ends_reaches_the_worker_in_few_writes(pair: tuple[Sidecar, Sidecar]) -> None:
    """64 requests that end together (their sender sent them all while this loop, the
    daemon's, was held) reach the worker, each with its own result, bytes exact."""
    prefill, _ = pair
    n = 64
    async with daemon_here("decode") as (server, sock), SidecarClient(sock, name="burst") as hw, \
            SidecarClient(prefill.socket) as pw:
        await _roundtrip(pw, hw, "burst-warm", 0, 0)
        conn = connection(server, hw)
        writes: list[int] = []
        send_frame = conn.framed.send_frame

        async def counting(data: bytes, timeout: float | None = None, *, shield: bool = False) -> None:
            if finished := sum(isinstance(r, Finished) for r in _frames(data)):
                writes.append(finished)
            await send_frame(data, timeout, shield=shield)

        conn.framed.send_frame = counting  # type: ignore[method-assign]
        for i in range(n):
            await hw.expect(f"burst-{i}", [i], sender=pw.address)
            pw.kv.write([i], pattern(pw.layout, f"burst-{i}", 1))

        sent, done = threading.Event(), threading.Event()

        def send_all() -> None:  # another thread, its own loop and client: this loop is held meanwhile
            async def sends() -> None:
                async with SidecarClient(prefill.socket, name="burst-sender") as sender:
                    for i in range(n):
                        await sender.send(f"burst-{i}", [i], last=True)
                    sent.set()
                    await anyio.to_thread.run_sync(done.wait, 60)  # connected until they ended
            anyio.run(sends)

        worker = threading.Thread(target=send_all)
        worker.start()
        try:
            assert sent.wait(30)  # holds this loop, the daemon's, on purpose: the ends pile up ...
            time.sleep(0.2)  # noqa: ASYNC251 - ... and their notifications with them
            with anyio.fail_after(60):
                for i in range(n):
                    assert (arrival := await hw.await_arrival(f"burst-{i}")).ok, arrival
                    assert arrival.request_id == f"burst-{i}" and arrival.pages == 1
                    assert torch.equal(hw.kv.pages([i]), pattern(hw.layout, f"burst-{i}", 1))
        finally:
            done.set()
            await anyio.to_thread.run_sync(worker.join, 30)
        assert sum(writes) == n and len(writes) < n, writes


async def test_a_departed_worker_s_futures_are_cancelled_and_its_requests_aborted(
        pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = pair
    n = 8
    async with daemon_here() as (server, sock), SidecarClient(prefill.socket) as pw, \
            SidecarClient(decode.socket) as dw:
        async with SidecarClient(sock, name="leaving", drain_grace_s=0) as gone:
            for i in range(n):
                await gone.send(f"left-out-{i}", [i], last=True)  # no receiver: waits for one
                await gone.expect(f"left-in-{i}", [n + i], sender=pw.address)
            futures = list(connection(server, gone).watched.values())
            assert len(futures) == 2 * n
            ref = weakref.ref(connection(server, gone))
        await eventually(lambda: ref() not in server.conns, 10, what="the daemon seeing the worker gone")
        assert all(f.cancelled() for f in futures)
        assert server.counters.aborted_on_disconnect_total == 2 * n
        svc = server.svc
        for i in range(n):
            assert (await svc.await_arrival(f"left-in-{i}")).reason is FailureReason.ABORTED
            assert svc.poll_arrival(f"left-in-{i}") is KVPoll.Failed
        await anyio.lowlevel.checkpoint()  # the cancelled futures' callbacks run: then nothing holds the connection
        gc.collect()
        assert ref() is None, gc.get_referrers(ref())
        # the daemon serves on: another worker's transfer, both ways
        async with SidecarClient(sock, name="next") as hw:
            await _roundtrip(hw, dw, "after-left-out", 40, 40)
            await _roundtrip(pw, hw, "after-left-in", 41, 41)
            assert not connection(server, hw).watched


async def test_a_worker_that_takes_no_finished_frame_is_dropped(
        pair: tuple[Sidecar, Sidecar], monkeypatch: pytest.MonkeyPatch) -> None:
    """The pusher's write of a Finished frame does not complete (a worker that stopped
    reading its socket): within ``PUSH_TIMEOUT_S`` the daemon counts it, drops the worker
    and aborts what it left unfinished; the worker hears the connection end; another
    worker's transfers go on, bytes exact."""
    prefill, _ = pair
    monkeypatch.setattr(server_mod, "PUSH_TIMEOUT_S", 0.5)
    async with daemon_here("decode") as (server, sock), SidecarClient(prefill.socket) as pw:
        async with SidecarClient(sock, name="stuck") as stuck:
            await _roundtrip(pw, stuck, "stuck-warm", 0, 0)
            conn = connection(server, stuck)
            stream_send = conn.framed.stream.send

            async def never_taken(data: bytes) -> None:
                if any(isinstance(r, Finished) for r in _frames(data)):
                    await anyio.sleep_forever()  # the socket's buffer stays full: the write never ends
                await stream_send(data)

            # the socket takes nothing at once, and no Finished frame ever: every write waits
            monkeypatch.setattr(conn.framed, "_send_now", lambda data: 0)
            monkeypatch.setattr(conn.framed.stream, "send", never_taken)
            await stuck.expect("stuck-lands", [1], sender=pw.address)
            await stuck.expect("stuck-left", [2], sender=pw.address)  # never sent: left unfinished
            pw.kv.write([1], pattern(pw.layout, "stuck-lands", 1))
            assert (await pw.await_completion(await pw.send("stuck-lands", [1], last=True))).ok
            with anyio.fail_after(30):
                why = await stuck.wait_disconnected()
            assert "closed" in why or "error" in why, why
        assert server.counters.refused["push_timeout"] == 1
        assert conn.closed and conn not in server.conns
        left = await server.svc.await_arrival("stuck-left")
        assert left.reason is FailureReason.ABORTED, left
        assert server.counters.aborted_on_disconnect_total == 1
        async with SidecarClient(sock, name="after-stuck") as hw:
            await _roundtrip(pw, hw, "after-stuck", 3, 3)


async def _roundtrip(src: SidecarClient, dst: SidecarClient, rid: str, src_page: int, dst_page: int) -> None:
    """One request of one page, ``src``'s worker to ``dst``'s, checked byte for byte."""
    with anyio.fail_after(30):
        src.kv.write([src_page], pattern(src.layout, rid, 1))
        await dst.expect(rid, [dst_page], sender=src.address)
        assert (await src.await_completion(await src.send(rid, [src_page], last=True))).ok
        assert (await dst.await_arrival(rid)).ok
        assert torch.equal(dst.kv.pages([dst_page]), pattern(dst.layout, rid, 1))


def _frames(data: bytes) -> Iterator[object]:
    while data:
        n = int.from_bytes(data[:4], "big")
        yield decode_server(data[4:4 + n])
        data = data[4 + n:]
