"""One service holding 64 linked peers (the issue's target), all found by name through
etcd: each links (timed), sends one request, every page byte-verified.  Printed: link
set-up time per peer, the hub's memory per linked peer, its peers (figures, not asserted)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import anyio
import anyio.streams.text
import pytest
import torch

from kvservice import KVLayout, TransferService
from kvservice.testing import pattern
from kvservice.testing.inspect import inside
from tests.helpers import LOOPBACK_UCX, config, eventually, members, peer_config, scaled

from .etcd_server import EtcdServer

pytestmark = [pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(300)]

PEERS = 64
GUARD_S = scaled(120.0)  # a hang guard, never a timed assertion
HUB = KVLayout(layers=2, page_tokens=16, kv_heads=2, head_dim=64, dtype="bfloat16", num_pages=2 * PEERS)


def rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def test_one_service_holds_64_linked_peers(etcd: EtcdServer) -> None:
    # 64 services in one child process on a loaded machine: a keep-alive may run late, so
    # leases (and a lapse's grace) are as long as the run's load needs; nothing here waits them out
    leases = {"etcd_ttl_s": float(max(10, round(scaled(10.0)))), "etcd_rejoin_grace_s": max(5.0, scaled(5.0))}
    disc = {"discovery": "etcd", "etcd_endpoints": [etcd.endpoint], "cluster": "many", **leases}
    spec = {"n": PEERS, "config": peer_config(**disc, drain_grace_s=0.5)}
    child = await anyio.open_process([sys.executable, "-m", "tests.discovery.many_child", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ))
    try:
        assert child.stdout is not None and child.stdin is not None
        lines = anyio.streams.text.TextReceiveStream(child.stdout)
        buffered = ""

        async def line() -> dict[str, object]:
            nonlocal buffered
            with anyio.fail_after(GUARD_S):
                while "\n" not in buffered:
                    buffered += await lines.receive()
            text, buffered = buffered.split("\n", 1)
            return json.loads(text)  # type: ignore[no-any-return]

        assert (await line()) == {"event": "ready", "n": PEERS}
        async with TransferService(config(HUB, **disc, discovery_name="hub", discovery_role="decode",
                                          ucx_env=LOOPBACK_UCX)) as hub:
            await eventually(members(hub, lambda ms: len(ms) >= PEERS, "prefill"), GUARD_S, 0.1,
                             what=f"the watch listing all {PEERS} prefills")
            await inside(hub).vetter.ready()  # time the links, not its start
            before = rss_kib()
            link_s = []
            for i in range(PEERS):
                t0 = time.perf_counter()
                await hub.expect(f"m{i}", [2 * i, 2 * i + 1], sender=f"peer-{i}", timeout=GUARD_S)
                link_s.append(time.perf_counter() - t0)
            after = rss_kib()
            assert len(hub.status()["peers"]) == PEERS
            await child.stdin.send(b"go\n")
            sent = [await line() for _ in range(PEERS)]
            assert all(s["ok"] for s in sent), sent
            for i in range(PEERS):
                got = await hub.await_arrival(f"m{i}", timeout=GUARD_S)
                assert got.ok, got
                assert torch.equal(hub.kv.pages([2 * i, 2 * i + 1]), pattern(HUB, f"m{i}", 2)), i
            links = sorted(link_s)
            print(f"\n{PEERS} linked peers in one service (peers by name through etcd): link set-up per peer "
                  f"median {statistics.median(links) * 1e3:.1f} ms, max {links[-1] * 1e3:.1f} ms; "
                  f"memory per linked peer {(after - before) / PEERS:.0f} KiB (hub RSS {before // 1024} -> "
                  f"{after // 1024} MiB)")
        await child.stdin.aclose()
        with anyio.fail_after(GUARD_S):
            await child.wait()
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
