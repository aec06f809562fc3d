"""Hostile entries in etcd, written with a raw client (no cluster key is needed to write
to etcd): a key that is not UTF-8, one with a huge name, one whose name is not a member
name, garbage bytes as a value, one over 4 KiB, a value that parses but claims a linked member's agent
(put twice, as a second incarnation).  Each while two services are linked and moving
pages: both stay up (no etcd outage is counted either), a request held over the link
is not failed, every transfer passes byte-exact, the entry is ignored and counted (on
the running services' watch, and on the listing of a service that starts later), and
``kvservice cluster`` exits 0 listing the good members and saying what it skipped;
``status()`` and the metrics (the service's and the sidecar's) count each by kind.

A service whose own key is overwritten (garbage, or deleted while its lease lives)
writes it again, counted, and reappears for those who list later.  A forged member naming
a peer linked by address, "restarted", drops nothing: discovery vouches only for members
the engine named, at the address their agent was proven at."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvservice import FailureReason, KVPoll, TransferService
from kvservice.discovery.member import IGNORED, Member, encode, read
from kvservice.sidecar.metrics import render
from kvservice.testing import pattern
from tests.helpers import SMALL, config, eventually, members, scaled

from .etcd_server import EtcdServer

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

GUARD_S = scaled(30.0)  # a hang guard, never a timed assertion
MAX_TRANSFERS = 500  # bounds the background traffic in count as well as in time
CLUSTER = "hostile"
PREFIX = f"/kvservice/{CLUSTER}/services/".encode()


def etcd_opts(server: EtcdServer, name: str, role: str, **kw: Any) -> dict[str, Any]:
    return {"discovery": "etcd", "etcd_endpoints": (server.endpoint,), "cluster": CLUSTER,
            "discovery_name": name, "discovery_role": role, **kw}


@contextlib.asynccontextmanager
async def raw_client(server: EtcdServer) -> AsyncIterator[Any]:
    """A plain etcd client: what anyone who can reach etcd may write with."""
    import aetcd

    host, port = server.endpoint.split(":")
    async with aetcd.Client(host=host, port=int(port)) as client:
        yield client


async def transfer(prefill: TransferService, decode: TransferService, rid: str, src: list[int],
                   dst: list[int]) -> None:
    """``rid`` from ``prefill`` to ``decode`` by name; it arrives byte-exact."""
    prefill.kv.write(src, pattern(SMALL, rid, len(src)))
    await decode.expect(rid, dst, sender=prefill.status()["discovery"]["name"])
    handle = await prefill.send(rid, src, last=True, receiver=decode.status()["discovery"]["name"])
    sent = await prefill.await_completion(handle, timeout=GUARD_S)
    got = await decode.await_arrival(rid, timeout=GUARD_S)
    assert sent.ok and got.ok, (sent, got)
    assert torch.equal(decode.kv.pages(dst), pattern(SMALL, rid, len(src)))


class Traffic:
    """Transfers one after another, each byte-verified, until stopped."""

    def __init__(self, prefill: TransferService, decode: TransferService) -> None:
        self.prefill, self.decode = prefill, decode
        self.ok = 0
        self._stop = anyio.Event()

    async def run(self) -> None:
        for n in range(MAX_TRANSFERS):
            if self._stop.is_set():
                return
            await transfer(self.prefill, self.decode, f"t{n}", [1, 2], [10 + 2 * (n % 4), 11 + 2 * (n % 4)])
            self.ok += 1
            await anyio.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()


@contextlib.asynccontextmanager
async def linked(etcd: EtcdServer) -> AsyncIterator[tuple[TransferService, TransferService, Traffic]]:
    """prefill-0 and decode-0, linked (a transfer done), the decode holding "held" from
    the prefill over that link, and traffic flowing between them while the block runs."""
    async with TransferService(config(**etcd_opts(etcd, "prefill-0", "prefill"))) as prefill, \
            TransferService(config(**etcd_opts(etcd, "decode-0", "decode"))) as decode:
        await eventually(members(decode, lambda ms: len(ms) == 1), timeout=GUARD_S)
        await eventually(members(prefill, lambda ms: len(ms) == 1), timeout=GUARD_S)
        await transfer(prefill, decode, "first", [3], [30])
        await decode.expect("held", [40, 41], sender="prefill-0")
        traffic = Traffic(prefill, decode)
        async with anyio.create_task_group() as tg:
            tg.start_soon(traffic.run)
            yield prefill, decode, traffic
            traffic.stop()
        assert decode.poll_arrival("held") is not KVPoll.Failed
        # the request held over the link all along still arrives, byte-exact
        prefill.kv.write([4, 5], pattern(SMALL, "held", 2))
        sent = await prefill.await_completion(await prefill.send("held", [4, 5], last=True), timeout=GUARD_S)
        got = await decode.await_arrival("held", timeout=GUARD_S)
        assert sent.ok and got.ok, (sent, got)
        assert torch.equal(decode.kv.pages([40, 41]), pattern(SMALL, "held", 2))
        for svc in (prefill, decode):
            st = svc.status()["discovery"]
            assert st["registered"] and st["outages"] == 0, st


def claim_of(victim: TransferService, incarnation: int, name: str = "evil") -> bytes:
    """A well-formed registration of ``name`` naming ``victim``'s agent and address."""
    return encode(Member(name=name, address=victim.address, agent=victim.agent_name, incarnation=incarnation))


