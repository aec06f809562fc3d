"""The daemon's life: a decode sidecar SIGKILLed mid-stream, a restart over its
leftovers, SIGTERM's drain, a second signal, and startup failures that each
exit non-zero with one clear line."""

from __future__ import annotations

import os
import shutil
import signal
import socket
from pathlib import Path

import anyio
import pytest
import torch

from kvservice import FailureReason, KVPoll, KVServiceError, SidecarClient
from kvservice.sidecar.daemon import EXIT_FORCED
from kvservice.testing import pattern
from tests.helpers import eventually

from .daemons import Sidecar, aget, metrics, short_tmpdir, sidecars, until_status, wait_bound

pytestmark = pytest.mark.nixl


async def _roundtrip(pw: SidecarClient, dw: SidecarClient, rid: str, src: list[int], dst: list[int]) -> None:
    pw.kv.write(src, pattern(pw.layout, rid, len(src)))
    await dw.expect(rid, dst, sender=pw.address)
    result = await pw.await_completion(await pw.send(rid, src, last=True), timeout=30)
    assert result.ok, result
    assert (await dw.await_arrival(rid, timeout=30)).ok
    assert torch.equal(dw.kv.pages(dst), pattern(dw.layout, rid, len(dst)))


async def test_decode_sidecar_killed_mid_stream_then_restarted_over_its_leftovers() -> None:
    with sidecars("prefill", "decode") as (prefill, decode):
        async with SidecarClient(prefill.socket) as pw:
            async with SidecarClient(decode.socket) as dw:
                await _roundtrip(pw, dw, "warm", [0], [0])
                handles = []
                for i in range(6):  # six requests mid-stream: first chunk sent, more to come
                    rid = f"mid-{i}"
                    pw.kv.write([2 * i + 1, 2 * i + 2], pattern(pw.layout, rid, 2))
                    await dw.expect(rid, [10 + 2 * i, 11 + 2 * i], sender=pw.address)
                    handles.append(await pw.send(rid, [2 * i + 1], last=False))
                for h in handles:
                    await wait_bound(pw, h)
                before = await metrics(prefill.http)
                assert decode.kill() == -signal.SIGKILL
                # the decode worker's own sidecar is gone: its waits end Failed, not hang
                lost = await dw.await_arrival("mid-0", timeout=30)
                assert lost.reason is FailureReason.PEER_LOST and "connection" in lost.message
                with pytest.raises(KVServiceError, match="connection lost"):
                    await dw.expect("later", [1], sender=pw.address)
            # the prefill side: every request ends Failed, the sidecar and its worker stay up
            reasons = set()
            for h in handles:
                result = await pw.await_completion(h, timeout=30)
                assert not result.ok and h.poll() is KVPoll.Failed
                reasons.add(result.reason)
            assert reasons <= {FailureReason.PEER_LOST, FailureReason.REMOTE_DISCONNECT}, reasons
            assert await aget(prefill.http, "/healthz") == (200, "ok\n")
            assert prefill.proc is not None and prefill.proc.poll() is None
            after = await metrics(prefill.http)
            failed = sum(after.get(f'kvservice_transfers_total{{side="send",status="FAILED",reason="{r}"}}', 0)
                         - before.get(f'kvservice_transfers_total{{side="send",status="FAILED",reason="{r}"}}', 0)
                         for r in ("PEER_LOST", "REMOTE_DISCONNECT"))
            assert failed == 6
            assert after["kvservice_peers_connected"] == 0
            assert after['kvservice_transfers_in_flight{side="send"}'] == 0
            logged = [e for e in prefill.events("transfer.failed") if e["request_id"].startswith("mid-")]
            assert len(logged) == 6 and all(e["reason"] in ("PEER_LOST", "REMOTE_DISCONNECT") for e in logged)
            assert all(e["peer"] for e in logged)

            # a new decode sidecar over the dead one's socket and segment names
            assert decode.names_present()
            reborn = Sidecar("decode", decode.workdir, shm=decode.shm, name="decode")
            reborn.log_path = decode.log_path + ".2"
            reborn.start()
            try:
                events = {e["event"] for e in reborn.events()}
                assert {"shm.stale_removed", "socket.stale_removed"} <= events
                async with SidecarClient(reborn.socket) as dw2:
                    await _roundtrip(pw, dw2, "after-restart", [20, 21], [30, 31])
            finally:
                assert reborn.stop() == 0
        assert reborn.names_gone()


