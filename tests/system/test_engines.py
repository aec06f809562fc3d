"""Engines' own KV memory over real NIXL: every engine layout, tensor parallelism on
both sides, layer-wise sends and the per-request payload, byte-verified page by page
(and pages no request named still zero), between this process and child processes."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from kvservice import FailureReason, TensorParallel, TransferService, TransferStatus
from kvservice.memory.synthetic import ENGINES, EngineSpec, SyntheticKV
from kvservice.testing import PeerProcess
from tests.helpers import READY_S, config, peer_config

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

PAGES = 16


def spec(engine: str = "sglang_mha", **kw: Any) -> EngineSpec:
    kw.setdefault("heads", 1 if engine == "mla" else 4)
    kw.setdefault("head_dim", 32 if engine == "mla" else 8)
    return EngineSpec(engine=engine, layers=3, pages=PAGES, page_tokens=4, **kw)


def engine_config(s: EngineSpec, **kw: Any) -> dict[str, Any]:
    return peer_config(engine=s.to_dict(), **kw)


@contextlib.asynccontextmanager
async def children(*configs: dict[str, Any]) -> AsyncIterator[list[PeerProcess]]:
    """Child services started at once (a TP group is several); all stopped on exit."""
    started: dict[int, PeerProcess] = {}
    async with anyio.create_task_group() as tg:
        async def start(i: int, cfg: dict[str, Any]) -> None:
            started[i] = await PeerProcess.start(tg, cfg, ready_timeout=READY_S)

        try:
            async with anyio.create_task_group() as starting:
                for i, cfg in enumerate(configs):
                    starting.start_soon(start, i, cfg)
            yield [started[i] for i in range(len(configs))]
        finally:
            with anyio.CancelScope(shield=True):
                for p in started.values():
                    await p.stop(timeout=5)
            tg.cancel_scope.cancel()


async def verified(peer: PeerProcess, pages: list[int], rid: str, *, pattern: str | None = None,
                   layers: list[int] | None = None) -> bool:
    await peer.command(op="verify", rid=rid, pages=pages, pattern=pattern or rid, layers=layers)
    return bool((await peer.event("verified", rid))["ok"])


async def untouched(peer: PeerProcess, named: list[int]) -> bool:
    await peer.command(op="untouched", pages=[p for p in range(PAGES) if p not in named])
    return bool((await peer.event("untouched"))["ok"])


# -- each engine layout -----------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
async def test_engine_layout_moves_its_pages_byte_exact(engine: str) -> None:
    s = spec(engine)
    kv = SyntheticKV(s)
    async with children(engine_config(s)) as (decode,), TransferService(config(), memory=kv.memory) as svc:
        src, dst = [1, 2, 3, 9], [12, 0, 5, 6]
        kv.fill("r1", src)
        await decode.command(op="expect", rid="r1", pages=dst, sender=svc.address)
        await decode.event("expecting", "r1")
        result = await svc.await_completion(await svc.send("r1", src, last=True), timeout=20)
        assert result.status is TransferStatus.SUCCESS, result
        assert result.bytes == len(src) * kv.memory.page_bytes
        arrived = await decode.event("arrived", "r1")
        assert arrived["status"] == "SUCCESS" and arrived["bytes"] == result.bytes
        assert await verified(decode, dst, "r1")
        assert await untouched(decode, dst)
        assert svc.status()["live_nixl_handles"] == 0


async def test_incompatible_memory_is_refused_naming_the_region() -> None:
    here, there = spec(head_dim=8), spec(head_dim=16)
    kv = SyntheticKV(here)
    async with children(engine_config(there)) as (decode,), TransferService(config(), memory=kv.memory) as svc:
        await decode.command(op="expect", rid="x", pages=[1], sender=svc.address)
        arrived = await decode.event("arrived", "x")
        assert arrived["status"] == "FAILED" and arrived["reason"] == FailureReason.INCOMPATIBLE.value
        # the sender refused the handshake, saying why from the decode's side ("here" is the reader)
        assert "refused us: incompatible KV layout: region 0 (L0.k): head_dim 16 here, 8 there" in arrived["message"]
        assert svc.status()["peers"] == []


# -- tensor parallelism -------------------------------------------------------------------------


@pytest.mark.parametrize(("tp_p", "tp_d", "engine"), [
    (1, 1, "sglang_mha"), (2, 1, "sglang_mha"), (1, 2, "sglang_mha"), (4, 2, "sglang_mha"), (2, 4, "sglang_mha"),
    (4, 2, "vllm_hnd"), (2, 4, "vllm_hnd"),  # head-major pages: one descriptor per page even when sliced
    (2, 1, "mla"), (1, 2, "mla"),
])
async def test_tensor_parallel_ranks_receive_exactly_their_heads(tp_p: int, tp_d: int, engine: str) -> None:
    """Prefill ranks in this process, decode ranks in child processes: each decode rank
    holds exactly its heads of the request's pattern, from every source it needs."""
    tp = TensorParallel(tp_p, tp_d, latent=engine == "mla")
    prefill = [SyntheticKV(spec(engine, tp_size=tp_p, tp_rank=i)) for i in range(tp_p)]
    decodes = [engine_config(spec(engine, tp_size=tp_d, tp_rank=j)) for j in range(tp_d)]
    src, dst = [0, 1, 7], [9, 10, 2]
    async with children(*decodes) as ranks, contextlib.AsyncExitStack() as stack:
        services = [await stack.enter_async_context(TransferService(config(), memory=kv.memory)) for kv in prefill]
        senders = [svc.address for svc in services]
        for kv in prefill:
            kv.fill("r", src)
        for j, rank in enumerate(ranks):
            for i in tp.sources(j):
                rid = tp.request_id("r", i, j)
                await rank.command(op="expect", rid=rid, pages=dst, sender=senders[i])
                await rank.event("expecting", rid)
        handles = [h for i, svc in enumerate(services) for h in await tp.send(svc, i, "r", src, last=True)]
        assert len(handles) == sum(len(tp.sources(j)) for j in range(tp_d))
        for i, svc in enumerate(services):
            for h in [h for h in handles if h.request_id.startswith(f"r@tp{i}.")]:
                assert (await svc.await_completion(h, timeout=20)).ok
        for j, rank in enumerate(ranks):
            for i in tp.sources(j):
                assert (await rank.event("arrived", tp.request_id("r", i, j)))["status"] == "SUCCESS"
            assert await verified(rank, dst, f"r-rank{j}", pattern="r"), f"decode rank {j}"
            assert await untouched(rank, dst)