#: why -> the entries to put, given the prefill: (key, value)
HOSTILE: dict[str, Callable[[TransferService], list[tuple[bytes, bytes]]]] = {
    "key_not_utf8": lambda p: [(PREFIX + b"\xff\xfe\xfd", claim_of(p, 1))],
    "key_too_long": lambda p: [(PREFIX + b"n" * 8192, claim_of(p, 1))],
    "name_invalid": lambda p: [(PREFIX + b"../decode-0 x", claim_of(p, 1))],
    "value_invalid": lambda p: [(PREFIX + b"garbage", bytes(range(256)) * 4)],
    # a registration that would decode (JSON may start with blanks), but past the 4 KiB bound
    "value_too_long": lambda p: [(PREFIX + b"huge", b" " * 4096 + claim_of(p, 1, name="huge"))],
    "agent_taken": lambda p: [(PREFIX + b"evil", claim_of(p, 1)), (PREFIX + b"evil", claim_of(p, 2))],
}


async def cluster_cli(etcd: EtcdServer) -> tuple[list[str], str]:
    """``kvservice cluster --json``: the names it lists and what it said on stderr; it exits 0."""
    out = await anyio.run_process([sys.executable, "-m", "kvservice", "cluster", "--endpoints", etcd.endpoint,
                                   "--cluster", CLUSTER, "--json"], check=False)
    assert out.returncode == 0, out.stderr.decode()
    return sorted(r["name"] for r in json.loads(out.stdout)), out.stderr.decode()


@pytest.mark.parametrize("why", sorted(HOSTILE))
async def test_a_hostile_entry_is_ignored_and_counted(etcd: EtcdServer, why: str) -> None:
    async with linked(etcd) as (prefill, decode, traffic):
        entries = HOSTILE[why](prefill)
        async with raw_client(etcd) as client:
            for key, value in entries:
                await client.put(key, value)
        for svc in (prefill, decode):  # seen on the watch
            await eventually(lambda s=svc: s.status()["discovery"]["ignored"].get(why, 0) >= len(entries),  # type: ignore[misc]
                             timeout=GUARD_S)
        # a service that starts now lists the entry, ignores it, and sees the good members
        async with TransferService(config(**etcd_opts(etcd, "decode-1", "decode"))) as late:
            assert late.status()["discovery"]["ignored"].get(why, 0) >= 1
            await eventually(members(late, lambda ms: [m.name for m in ms] == ["decode-0", "prefill-0"]),
                             timeout=GUARD_S)
            await transfer(prefill, late, "late", [6], [50])
            names, said = await cluster_cli(etcd)
            assert names == ["decode-0", "decode-1", "prefill-0"]
            assert f"skipped 1 ({why}=1)" in said, said
        assert [m.name for m in await decode.live_peers()] == ["prefill-0"]
        assert decode.stats.refused["discovery_member"] >= len(entries)
        await eventually(lambda: traffic.ok >= 3, timeout=GUARD_S)


@pytest.mark.parametrize("how", ["garbage", "deleted"])
async def test_an_overwritten_own_key_is_written_again(etcd: EtcdServer, how: str) -> None:
    async with linked(etcd) as (prefill, decode, traffic):
        key = PREFIX + b"prefill-0"
        async with raw_client(etcd) as client:
            if how == "garbage":
                await client.put(key, b"\x00not a member\xff")
            else:
                await client.delete(key)
            await eventually(lambda: prefill.status()["discovery"]["rewrites"] >= 1, timeout=GUARD_S)
            got = await client.get(key)
        assert got is not None
        mine = read(key, bytes(got.value), PREFIX.decode())
        assert isinstance(mine, Member) and mine.agent == prefill.agent_name, mine
        assert prefill.stats.refused["discovery_own_key"] >= 1
        # those who list later see it again
        names, _ = await cluster_cli(etcd)
        assert names == ["decode-0", "prefill-0"]
        async with TransferService(config(**etcd_opts(etcd, "decode-1", "decode"))) as late:
            assert "prefill-0" in [m.name for m in await late.live_peers()]
            await transfer(prefill, late, "late", [6], [50])
        assert [m.agent for m in await decode.live_peers()] == [prefill.agent_name]
        await eventually(lambda: traffic.ok >= 3, timeout=GUARD_S)


