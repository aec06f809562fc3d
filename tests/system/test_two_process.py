"""Real NIXL agents in two processes over 127.0.0.1: bytes arrive, page by page."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvservice import KVPoll, TransferService, TransferStatus
from kvservice.testing import pattern
from tests.helpers import SMALL, config, peer_config, peers

pytestmark = pytest.mark.nixl


async def test_prefill_here_decode_there_bytes_verified() -> None:
    async with peers(peer_config()) as (decode,), TransferService(config()) as svc:
        src, dst = [3, 4, 5, 9], [40, 41, 50, 2]
        svc.kv.write(src, pattern(SMALL, "r1", len(src)))
        await decode.command(op="expect", rid="r1", pages=dst, sender=svc.address)
        await decode.event("expecting", "r1")
        handle = await svc.send("r1", src, last=True)
        result = await svc.await_completion(handle, timeout=10)
        assert result.status is TransferStatus.SUCCESS, result
        assert result.bytes == len(src) * SMALL.page_bytes
        arrived = await decode.event("arrived", "r1")
        assert arrived["status"] == "SUCCESS" and arrived["verified"] is True
        assert handle.poll() is KVPoll.Success
        # pages the request did not name stay zero on the receiver
        await decode.command(op="untouched", pages=[p for p in range(SMALL.num_pages) if p not in dst])
        assert (await decode.event("untouched"))["ok"] is True


async def test_decode_here_prefill_there_chunked() -> None:
    async with peers(peer_config()) as (prefill,), TransferService(config()) as svc:
        src = list(range(10, 22))
        dst = list(range(30, 42))
        await prefill.command(op="fill", rid="c1", pages=src)
        await prefill.event("filled")
        # the sender may start before the receiver's expect: it waits in Bootstrapping
        await prefill.command(op="send", rid="c1", pages=src[:4], last=False)
        assert (await prefill.event("sent"))["poll"] == "Bootstrapping"
        await svc.expect("c1", dst, sender=prefill.address)
        await prefill.command(op="send", rid="c1", pages=src[4:8], last=False)
        await prefill.command(op="send", rid="c1", pages=src[8:], last=True)
        result = await svc.await_arrival("c1", timeout=10)
        assert result.ok, result
        assert torch.equal(svc.kv.pages(dst), pattern(SMALL, "c1", len(dst)))
        assert (await prefill.event("completed", "c1"))["status"] == "SUCCESS"
        untouched = [p for p in range(SMALL.num_pages) if p not in dst]
        assert bool((svc.kv.pages(untouched) == 0).all())


async def test_many_requests_concurrently() -> None:
    async with peers(peer_config()) as (decode,), TransferService(config()) as svc:
        n = 24
        for i in range(n):
            svc.kv.write([i], pattern(SMALL, f"m{i}", 1))
            await decode.command(op="expect", rid=f"m{i}", pages=[63 - i], sender=svc.address)
        handles = [await svc.send(f"m{i}", [i], last=True) for i in range(n)]
        async with anyio.create_task_group() as tg:
            results = {}

            async def wait(h):  # type: ignore[no-untyped-def]
                results[h.request_id] = await svc.await_completion(h, timeout=10)

            for h in handles:
                tg.start_soon(wait, h)
        assert all(r.ok for r in results.values()), results
        for _ in range(n):
            ev = await decode.event("arrived")
            assert ev["verified"] is True, ev
        assert svc.status()["live_nixl_handles"] == 0