async def test_a_failing_source_fails_the_decode_ranks_request_with_its_reason() -> None:
    """Decode (tp 1) here, two prefill ranks as processes; rank 1 is SIGKILLed before it
    sends: the request fails with rank 1's loss, the other source's sub-request ends too."""
    tp = TensorParallel(2, 1)
    kv = SyntheticKV(spec(tp_size=1))
    async with children(*(engine_config(spec(tp_size=2, tp_rank=i)) for i in range(2))) as ranks, \
            TransferService(config(heartbeat_interval_s=0.1, peer_timeout_s=1.0), memory=kv.memory) as svc:
        receive = await tp.expect(svc, 0, "r", [4, 5], [r.address for r in ranks])
        assert receive.sub_ids == ["r@tp0.0", "r@tp1.0"]
        ranks[1].signal(signal.SIGKILL)
        with anyio.fail_after(20):
            result = await receive.result(timeout=15)
        assert result.status is TransferStatus.FAILED
        assert result.reason in (FailureReason.PEER_LOST, FailureReason.REMOTE_DISCONNECT), result
        assert result.message.startswith("r@tp1.0"), result
        other = await svc.await_arrival("r@tp0.0", timeout=5)
        assert other.reason is FailureReason.ABORTED, other
        # the pages may be reused once every source has settled: rank 1 is gone, rank 0 never
        # posted (it answers the abort with Settled)
        with anyio.fail_after(20):
            settled = await receive.settled(timeout=15)
        assert settled.settled and settled.reason is result.reason, settled
        assert svc.status()["unsettled_pages"] == 0