@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named_elsewhere"])
async def test_a_forged_registration_does_not_drop_a_peer_linked_by_address(etcd: EtcdServer, named: bool) -> None:
    """A peer linked by address (``static``: it registers nothing) is named twice by a
    forged member in etcd, as a second incarnation: the claim alone must not drop the
    live, authenticated link.  ``named_elsewhere``: the forged member says the agent is at
    an address where nobody answers, and the engine names it (an Expect that fails): a
    member the engine named vouches for its agent only where that agent was proven."""
    async with TransferService(config(**etcd_opts(etcd, "decode-0", "decode"))) as decode, \
            TransferService(config()) as static:
        await decode.expect("first", [30], sender=static.address)
        static.kv.write([3], pattern(SMALL, "first", 1))
        sent = await static.await_completion(await static.send("first", [3], last=True), timeout=GUARD_S)
        assert sent.ok and (await decode.await_arrival("first", timeout=GUARD_S)).ok
        await decode.expect("held", [40], sender=static.address)
        where = "127.0.0.1:9" if named else static.address  # port 9: nobody listens
        forged = [encode(Member(name="forged", address=where, agent=static.agent_name, incarnation=n))
                  for n in (1, 2)]
        async with raw_client(etcd) as client:
            await client.put(PREFIX + b"forged", forged[0])
            await eventually(members(decode, lambda ms: [m.incarnation for m in ms] == [1]), timeout=GUARD_S)
            if named:
                await decode.expect("lured", [32], sender="forged")
                lured = await decode.await_arrival("lured", timeout=GUARD_S)
                assert not lured.ok, lured
            await client.put(PREFIX + b"forged", forged[1])
        await eventually(members(decode, lambda ms: [m.incarnation for m in ms] == [2]), timeout=GUARD_S)
        # a whole transfer after the claim was taken in: a drop it caused has failed "held" by now
        await decode.expect("probe", [31], sender=static.address)
        static.kv.write([5], pattern(SMALL, "probe", 1))
        probe = await static.await_completion(await static.send("probe", [5], last=True), timeout=GUARD_S)
        assert probe.ok and (await decode.await_arrival("probe", timeout=GUARD_S)).ok, probe
        assert decode.poll_arrival("held") is not KVPoll.Failed, decode.status()
        static.kv.write([4], pattern(SMALL, "held", 1))
        sent = await static.await_completion(await static.send("held", [4], last=True), timeout=GUARD_S)
        got = await decode.await_arrival("held", timeout=GUARD_S)
        assert sent.ok and got.ok and got.reason is not FailureReason.PEER_LOST, (sent, got)
        assert decode.status()["peers"] == [static.address]


def samples(text: str, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of ``family`` in a Prometheus text scrape, by their labels."""
    return {tuple(sorted(sample.labels.items())): sample.value
            for fam in text_string_to_metric_families(text) if fam.name == family for sample in fam.samples}


async def test_ignored_registrations_show_in_status_and_metrics_by_kind(etcd: EtcdServer) -> None:
    """Every kind of hostile entry, written while two services are linked: each is counted by
    kind in ``status()["discovery"]["ignored"]``, in the service's own collector and in what
    the sidecar's ``/metrics`` serves (``kvservice_discovery_ignored_total{why}``, beside
    ``kvservice_refused_total{kind="discovery_member"}``), and a transfer by name still passes."""
    async with linked(etcd) as (prefill, decode, traffic):
        expected = {why: len(HOSTILE[why](prefill)) for why in HOSTILE}
        async with raw_client(etcd) as client:
            for why in sorted(HOSTILE):
                for key, value in HOSTILE[why](prefill):
                    await client.put(key, value)
        await eventually(lambda: all(decode.status()["discovery"]["ignored"][why] >= n for why, n in expected.items()),
                         timeout=GUARD_S)
        ignored = decode.status()["discovery"]["ignored"]
        assert set(ignored) == set(IGNORED) and ignored["key_outside_prefix"] == 0, ignored  # every kind, zeros too
        registry = CollectorRegistry()
        registry.register(decode.metrics)
        for text in (generate_latest(registry).decode(), render(decode, None, None, ready=True)):
            by_why = samples(text, "kvservice_discovery_ignored")
            assert by_why == {(("why", why),): float(n) for why, n in ignored.items()}, by_why
            refused = samples(text, "kvservice_refused")
            assert refused[(("kind", "discovery_member"), ("where", "service"))] >= sum(expected.values()), refused
        await transfer(prefill, decode, "after", [6], [50])
        await eventually(lambda: traffic.ok >= 3, timeout=GUARD_S)