async def test_sigterm_drains_in_flight_then_fails_the_rest_shutdown() -> None:
    env = {"KVSERVICE_SERVICE_DRAIN_GRACE_S": "6"}
    with sidecars("prefill", "decode", env=env) as (prefill, decode):
        async with SidecarClient(prefill.socket) as pw, SidecarClient(decode.socket) as dw:
            await _roundtrip(pw, dw, "warm", [0], [0])
            # "partial": its last chunk never comes; "late": complete, but its receiver is not known yet
            pw.kv.write([1, 2], pattern(pw.layout, "partial", 2))
            await dw.expect("partial", [1, 2], sender=pw.address)
            partial = await pw.send("partial", [1], last=False)
            await wait_bound(pw, partial)
            pw.kv.write([3], pattern(pw.layout, "late", 1))
            late = await pw.send("late", [3], last=True)
            assert late.poll() is KVPoll.Bootstrapping

            prefill.signal(signal.SIGTERM)
            await until_status(prefill.http, "/readyz", 503)
            with pytest.raises(KVServiceError, match="shutting down"):
                await pw.send("too-late", [4], last=True)
            with pytest.raises(KVServiceError):  # nor new workers
                async with SidecarClient(prefill.socket, connect_timeout=5):
                    pass
            # in flight when the signal came: drained to success
            await dw.expect("late", [3], sender=pw.address)
            assert (await pw.await_completion(late, timeout=30)).ok
            assert (await dw.await_arrival("late", timeout=30)).ok
            assert torch.equal(dw.kv.pages([3]), pattern(dw.layout, "late", 1))
            # never finishable: SHUTDOWN on both sides once the grace period is over
            assert (await pw.await_completion(partial, timeout=30)).reason is FailureReason.SHUTDOWN
            assert (await dw.await_arrival("partial", timeout=30)).reason is FailureReason.SHUTDOWN
            assert await anyio.to_thread.run_sync(prefill.wait, 30) == 0
            with pytest.raises(KVServiceError, match="connection lost"):
                await pw.send("after-exit", [5], last=True)
            assert await aget(decode.http, "/healthz") == (200, "ok\n")
        assert prefill.names_gone()
        events = [e["event"] for e in prefill.events()]
        assert events.index("shutdown.draining") < events.index("service.stopped") < events.index("shm.removed")


async def test_second_signal_exits_at_once() -> None:
    with sidecars("prefill", env={"KVSERVICE_SERVICE_DRAIN_GRACE_S": "120"}) as (prefill,):
        async with SidecarClient(prefill.socket) as pw:
            await pw.send("no-receiver", [0], last=True)  # keeps the drain waiting for 120 s
            prefill.signal(signal.SIGTERM)
            await until_status(prefill.http, "/readyz", 503)
            prefill.signal(signal.SIGINT)
            assert await anyio.to_thread.run_sync(prefill.wait, 30) == EXIT_FORCED
            await eventually(lambda: not pw.connected, timeout=30)
        assert prefill.names_gone()
        assert prefill.events("shutdown.forced")


def _one_clear_line(d: Sidecar, code: int, *fragments: str) -> None:
    lines = d.stderr_lines()
    assert code == 1, d.log()
    assert len(lines) == 1 and lines[0].startswith("kvservice serve: cannot start: "), d.log()
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not os.path.exists(f"/dev/shm/{d.shm}")  # nothing left behind


def test_startup_failures_exit_nonzero_with_one_clear_line(tmp_path: Path) -> None:
    workdir = short_tmpdir()
    try:
        _startup_failures(tmp_path, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _startup_failures(tmp_path: Path, workdir: str) -> None:
    fake = tmp_path / "fake" / "nixl"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no NIXL on this host')\n")
    blocker = Path(workdir) / "blocker.sock"
    blocker.write_text("precious")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [  # daemon, what its one line must say
            (Sidecar("prefill", workdir, name="http-taken", env={"KVSERVICE_HTTP_PORT": str(port)}),
             [f"http.port {port} on 127.0.0.1", "in use"]),
            (Sidecar("prefill", workdir, name="ctl-taken", env={"KVSERVICE_SERVICE_PORT": str(port)}),
             [f"service.port {port}", "in use"]),
            (Sidecar("prefill", workdir, name="no-nixl", env={"PYTHONPATH": str(fake.parent)}),
             ["NIXL is unavailable", "no NIXL on this host"]),
            (Sidecar("prefill", workdir, name="not-a-socket",
                     env={"KVSERVICE_SIDECAR_SOCKET_PATH": str(blocker)}), ["exists and is not a socket"]),
        ]
        for d, _ in cases:  # in parallel: each imports torch and maybe NIXL
            d.spawn()
        for d, fragments in cases:
            _one_clear_line(d, d.wait(60), *fragments)
    assert blocker.read_text() == "precious"
    assert not os.path.exists(cases[1][0].socket)

    with sidecars("prefill") as (live,):
        twin_socket = Sidecar("prefill", workdir, name="twin-socket",
                              env={"KVSERVICE_SIDECAR_SOCKET_PATH": live.socket})
        twin_shm = Sidecar("prefill", workdir, name="twin-shm", shm=live.shm)
        twin_socket.spawn()
        twin_shm.spawn()
        try:
            _one_clear_line(twin_socket, twin_socket.wait(60), "in use by a running daemon")
            assert twin_shm.wait(60) == 1  # (its segment name is the live one's: not checked as "left behind")
            lines = twin_shm.stderr_lines()
            assert len(lines) == 1 and "in use by a running daemon" in lines[0], lines
        finally:  # a failed check leaves no daemon running
            for twin in (twin_socket, twin_shm):
                twin.stop(timeout=10)
        # the live daemon kept both its names and still serves
        assert live.names_present()
        assert live.proc is not None and live.proc.poll() is None