# -- layer-wise sends and the payload -----------------------------------------------------------


async def test_layer_by_layer_send_completes_after_the_last_layer() -> None:
    s = spec("vllm")
    kv = SyntheticKV(s)
    async with children(engine_config(s)) as (decode,), TransferService(config(), memory=kv.memory) as svc:
        src, dst = [3, 4, 5, 6], [0, 1, 14, 15]
        await decode.command(op="expect", rid="lw", pages=dst, sender=svc.address)
        await decode.event("expecting", "lw")
        # chunked prefill and layer-wise at once: pages 3-4 of every layer, then 5-6 layer by layer
        kv.fill("lw", src)
        await svc.send("lw", src[:2], layers=range(0, 3))
        for layer in range(s.layers):
            handle = await svc.send("lw", src[2:], layers=range(layer, layer + 1), last=layer == s.layers - 1)
            if layer < s.layers - 1:
                await anyio.sleep(0.05)
                assert not any(e["event"] == "arrived" for e in decode.backlog)
        assert (await svc.await_completion(handle, timeout=20)).ok
        arrived = await decode.event("arrived", "lw")
        assert arrived["status"] == "SUCCESS" and arrived["bytes"] == len(src) * kv.memory.page_bytes
        assert await verified(decode, dst, "lw")
        assert await untouched(decode, dst)


async def test_payload_arrives_with_the_success() -> None:
    s = spec()
    kv = SyntheticKV(s)
    async with children(engine_config(s)) as (decode,), TransferService(config(), memory=kv.memory) as svc:
        big = ("first-token=42;" * 1200)[: svc.config.max_payload_bytes]  # the whole allowance
        for rid, payload in (("p1", "token=7"), ("p2", big)):
            kv.fill(rid, [2])
            await decode.command(op="expect", rid=rid, pages=[3], sender=svc.address)
            await decode.event("expecting", rid)
            await svc.send(rid, [2], last=True, payload=payload.encode())
            arrived = await decode.event("arrived", rid)
            assert arrived["status"] == "SUCCESS" and arrived["payload"] == payload
        with pytest.raises(ValueError, match="exceeds max_payload_bytes"):
            await svc.send("p3", [2], last=True, payload=b"x" * (svc.config.max_payload_bytes + 1))
        with pytest.raises(ValueError, match="last chunk"):
            await svc.send("p4", [2], last=False, payload=b"early")
        assert await verified(decode, [3], "p2")


async def test_a_payload_over_the_receivers_limit_is_refused_counted_and_harmless() -> None:
    """A sender allowing more than the receiver does: the receiver refuses the request
    (INCOMPATIBLE, counted), its failure stands once settled, and the next request passes."""
    s = spec()
    kv = SyntheticKV(s)
    async with children(engine_config(s, max_payload_bytes=1024)) as (decode,), \
            TransferService(config(), memory=kv.memory) as svc:
        kv.fill("big", [2])
        await decode.command(op="expect", rid="big", pages=[3], sender=svc.address)
        await decode.event("expecting", "big")
        await svc.send("big", [2], last=True, payload=b"x" * 2048)
        arrived = await decode.event("arrived", "big")
        assert (arrived["status"], arrived["reason"]) == ("FAILED", FailureReason.INCOMPATIBLE.value)
        assert "payload of 2048 bytes exceeds max_payload_bytes (1024)" in arrived["message"]
        await decode.command(op="await_settled", rid="big", timeout=10)
        settled = await decode.event("settled", "big")
        assert settled["settled"] is True and settled["status"] == "FAILED", settled
        await decode.command(op="status")
        assert (await decode.event("status"))["refused"].get("payload_limit") == 1
        kv.fill("ok", [4])
        await decode.command(op="expect", rid="ok", pages=[5], sender=svc.address)
        await decode.event("expecting", "ok")
        await svc.send("ok", [4], last=True, payload=b"y" * 1024)
        arrived = await decode.event("arrived", "ok")
        assert arrived["status"] == "SUCCESS" and arrived["payload"] == "y" * 1024
        assert await verified(decode, [5], "ok")
