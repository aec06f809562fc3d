"""Token-major pages sliced by tensor parallelism, through the sender's staging buffer
(``kvservice._transfer.staging``): real NIXL agents, decode ranks in child processes,
bytes verified head by head, and the buffer's ranges given back on every path."""

from __future__ import annotations

import contextlib
import signal
from typing import Any

import anyio
import pytest

from kvservice import FailureReason, TensorParallel, TransferService
from kvservice.memory.synthetic import EngineSpec, SyntheticKV
from tests.helpers import config, eventually
from tests.system.test_engines import children, engine_config, untouched, verified

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

SRC, DST = [0, 1, 7], [9, 10, 2]
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def spec(**kw: Any) -> EngineSpec:
    kw.setdefault("pages", 16)
    return EngineSpec(engine="sglang_mha", layers=3, page_tokens=4, heads=4, head_dim=8, **kw)


Status = dict[str, Any]


async def _tp_send(tp: TensorParallel, svc_cfg: dict[str, Any], *, rounds: int = 1,
                   decode_cfg: dict[str, Any] | None = None) -> tuple[list[Status], list[Status]]:
    """Prefill ranks here, decode ranks in children: every decode rank verified (its heads
    from every source, pages no request named still zero).  The prefill and the decode
    services' status."""
    prefill = [SyntheticKV(spec(tp_size=tp.prefill, tp_rank=i)) for i in range(tp.prefill)]
    decodes = [engine_config(spec(tp_size=tp.decode, tp_rank=j), **(decode_cfg or {})) for j in range(tp.decode)]
    async with children(*decodes) as ranks, contextlib.AsyncExitStack() as stack:
        services = [await stack.enter_async_context(TransferService(config(**svc_cfg), memory=kv.memory))
                    for kv in prefill]
        for n in range(rounds):
            rid = f"r{n}"
            for kv in prefill:
                kv.fill(rid, SRC)
            for j, rank in enumerate(ranks):
                for i in tp.sources(j):
                    sub = tp.request_id(rid, i, j)
                    await rank.command(op="expect", rid=sub, pages=DST, sender=services[i].address)
                    await rank.event("expecting", sub)
            handles = [(svc, h) for i, svc in enumerate(services) for h in await tp.send(svc, i, rid, SRC, last=True)]
            for svc, h in handles:
                assert (await svc.await_completion(h, timeout=20)).ok
            for j, rank in enumerate(ranks):
                for i in tp.sources(j):
                    assert (await rank.event("arrived", tp.request_id(rid, i, j)))["status"] == "SUCCESS"
                assert await verified(rank, DST, f"{rid}-rank{j}", pattern=rid), f"decode rank {j}"
                assert await untouched(rank, DST)
        theirs = []
        for rank in ranks:
            await rank.command(op="status")
            theirs.append(await rank.event("status"))
        return [svc.status() for svc in services], theirs


async def test_one_prefill_rank_gathers_each_decode_ranks_heads_through_staging() -> None:
    """tp 1 -> 2, token-major: each sub-request is gathered (counted) and lands exact; the
    ranges are free again once the sends completed."""
    (status,), decodes = await _tp_send(TensorParallel(1, 2), {}, rounds=2)
    assert status["staging"] == {"gathered": 4}
    assert status["staging_held_bytes"] == 0
    assert [d["staging"] for d in decodes] == [{}, {}]  # whole pages land there


async def test_two_to_four_gathers_on_every_prefill_rank() -> None:
    statuses, _ = await _tp_send(TensorParallel(2, 4), {})
    assert [s["staging"] for s in statuses] == [{"gathered": 2}, {"gathered": 2}]


async def test_two_prefill_ranks_write_into_the_decode_ranks_staging_which_scatters() -> None:
    """tp 2 -> 1, token-major: each source writes its whole pages into a range the decode
    rank named; the decode rank copies them into its pages' heads before SUCCESS."""
    statuses, (decode,) = await _tp_send(TensorParallel(2, 1), {}, rounds=2)
    assert decode["staging"] == {"scattered": 4}
    assert decode["staging_held_bytes"] == 0 and decode["unsettled_pages"] == 0
    assert [s["staging"] for s in statuses] == [{}, {}]


async def test_four_to_two_scatters_on_every_decode_rank() -> None:
    _, decodes = await _tp_send(TensorParallel(4, 2), {})
    assert [d["staging"] for d in decodes] == [{"scattered": 2}, {"scattered": 2}]


async def test_decode_staging_full_falls_back_to_per_token_descriptors_exact() -> None:
    """Room for one sub-request on the decode rank: one source scatters, the other (its
    Expect names no range) is written by per-token descriptors; both land exact."""
    _, (decode,) = await _tp_send(TensorParallel(2, 1), {}, decode_cfg={"staging_bytes": 4000})
    assert decode["staging"] == {"scattered": 1, "fallback_full": 1}
    assert decode["staging_held_bytes"] == 0


async def test_staging_too_small_falls_back_to_per_token_descriptors_exact() -> None:
    """A buffer smaller than one sub-request: every send moves by per-token descriptors,
    counted, and still lands exact."""
    # one sub-request: 6 regions x 3 pages x (4 tokens x 2 heads x 8 x 2 bytes) = 2304 bytes
    (status,), _ = await _tp_send(TensorParallel(1, 2), {"staging_bytes": 2048})
    assert status["staging"] == {"fallback_too_large": 2}


