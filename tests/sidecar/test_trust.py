"""Hostile or careless workers against real daemons: a worker acting on another's
request ids, bytes that are not a Hello (dribbled, oversized, too early), a
crowd of idle connections, a daemon out of file descriptors.  Each one gets a
clear refusal, is counted in ``kvservice_refused_total``, leaves the daemon up,
and a legitimate transfer passes byte-exact afterwards.

One pair of daemons serves the module; each test compares metrics before and
after, so the numbers it checks are its own.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator

import anyio
import pytest
import torch

from kvservice import FailureReason, KVPoll, KVServiceError, SidecarClient
from kvservice.sidecar import NotOwnerError
from kvservice.sidecar.handle import RequestState, SidecarHandle
from kvservice.sidecar.server import HELLO_MAX_BYTES, HELLO_TIMEOUT_S
from kvservice.sidecar.wire import (
    SIDECAR_OLDEST_VERSION,
    SIDECAR_PROTOCOL_VERSION,
    Error,
    Hello,
    Send,
    Welcome,
    decode_server,
    encode,
)
from kvservice.testing import pattern
from tests.helpers import eventually

from .daemons import REPO, Sidecar, aget, frame, metrics, raw_exchange, read_to_end, sidecars, wait_bound

pytestmark = pytest.mark.nixl

MAX_CLIENTS = 10


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Sidecar, Sidecar]]:
    with sidecars("prefill", "decode", env={"KVSERVICE_SIDECAR_MAX_CLIENTS": str(MAX_CLIENTS)}) as (p, d):
        yield p, d


def refused(kind: str, where: str = "workers") -> str:
    return f'kvservice_refused_total{{where="{where}",kind="{kind}"}}'


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


async def transfer(prefill: Sidecar, decode: Sidecar, rid: str, src: list[int], dst: list[int]) -> None:
    """A legitimate worker on each side moves ``rid``; the bytes must arrive exactly."""
    async with SidecarClient(prefill.socket, name="legit") as pw, SidecarClient(decode.socket, name="legit") as dw:
        pw.kv.write(src, pattern(pw.layout, rid, len(src)))
        await dw.expect(rid, dst, sender=pw.address)
        sent = await pw.await_completion(await pw.send(rid, src, last=True), timeout=30)
        assert sent.ok, sent
        arrived = await dw.await_arrival(rid, timeout=30)
        assert arrived.ok, arrived
        assert torch.equal(dw.kv.pages(dst), pattern(dw.layout, rid, len(dst)))


def assert_up(*daemons: Sidecar) -> None:
    for d in daemons:
        assert d.proc is not None and d.proc.poll() is None, d.log()[-3000:]


# -- request ids belong to their worker ---------------------------------------------------------


async def test_a_worker_cannot_touch_another_workers_request(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = pair
    before_p, before_d = await metrics(prefill.http), await metrics(decode.http)
    async with SidecarClient(prefill.socket, name="owner") as a, SidecarClient(prefill.socket, name="other") as b, \
            SidecarClient(decode.socket, name="owner") as d, SidecarClient(decode.socket, name="other") as e:
        rid, src, dst = "owned", [10, 11], [20, 21]
        a.kv.write(src, pattern(a.layout, rid, 2))
        await d.expect(rid, dst, sender=a.address)
        handle = await a.send(rid, src[:1], last=False)  # half sent: the request is live
        await wait_bound(a, handle)
        b.kv.write([12], torch.ones_like(b.kv.pages([12])))
        forged = SidecarHandle(RequestState(rid, "send"))  # what a worker could send the daemon by hand
        attempts: list[Callable[[], Awaitable[object]]] = [
            lambda: b.send(rid, [12], last=True), lambda: b.abort(rid),  # on the prefill sidecar
            lambda: b.await_completion(forged, timeout=1), lambda: b.fetch_poll(forged),
            lambda: e.fetch_poll_arrival(rid), lambda: e.await_arrival(rid, timeout=1),  # on the decode sidecar
            lambda: e.expect(rid, [30], sender=a.address), lambda: e.abort(rid),
        ]
        for call in attempts:
            with pytest.raises(NotOwnerError, match=r"^request 'owned' belongs to another worker of this sidecar$"):
                await call()
        # the owner's request went on untouched: its second chunk completes it, byte-exact
        assert await a.fetch_poll(handle) in (KVPoll.WaitingForInput, KVPoll.Transferring)
        result = await a.await_completion(await a.send(rid, src[1:], last=True), timeout=30)
        assert result.ok and result.pages == 2, result
        assert (await d.await_arrival(rid, timeout=30)).ok
        assert torch.equal(d.kv.pages(dst), pattern(d.layout, rid, 2))
        # an ended request stays its owner's: its result is not another worker's to read
        with pytest.raises(NotOwnerError):
            await b.await_completion(forged, timeout=1)
        assert issubclass(NotOwnerError, KVServiceError)
        assert (await b.fetch_status())["workers_refused"]["not_owner"] >= 5
    after_p, after_d = await metrics(prefill.http), await metrics(decode.http)
    assert delta(after_p, before_p, refused("not_owner")) == 5
    assert delta(after_d, before_d, refused("not_owner")) == 4
    assert delta(after_p, before_p, 'kvservice_transfers_total{side="send",status="SUCCESS",reason=""}') == 1
    assert delta(after_p, before_p, 'kvservice_transfers_total{side="send",status="FAILED",reason="ABORTED"}') == 0
    logged = [ev for ev in prefill.events("sidecar.not_owner") if ev.get("request_id") == rid]
    assert {ev["op"] for ev in logged} == {"send", "abort", "await_completion", "poll"}
    assert_up(prefill, decode)


async def test_the_ids_of_a_worker_that_left_stay_its_own(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = pair
    before = await metrics(prefill.http)
    async with SidecarClient(decode.socket) as dw, SidecarClient(prefill.socket, name="successor") as b:
        await dw.expect("orphan", [40, 41], sender=b.address)
        doomed = subprocess.Popen(  # noqa: ASYNC220 - a plain child we SIGKILL by pid
            [sys.executable, "-m", "tests.sidecar.worker", prefill.socket, "orphan", "40", "41"],
            stdout=subprocess.PIPE, cwd=REPO)
        try:
            assert doomed.stdout is not None
            line = await anyio.to_thread.run_sync(doomed.stdout.readline)
            assert line.strip() == b"sent", line
        finally:
            doomed.kill()
            doomed.wait(timeout=30)
            if doomed.stdout is not None:
                doomed.stdout.close()
        assert (await dw.await_arrival("orphan", timeout=30)).reason is FailureReason.ABORTED
        for call in (lambda: b.send("orphan", [41], last=True), lambda: b.abort("orphan")):
            with pytest.raises(NotOwnerError, match=r"which disconnected \(its unfinished requests were aborted\)"):
                await call()
    after = await metrics(prefill.http)
    assert delta(after, before, refused("not_owner")) == 2
    assert delta(after, before, "kvservice_sidecar_disconnect_aborts_total") == 1
    await transfer(prefill, decode, "after-orphan", [42], [42])


# -- bytes that are not a worker ----------------------------------------------------------------


async def test_hostile_bytes_before_the_hello_are_refused_and_counted(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = pair
    before = await metrics(prefill.http)
    hello = encode(Hello(SIDECAR_PROTOCOL_VERSION, "dribbler"))
    async with await anyio.connect_unix(prefill.socket) as s:  # a whole Hello, one byte at a time: fine
        for i in range(len(hello)):
            await s.send(hello[i:i + 1])
            await anyio.sleep(0.005)
        await s.send(encode(Hello(SIDECAR_PROTOCOL_VERSION, "again")))  # then breaks the protocol
        replies = await read_to_end(s)
    assert isinstance(replies[0], Welcome) and isinstance(replies[-1], Error), replies
    assert "hello after the handshake" in replies[-1].message

    cases = [  # payload, what the one Error (call 0) says
        ((HELLO_MAX_BYTES + 1).to_bytes(4, "big") + b"x" * 64, f"exceeds the limit of {HELLO_MAX_BYTES}"),
        (encode(Send(1, "early", [0], True)), "expected hello, got Send"),
        (frame(b"\x92\x01"), "malformed frame"),
        (encode(Hello(SIDECAR_OLDEST_VERSION - 1, "past")), "protocol version"),
    ]
    for payload, message in cases:
        replies = await raw_exchange(prefill.socket, payload, hello=False)
        assert len(replies) == 1 and isinstance(replies[0], Error) and replies[0].call == 0, replies
        assert message in replies[0].message, (message, replies)

    t0 = time.monotonic()
    async with await anyio.connect_unix(prefill.socket) as s:  # a header that never ends
        async def dribble() -> None:
            for byte in hello[:3]:
                await s.send(bytes([byte]))
                await anyio.sleep(1.0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(dribble)
            replies = await read_to_end(s, timeout=HELLO_TIMEOUT_S + 10)
            tg.cancel_scope.cancel()
    waited = time.monotonic() - t0
    assert [r.message for r in replies if isinstance(r, Error)] == [f"no hello within {HELLO_TIMEOUT_S:g} s"]
    assert HELLO_TIMEOUT_S - 0.5 < waited < HELLO_TIMEOUT_S + 5

    after = await metrics(prefill.http)
    assert delta(after, before, refused("hello_invalid")) == len(cases)
    assert delta(after, before, refused("frame")) == 1
    assert delta(after, before, refused("hello_timeout")) == 1
    assert delta(after, before, "kvservice_sidecar_connections_refused_total") == len(cases) + 1
    assert delta(after, before, "kvservice_sidecar_frames_rejected_total") == len(cases) + 1
    assert_up(prefill)
    await transfer(prefill, decode, "after-bytes", [1, 2], [3, 4])


async def test_two_hundred_idle_connections_are_bounded_by_max_clients(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = pair

    async def no_workers() -> bool:  # the daemon's metrics: asked over HTTP
        return not (await metrics(prefill.http))["kvservice_sidecar_workers_connected"]

    await eventually(no_workers, 30, 0.05, what="earlier tests' workers gone")
    before = await metrics(prefill.http)
    n = 200
    messages: list[str] = []
    async with anyio.create_task_group() as tg:
        async def idle() -> None:
            async with await anyio.connect_unix(prefill.socket) as s:  # says nothing at all
                messages.extend(r.message for r in await read_to_end(s) if isinstance(r, Error))

        for _ in range(n):
            tg.start_soon(idle)
        await anyio.sleep(1.0)
        with pytest.raises(KVServiceError, match="too many workers connected"):  # full meanwhile ...
            async with SidecarClient(prefill.socket):
                pass
    too_many = f"too many workers connected (sidecar.max_clients = {MAX_CLIENTS})"
    assert sorted(set(messages)) == [f"no hello within {HELLO_TIMEOUT_S:g} s", too_many]
    assert messages.count(too_many) == n - MAX_CLIENTS
    after = await metrics(prefill.http)
    assert delta(after, before, refused("too_many_workers")) == n - MAX_CLIENTS + 1
    assert delta(after, before, refused("hello_timeout")) == MAX_CLIENTS
    assert delta(after, before, "kvservice_sidecar_connections_refused_total") == n + 1
    assert_up(prefill)
    await transfer(prefill, decode, "after-crowd", [5], [6])  # ... and served again once they are gone


async def test_the_ops_endpoint_counts_bad_requests(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, _ = pair
    before = await metrics(prefill.http)
    host, port = prefill.http.rsplit(":", 1)
    for raw in (b"GARBAGE\r\n\r\n", b"GET /" + b"x" * 9000):
        async with await anyio.connect_tcp(host, int(port)) as tcp:
            await tcp.send(raw)
            with anyio.fail_after(30):
                assert (await tcp.receive()).startswith(b"HTTP/1.1 4")
    after = await metrics(prefill.http)
    assert delta(after, before, refused("bad_request", "http")) == 1
    assert delta(after, before, refused("head_too_large", "http")) == 1
    assert await aget(prefill.http, "/healthz") == (200, "ok\n")
    text = (await aget(prefill.http, "/metrics"))[1]
    assert "# TYPE kvservice_refused_total counter" in text


# -- out of file descriptors ----------------------------------------------------------------------


def _no_new_descriptors(pid: int) -> int:
    """A descriptor limit under which ``pid`` can open nothing more: new descriptors take the
    lowest free number, which must be below the limit, and every number below 3 stays taken
    (stdin, stdout, stderr), so no descriptor the daemon closes meanwhile makes room."""
    used = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    assert {0, 1, 2} <= used, used
    return 3


async def test_a_daemon_out_of_descriptors_backs_off_and_recovers(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = pair
    # linked before: while out of descriptors, UCX's own listener may fail an accept() too, and
    # then refuses new peers for good (seen here when the limit came right after start-up)
    await transfer(prefill, decode, "before-emfile", [7, 8], [9, 10])
    before = await metrics(prefill.http)
    logged_before = len([e for e in prefill.events("listener.accept_failed") if e["listener"] == "workers"])
    soft, hard = resource.prlimit(prefill.pid, resource.RLIMIT_NOFILE)
    assert soft == hard  # raised at start
    try:
        # no descriptor below the limit is free: the daemon's next accept() fails with EMFILE
        resource.prlimit(prefill.pid, resource.RLIMIT_NOFILE, (_no_new_descriptors(prefill.pid), hard))
    except PermissionError:
        pytest.skip("cannot change the daemon's descriptor limit here")
    host, port = prefill.http.rsplit(":", 1)
    try:
        async with await anyio.connect_unix(prefill.socket) as s, \
                await anyio.connect_tcp(host, int(port)) as probe:  # both wait in the kernel's backlogs
            await s.send(encode(Hello(SIDECAR_PROTOCOL_VERSION, "patient")))
            await probe.send(b"GET /healthz HTTP/1.1\r\n\r\n")

            def failures() -> list[dict[str, object]]:
                return [e for e in prefill.events("listener.accept_failed") if e["listener"] == "workers"]

            await eventually(lambda: len(failures()) > logged_before, 20, 0.05,
                             what="an accept failure in the daemon's log")
            t0 = time.monotonic()
            await anyio.sleep(3.0)
            during = failures()[logged_before:]
            window = time.monotonic() - t0
            resource.prlimit(prefill.pid, resource.RLIMIT_NOFILE, (soft, hard))
            # backed off (10 ms doubling to 1 s): about 9 tries in 3 s, not a busy loop's thousands
            assert 3 <= len(during) <= 12, (len(during), window)
            assert "EMFILE" in str(during[0]["error"]) or "Too many open files" in str(during[0]["error"])
            assert [e["retry_in_s"] for e in during[:4]] == [0.01, 0.02, 0.04, 0.08]
            with anyio.fail_after(10):  # accepted at the next try, and greeted
                data = await s.receive()
                assert (await probe.receive()).startswith(b"HTTP/1.1 200 OK")
            assert isinstance(decode_server(data[4:4 + int.from_bytes(data[:4], "big")]), Welcome)
    finally:
        resource.prlimit(prefill.pid, resource.RLIMIT_NOFILE, (soft, hard))
    assert_up(prefill)
    await transfer(prefill, decode, "after-emfile", [11, 12], [13, 14])
    after = await metrics(prefill.http)
    logged = len([e for e in prefill.events("listener.accept_failed") if e["listener"] == "workers"])
    assert delta(after, before, refused("accept_error")) == logged - logged_before
    assert delta(after, before, refused("accept_error", "http")) >= 1  # the ops endpoint backed off too
