"""Token-major pages sliced by tensor parallelism, through the sender's staging buffer
(``kvservice.memory._staging``): real NIXL agents, decode ranks in child processes,
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
from tests.integration.test_engines import children, engine_config, untouched, verified

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

SRC, DST = [0, 1, 7], [9, 10, 2]
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def spec(**kw: Any) -> EngineSpec:
    kw.setdefault("pages", 16)
    return EngineSpec(engine="sglang_mha", layers=3, page_tokens=4, heads=4, head_dim=8, **kw)


async def _tp_send(tp: TensorParallel, svc_cfg: dict[str, Any], *, rounds: int = 1) -> list[dict[str, Any]]:
    """Prefill ranks here, decode ranks in children: every decode rank verified (its heads
    from every source, pages no request named still zero).  The prefill services' status."""
    prefill = [SyntheticKV(spec(tp_size=tp.prefill, tp_rank=i)) for i in range(tp.prefill)]
    decodes = [engine_config(spec(tp_size=tp.decode, tp_rank=j)) for j in range(tp.decode)]
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
        return [svc.status() for svc in services]


async def test_one_prefill_rank_gathers_each_decode_ranks_heads_through_staging() -> None:
    """tp 1 -> 2, token-major: each sub-request is gathered (counted) and lands exact; the
    ranges are free again once the sends completed."""
    (status,) = await _tp_send(TensorParallel(1, 2), {}, rounds=2)
    assert status["staging"] == {"gathered": 4}
    assert status["staging_held_bytes"] == 0


async def test_two_to_four_gathers_on_every_prefill_rank() -> None:
    statuses = await _tp_send(TensorParallel(2, 4), {})
    assert [s["staging"] for s in statuses] == [{"gathered": 2}, {"gathered": 2}]


async def test_staging_too_small_falls_back_to_per_token_descriptors_exact() -> None:
    """A buffer smaller than one sub-request: every send moves by per-token descriptors,
    counted, and still lands exact."""
    # one sub-request: 6 regions x 3 pages x (4 tokens x 2 heads x 8 x 2 bytes) = 2304 bytes
    (status,) = await _tp_send(TensorParallel(1, 2), {"staging_bytes": 2048})
    assert status["staging"] == {"fallback_too_large": 2}


async def test_staging_full_falls_back_for_the_send_that_finds_no_room_exact() -> None:
    """Room for one sub-request: the first send gathers, the one beside it finds the buffer
    held and moves by per-token descriptors; both land exact."""
    (status,) = await _tp_send(TensorParallel(1, 2), {"staging_bytes": 4000})
    assert status["staging"] == {"gathered": 1, "fallback_full": 1}
    assert status["staging_held_bytes"] == 0


async def test_staging_off_moves_by_per_token_descriptors() -> None:
    (status,) = await _tp_send(TensorParallel(1, 2), {"staging_bytes": 0})
    assert status["staging"] == {}


async def test_receiver_killed_mid_transfer_frees_the_senders_range() -> None:
    """A decode rank SIGKILLed while a gathered WRITE to it is in flight (stopped first, over
    tcp, so the WRITE cannot complete): the send fails, and its range is free again."""
    big = {"pages": 512, "page_tokens": 16, "heads": 8, "head_dim": 128}
    kv = SyntheticKV(EngineSpec(engine="sglang_mha", layers=2, **big))
    decode = EngineSpec(engine="sglang_mha", layers=2, tp_size=2, tp_rank=0, **big)
    pages = list(range(512))
    async with children(engine_config(decode, ucx_env=TCP)) as (victim,), \
            TransferService(config(ucx_env=TCP, peer_timeout_s=60), memory=kv.memory) as svc:
        rid = TensorParallel.request_id("k", 0, 0)
        await victim.command(op="expect", rid=rid, pages=pages, sender=svc.address)
        await eventually(lambda: svc.status()["expects_before_send"] == 1)
        victim.signal(signal.SIGSTOP)
        handle = await svc.send(rid, pages, last=True)
        await eventually(lambda: svc.status()["staging_held_bytes"] > 0)
        victim.signal(signal.SIGKILL)
        with anyio.fail_after(20):
            result = await svc.await_completion(handle)
        assert result.reason in (FailureReason.PEER_LOST, FailureReason.REMOTE_DISCONNECT), result
        await eventually(lambda: svc.status()["staging_held_bytes"] == 0)
        assert svc.status()["staging"] == {"gathered": 1}