async def test_staging_full_falls_back_for_the_send_that_finds_no_room_exact() -> None:
    """Room for one sub-request: the first send gathers, the one beside it finds the buffer
    held and moves by per-token descriptors; both land exact.  That the second finds the
    first still in flight is a race (on a loaded machine the first's WRITE of 2 KiB may end
    before the second is staged, and then the second gathers too), so a few rounds run:
    every sub-request of every round lands exact, and at least one found the buffer full."""
    rounds = 4
    (status,), _ = await _tp_send(TensorParallel(1, 2), {"staging_bytes": 4000}, rounds=rounds)
    counts = status["staging"]
    assert set(counts) == {"gathered", "fallback_full"}, counts
    assert counts["gathered"] + counts["fallback_full"] == 2 * rounds and counts["gathered"] >= rounds, counts
    assert status["staging_held_bytes"] == 0


async def test_staging_off_moves_by_per_token_descriptors() -> None:
    (status,), _ = await _tp_send(TensorParallel(1, 2), {"staging_bytes": 0})
    assert status["staging"] == {}
    _, (decode,) = await _tp_send(TensorParallel(2, 1), {}, decode_cfg={"staging_bytes": 0})
    assert decode["staging"] == {} and decode["staging_held_bytes"] == 0


async def test_receiver_killed_mid_transfer_frees_the_senders_range() -> None:
    """A decode rank SIGKILLed while a gathered WRITE to it is in flight (stopped first, over
    tcp, so the WRITE cannot complete): the send fails, and its range is free again."""
    big = {"pages": 512, "page_tokens": 16, "heads": 8, "head_dim": 128}
    kv = SyntheticKV(EngineSpec(engine="sglang_mha", layers=2, **big))
    decode = EngineSpec(engine="sglang_mha", layers=2, tp_size=2, tp_rank=0, **big)
    pages = list(range(512))
    # The decode dials a service that has just started: its handshake waits for that
    # service's vetting child to boot (seconds on a loaded machine), inside the dialler's
    # connect_timeout_s; the first link gets 30 s, as in the fan-out tests.
    async with children(engine_config(decode, ucx_env=TCP, connect_timeout_s=30)) as (victim,), \
            TransferService(config(ucx_env=TCP, peer_timeout_s=60), memory=kv.memory) as svc:
        rid = TensorParallel.request_id("k", 0, 0)
        await victim.command(op="expect", rid=rid, pages=pages, sender=svc.address)
        await victim.event("expecting", rid, timeout=60)  # linked (or failed: then not held below)
        await eventually(lambda: svc.status()["expects_before_send"] == 1,
                         what=lambda: f"the Expect held (the decode's events: {victim.backlog})")
        victim.signal(signal.SIGSTOP)
        handle = await svc.send(rid, pages, last=True)
        await eventually(lambda: svc.status()["staging_held_bytes"] > 0)
        victim.signal(signal.SIGKILL)
        with anyio.fail_after(20):
            result = await svc.await_completion(handle)
        assert result.reason in (FailureReason.PEER_LOST, FailureReason.REMOTE_DISCONNECT), result
        await eventually(lambda: svc.status()["staging_held_bytes"] == 0)
        assert svc.status()["staging"] == {"gathered": 1}


async def test_sender_killed_mid_write_into_staging_holds_the_range_until_settled() -> None:
    """A prefill rank (tp 2) SIGSTOPped while its WRITE into the decode rank's (tp 1) staging
    is under way: the decode's request fails (its deadline) but is not settled, and its range
    stays held (the WRITE could resume); once the sender is SIGKILLed, both are settled and
    the range is free."""
    big = {"layers": 2, "pages": 1024, "page_tokens": 16, "heads": 8, "head_dim": 128}
    kv = SyntheticKV(EngineSpec(engine="sglang_mha", **big))
    prefill = EngineSpec(engine="sglang_mha", tp_size=2, tp_rank=0, **big)  # type: ignore[arg-type]
    pages = list(range(1024))
    svc_cfg = config(ucx_env=TCP, heartbeat_interval_s=0.2, peer_timeout_s=1.0)
    async with children(engine_config(prefill, ucx_env=TCP)) as (victim,), \
            TransferService(svc_cfg, memory=kv.memory) as svc:
        warm = TensorParallel.request_id("warm", 0, 0)  # link first: the deadline is the copy's alone
        await svc.expect(warm, [1], sender=victim.address)
        await victim.command(op="send", rid=warm, pages=[0], last=True)
        assert (await svc.await_arrival(warm, timeout=30)).ok
        rid = TensorParallel.request_id("k", 0, 0)
        await victim.command(op="fill", rid=rid, pages=pages)
        await victim.event("filled", rid)
        await svc.expect(rid, pages, sender=victim.address, timeout=1.5)
        held = svc.status()["staging_held_bytes"]
        assert held == 4 * 1024 * 16 * 4 * 128 * 2  # 4 regions x 1024 pages x the sender's page
        await victim.command(op="send", rid=rid, pages=pages, last=True)
        await victim.event("sent", rid)
        victim.signal(signal.SIGSTOP)
        try:
            failed = await svc.await_arrival(rid, timeout=10)
            assert failed.reason in (FailureReason.TIMEOUT, FailureReason.PEER_LOST), failed
            still = await svc.await_settled(rid, timeout=1.0)
            assert not still.settled, still
            assert svc.status()["staging_held_bytes"] == held
        finally:
            victim.signal(signal.SIGKILL)
        with anyio.fail_after(15):
            settled = await svc.await_settled(rid)
        assert settled.settled and not settled.ok, settled
        assert svc.status()["staging_held_bytes"] == 0
        assert svc.status()["staging"] == {"scattered": 2}  # the warm-up's and this one
