"""etcd is not on the data path, each case made to happen to the etcd process the test
started: stopped (SIGSTOP) for 30 s while linked peers transfer, killed and replaced by an
empty one, and unreachable when a service starts ("fail" refuses to start, saying why;
"wait" starts once etcd answers)."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
import torch

from kvservice import TransferService
from kvservice.discovery.registry import DiscoveryUnavailable
from kvservice.testing import PeerProcess, pattern
from tests.helpers import READY_S, SMALL, config, eventually, members, peer_config, scaled

from .etcd_server import EtcdServer, require_etcd

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

GUARD_S = scaled(30.0)  # a hang guard, never a timed assertion
OUTAGE_S = 30.0  # how long etcd stays stopped (the "30 s or more")
MAX_REQUESTS = 2000  # bounds the traffic loop in count as well as in time


def etcd_opts(endpoint: str, name: str, role: str, **kw: Any) -> dict[str, Any]:
    return {"discovery": "etcd", "etcd_endpoints": [endpoint], "cluster": "outage", "discovery_name": name,
            "discovery_role": role, **kw}


class Traffic:
    """Requests from a child prefill to the in-process decode, one after another, each
    byte-verified, until stopped."""

    def __init__(self, decode: TransferService, prefill: PeerProcess) -> None:
        self.decode, self.prefill = decode, prefill
        self.ok = 0
        self.failed: list[str] = []
        self._stop = anyio.Event()
        self._finished = anyio.Event()

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self._finished.set()

    async def _run(self) -> None:
        src = [0, 1, 2, 3]
        await self.prefill.command(op="fill", rid="pat", pages=src)
        await self.prefill.event("filled", "pat")
        for n in range(MAX_REQUESTS):
            if self._stop.is_set():
                return
            rid, dst = f"r{n}", [8 + 4 * (n % 8) + i for i in range(4)]
            await self.decode.expect(rid, dst, sender="prefill-0")
            await self.prefill.command(op="send", rid=rid, pages=src)
            got = await self.decode.await_arrival(rid, timeout=GUARD_S)
            # the sender's side too (and its events read: a peer's unread output is a backlog)
            await self.prefill.event("sent", rid, timeout=GUARD_S)
            sent = await self.prefill.event("completed", rid, timeout=GUARD_S)
            if got.ok and sent["status"] == "SUCCESS" and torch.equal(self.decode.kv.pages(dst),
                                                                     pattern(SMALL, "pat", 4)):
                self.ok += 1
            else:
                self.failed.append(f"{rid}: {got.status} {got.reason} {got.message}; sender: {sent}")
            await anyio.sleep(0.05)

    async def stop(self) -> None:
        """Stop after the request in flight, and wait for it."""
        self._stop.set()
        with anyio.fail_after(GUARD_S):
            await self._finished.wait()


@contextlib.asynccontextmanager
async def flowing(etcd: EtcdServer) -> AsyncIterator[tuple[TransferService, PeerProcess, Traffic]]:
    """A child prefill and an in-process decode that found it through etcd, with Traffic
    between them already past its first 5 requests; the traffic stops with the block."""
    async with anyio.create_task_group() as tg:
        prefill = await PeerProcess.start(tg, peer_config(**etcd_opts(etcd.endpoint, "prefill-0", "prefill")),
                                          ready_timeout=READY_S)
        try:
            async with TransferService(config(**etcd_opts(etcd.endpoint, "decode-0", "decode"))) as decode:
                await eventually(members(decode, lambda ms: len(ms) == 1, "prefill"), timeout=GUARD_S)
                traffic = Traffic(decode, prefill)
                tg.start_soon(traffic.run)
                try:
                    await eventually(lambda: traffic.ok >= 5, timeout=GUARD_S)
                    yield decode, prefill, traffic
                finally:
                    with anyio.CancelScope(shield=True):
                        await traffic.stop()
        finally:
            with anyio.CancelScope(shield=True):
                await prefill.stop(timeout=5)
            tg.cancel_scope.cancel()


async def test_etcd_stopped_30s_drops_nothing_and_registrations_return(etcd: EtcdServer) -> None:
    async with flowing(etcd) as (decode, prefill, traffic):
        before = traffic.ok
        etcd.pause()
        paused = time.monotonic()
        await anyio.sleep(OUTAGE_S)
        during = traffic.ok - before
        etcd.resume()
        print(f"etcd stopped {time.monotonic() - paused:.1f} s: {during} requests completed meanwhile")
        # every lease lapses when a stopped etcd resumes; each service registers again
        await eventually(lambda: decode.status()["discovery"]["outages"] >= 1
                         and decode.status()["discovery"]["registered"], timeout=GUARD_S)
        await eventually(members(decode, lambda ms: [m.agent for m in ms] == [prefill.agent]), timeout=GUARD_S)
        await anyio.sleep(decode.config.etcd_rejoin_grace_s + 1)  # past any lapse's grace
        await eventually(lambda: traffic.ok >= before + during + 5, timeout=GUARD_S)
        await traffic.stop()
        print(f"after etcd resumed: {decode.status()['discovery']['registrations']} registrations "
              f"(a second one: etcd had revoked the lease)")
        assert during > 0, "no transfer completed while etcd was stopped"
        assert traffic.failed == []
        outcomes = decode.status()["outcomes"]
        assert not [k for k in outcomes if k != "recv.SUCCESS"], outcomes
        assert decode.status()["peers"] == [prefill.address]  # the same link all along
        assert [m.agent for m in await decode.live_peers()] == [prefill.agent]


async def test_etcd_replaced_by_an_empty_one_registrations_return(etcd: EtcdServer) -> None:
    async with flowing(etcd) as (decode, prefill, traffic):
        etcd.kill()
        shutil.rmtree(etcd.data_dir)  # its keys and leases are gone with it
        before = traffic.ok
        await eventually(lambda: traffic.ok >= before + 5, timeout=GUARD_S)  # without etcd
        etcd.start()  # the same ports, empty
        await eventually(lambda: decode.status()["discovery"]["registrations"] == 2, timeout=GUARD_S)
        await eventually(members(decode, lambda ms: [m.agent for m in ms] == [prefill.agent]), timeout=GUARD_S)
        await traffic.stop()
        assert traffic.failed == []
        assert decode.status()["peers"] == [prefill.address]


async def test_unreachable_at_start_fails_saying_so(etcd: EtcdServer) -> None:
    etcd.kill()
    cfg = config(**etcd_opts(etcd.endpoint, "decode-0", "decode", etcd_connect_timeout_s=1.0))
    with pytest.raises(DiscoveryUnavailable) as info:
        async with TransferService(cfg):
            pytest.fail("started without etcd")
    message = str(info.value)
    assert f"cannot reach etcd at {etcd.endpoint}" in message and 'etcd_unreachable = "fail"' in message


async def test_unreachable_at_start_waits_by_config(tmp_path: Path) -> None:
    require_etcd()
    late = EtcdServer(tmp_path / "etcd")  # ports chosen, not started yet
    cfg = config(**etcd_opts(late.endpoint, "decode-0", "decode", etcd_unreachable="wait",
                             etcd_connect_timeout_s=1.0))
    try:
        with structlog.testing.capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                async def start_etcd_later() -> None:
                    await eventually(lambda: any(e["event"] == "discovery.etcd_unreachable" for e in logs),
                                     timeout=GUARD_S)
                    await anyio.to_thread.run_sync(late.start)

                tg.start_soon(start_etcd_later)
                with anyio.fail_after(GUARD_S):
                    async with TransferService(cfg) as svc:
                        assert svc.status()["discovery"]["registered"]
        missed = [e for e in logs if e["event"] == "discovery.etcd_unreachable"]
        assert missed and missed[0]["endpoints"] == [late.endpoint] and not missed[0]["registered"]
    finally:
        late.stop()


async def test_leaving_while_a_keepalive_is_in_flight_leaves_cleanly(etcd: EtcdServer) -> None:
    """etcd paused so that a keep-alive is on the wire when the service leaves; etcd resumes
    while the leave's revoke waits, and the keep-alive then answers "alive" for a lease the
    service already dropped: it must neither write the key again nor fail the service's exit
    (it once asserted the lease, and the exit raised)."""
    import aetcd

    cfg = config(**etcd_opts(etcd.endpoint, "decode-0", "decode", etcd_keepalive_s=0.2, etcd_connect_timeout_s=5.0))
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(GUARD_S):
            async with TransferService(cfg) as svc:
                assert svc.status()["discovery"]["registered"]
                etcd.pause()
                await anyio.sleep(1.0)  # past the keep-alive interval: one is waiting on etcd

                async def resume_soon() -> None:
                    await anyio.sleep(0.5)  # the leave's revoke is waiting on etcd by then
                    etcd.resume()

                tg.start_soon(resume_soon)
    host, port = etcd.endpoint.split(":")
    async with aetcd.Client(host=host, port=int(port)) as client:
        left = await client.get(b"/kvservice/outage/services/decode-0")
    assert left is None, "the service's key outlived its leave"
