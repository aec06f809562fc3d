"""Per-peer transfer histograms with real NIXL peers in real processes: time per
transfer (both sides) and time to post, by peer, in ``status()`` and in the
Prometheus text ``svc.metrics`` gives (parsed by prometheus_client's parser); the
label bound; a failed transfer."""

from __future__ import annotations

import signal
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvservice import FailureReason, KVLayout, KVPoll, TransferService
from kvservice.testing import PeerProcess
from tests.helpers import config, eventually, peer_config, peers, scaled

pytestmark = pytest.mark.nixl

N = 3  # transfers each way with each peer
GUARD_S = scaled(30.0)  # a hang guard for each wait, never a timed assertion
#: first links wait for the metadata vetting: on a loaded machine that can pass the default
#: connect_timeout_s (5 s), which bounds the whole handshake (as in test_fanout)
SLOW_LINK = {"connect_timeout_s": GUARD_S}


def scrape(svc: TransferService) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``svc.metrics`` as Prometheus text, parsed: sample name -> sorted labels -> value."""
    registry = CollectorRegistry()
    registry.register(svc.metrics)
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def histogram(got: dict[str, Any], name: str, **labels: str) -> tuple[list[tuple[float, float]], float, float]:
    """(le, cumulative count) in ``le`` order, sum and count of one labelled series."""
    want = set(labels.items())
    buckets = sorted((float(dict(k)["le"]), v) for k, v in got[f"{name}_bucket"].items()
                     if set(k) - {("le", dict(k)["le"])} == want)
    key = tuple(sorted(labels.items()))
    return buckets, got[f"{name}_sum"][key], got[f"{name}_count"][key]


def assert_histogram(got: dict[str, Any], name: str, count: int, **labels: str) -> None:
    buckets, total, n = histogram(got, name, **labels)
    assert n == count, (name, labels, n)
    assert total > 0, (name, labels)
    counts = [c for _, c in buckets]
    assert counts == sorted(counts), (name, labels, buckets)  # le buckets are monotone
    assert buckets[-1] == (float("inf"), count), (name, labels, buckets)  # +Inf is the count


async def send_to(svc: TransferService, peer: PeerProcess, rid: str) -> None:
    await peer.command(op="expect", rid=rid, pages=[7, 8], sender=svc.address)
    await peer.event("expecting", rid)
    result = await svc.await_completion(await svc.send(rid, [1, 2], last=True), timeout=GUARD_S)
    assert result.ok, result
    assert (await peer.event("arrived", rid))["status"] == "SUCCESS"


async def receive_from(svc: TransferService, peer: PeerProcess, rid: str) -> None:
    await svc.expect(rid, [20, 21], sender=peer.address)
    await peer.command(op="send", rid=rid, pages=[5, 6], last=True)
    result = await svc.await_arrival(rid, timeout=GUARD_S)
    assert result.ok, result
    assert (await peer.event("completed", rid))["status"] == "SUCCESS"


async def test_time_per_transfer_and_to_post_by_peer_both_sides() -> None:
    async with peers(peer_config(**SLOW_LINK), peer_config(**SLOW_LINK)) as (a, b), \
            TransferService(config(**SLOW_LINK)) as svc:
        for peer in (a, b):
            for i in range(N):
                await send_to(svc, peer, f"s-{peer.agent}-{i}")
                await receive_from(svc, peer, f"r-{peer.agent}-{i}")
        got = scrape(svc)
        for peer in (a, b):
            for side in ("send", "recv"):
                assert_histogram(got, "kvservice_xfer_time_seconds", N, side=side, peer=peer.address)
                assert got["kvservice_xfer_failed_total"][(("peer", peer.address), ("side", side))] == 0
            # one post call per request: each sent its pages in one chunk, and nothing failed
            assert_histogram(got, "kvservice_xfer_post_time_seconds", N, peer=peer.address)
        labels = {dict(k)["peer"] for k in got["kvservice_xfer_time_seconds_count"]}
        assert labels == {a.address, b.address}  # nothing under "other" below the bound
        # status() holds their counts and sums
        times = svc.status()["peer_times"]
        assert set(times) == {a.address, b.address}
        assert times[a.address]["xfer_time"]["recv"]["count"] == N
        assert times[b.address]["post_time"]["count"] == N
        assert times[b.address]["xfer_time"]["send"]["sum_s"] > 0


async def test_peers_past_the_label_bound_share_other() -> None:
    async with peers(peer_config(**SLOW_LINK), peer_config(**SLOW_LINK)) as (a, b), \
            TransferService(config(metrics_peer_labels=1, **SLOW_LINK)) as svc:
        for i in range(N):
            await send_to(svc, a, f"a{i}")  # a links first: it takes the one label
        for i in range(N):
            await send_to(svc, b, f"b{i}")
        await receive_from(svc, b, "b-in")
        got = scrape(svc)
        assert_histogram(got, "kvservice_xfer_time_seconds", N, side="send", peer=a.address)
        assert_histogram(got, "kvservice_xfer_time_seconds", N, side="send", peer="other")
        assert_histogram(got, "kvservice_xfer_time_seconds", 1, side="recv", peer="other")
        assert_histogram(got, "kvservice_xfer_post_time_seconds", N, peer="other")
        assert {dict(k)["peer"] for k in got["kvservice_xfer_time_seconds_count"]} == {a.address, "other"}
        assert set(svc.status()["peer_times"]) == {a.address, "other"}


# 64 KiB pages; 2048 of them (128 MiB) take tens of ms over UCX's tcp transport, so a
# SIGKILL lands while the WRITE is in flight (as in tests/faults/test_peer_faults.py)
BIG = KVLayout(layers=2, page_tokens=16, kv_heads=8, head_dim=128, dtype="bfloat16", num_pages=2048)
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


@pytest.mark.slow
async def test_a_failed_transfer_is_counted_under_its_peer_not_timed() -> None:
    cfg = peer_config(BIG, ucx_env=TCP, **SLOW_LINK)
    async with peers(cfg, cfg, env=TCP) as (victim, bystander), \
            TransferService(config(BIG, ucx_env=TCP, **SLOW_LINK)) as svc:
        await send_to(svc, victim, "before")
        await send_to(svc, bystander, "fine")
        await victim.command(op="expect", rid="big", pages=list(range(BIG.num_pages)), sender=svc.address)
        await victim.event("expecting", "big")
        handle = await svc.send("big", list(range(BIG.num_pages)), last=True, timeout=60)
        await eventually(lambda: handle.poll() is KVPoll.Transferring, timeout=10)
        victim.signal(signal.SIGKILL)
        with anyio.fail_after(10):  # hang guard; the transfer timeout is 60 s
            result = await svc.await_completion(handle)
        assert result.reason in {FailureReason.PEER_LOST, FailureReason.REMOTE_DISCONNECT}, result
        await eventually(lambda: svc.status()["peers"] == [bystander.address])
        got = scrape(svc)
        failed = got["kvservice_xfer_failed_total"]
        assert failed[(("peer", victim.address), ("side", "send"))] == 1
        assert failed[(("peer", bystander.address), ("side", "send"))] == 0
        # the failure is not a transfer time: only the transfer before it is timed
        assert_histogram(got, "kvservice_xfer_time_seconds", 1, side="send", peer=victim.address)
        # the lost peer keeps its series (there is room under the bound)
        assert svc.status()["peer_times"][victim.address]["failed"] == {"send": 1, "recv": 0}
