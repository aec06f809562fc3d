"""Many peers at once, real NIXL agents in real processes over 127.0.0.1: one prefill
serving 8 decodes, one decode fed by 4 prefills, several requests per peer in flight
together, every page byte-verified and every page no request named still zero."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import torch

from kvservice import TransferHandle, TransferResult, TransferService
from kvservice.testing import PeerProcess, pattern
from tests.helpers import READY_S, SMALL, config, peer_config, scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

GUARD_S = scaled(30.0)  # a hang guard for each wait, never a timed assertion


@contextlib.asynccontextmanager
async def started_together(n: int, cfg: dict[str, Any]) -> AsyncIterator[list[PeerProcess]]:
    """``n`` child services, started concurrently (each import of torch and NIXL takes
    a second or two, and each starts a vetting child too, which imports NIXL: 2n boots
    at once); each one stopped, or killed, on the way out."""
    async with anyio.create_task_group() as tg:
        started: list[PeerProcess | None] = [None] * n
        try:
            async with anyio.create_task_group() as starting:
                async def one(i: int) -> None:
                    started[i] = await PeerProcess.start(tg, cfg, ready_timeout=READY_S)

                for i in range(n):
                    starting.start_soon(one, i)
            yield [p for p in started if p is not None]
        finally:
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as stopping:  # together: each may drain
                    for p in started:
                        if p is not None:
                            stopping.start_soon(p.stop, 5.0)
            tg.cancel_scope.cancel()


def spread(n: int, width: int, stride: int, offset: int = 0) -> list[list[int]]:
    """``n`` page lists of ``width`` pages, scattered (not one run): request k gets
    ``offset + k, offset + k + stride, ...``."""
    return [[offset + k + j * stride for j in range(width)] for k in range(n)]


async def test_one_prefill_serves_eight_decodes_at_once() -> None:
    decodes, per_peer, width = 8, 3, 2
    # Nine services started at once each boot a metadata-vetting child (~0.3 s of CPU each,
    # _trust.vetting; a first link waits for the acceptor's), and the prefill vets its eight
    # decodes' metadata one after another: on 2 cores the first handshakes can pass the default
    # connect_timeout_s (5 s), which bounds the dial on one side and the handshake on the other
    # (CI runs saw both).  What is tested is the fan-out, not the boot: give the first links
    # room, on both sides.
    async with started_together(decodes, peer_config(connect_timeout_s=30.0)) as peers, \
            TransferService(config(connect_timeout_s=30.0)) as svc:
        assert len(peers) == decodes
        # sources: 24 requests x 2 pages, scattered over the pool
        sources = spread(decodes * per_peer, width, decodes * per_peer)
        plan: list[tuple[PeerProcess, str, list[int], list[int]]] = []
        for d, peer in enumerate(peers):
            dests = spread(per_peer, width, per_peer, offset=SMALL.num_pages - width * per_peer)
            for k in range(per_peer):
                i = d * per_peer + k
                rid = f"d{d}-r{k}"
                svc.kv.write(sources[i], pattern(SMALL, rid, width))
                plan.append((peer, rid, sources[i], dests[k]))
        # half the requests are sent before their receiver's expect, half after
        handles: dict[str, TransferHandle] = {}
        for n, (_, rid, src, _) in enumerate(plan):
            if n % 2 == 0:
                handles[rid] = await svc.send(rid, src, last=True)
        for peer, rid, _, dst in plan:
            await peer.command(op="expect", rid=rid, pages=dst, sender=svc.address)
        for n, (_, rid, src, _) in enumerate(plan):
            if n % 2 == 1:
                handles[rid] = await svc.send(rid, src, last=True)
        results: dict[str, TransferResult] = {}
        async with anyio.create_task_group() as tg:
            async def wait(rid: str, handle: TransferHandle) -> None:
                results[rid] = await svc.await_completion(handle, timeout=GUARD_S)

            for rid, handle in handles.items():
                tg.start_soon(wait, rid, handle)
        assert all(r.ok for r in results.values()), [r for r in results.values() if not r.ok]
        assert len(results) == decodes * per_peer
        for peer, rid, _, _ in plan:
            arrived = await peer.event("arrived", rid, timeout=GUARD_S)
            assert arrived["status"] == "SUCCESS" and arrived["verified"] is True, arrived
        for peer in peers:
            named = {p for p2, _, _, dst in plan if p2 is peer for p in dst}
            await peer.command(op="untouched", pages=[p for p in range(SMALL.num_pages) if p not in named])
            assert (await peer.event("untouched", timeout=GUARD_S))["ok"] is True
        status = svc.status()
        assert status["live_nixl_handles"] == 0 and status["sending"] == 0
        assert len(status["peers"]) == decodes


async def test_one_decode_receives_from_four_prefills_at_once() -> None:
    prefills, per_peer, width = 4, 3, 3
    # as above: the first links wait for the serial vetting on a machine still busy with boots
    async with started_together(prefills, peer_config(connect_timeout_s=30.0)) as peers, \
            TransferService(config(connect_timeout_s=30.0)) as svc:
        assert len(peers) == prefills
        dests = spread(prefills * per_peer, width, prefills * per_peer)  # 36 scattered pages
        plan: list[tuple[PeerProcess, str, list[int], list[int]]] = []
        for p, peer in enumerate(peers):
            for k in range(per_peer):
                rid = f"p{p}-r{k}"
                src = [5 + k * width + j for j in range(width)]  # each prefill's own pool
                plan.append((peer, rid, src, dests[p * per_peer + k]))
                await peer.command(op="fill", rid=rid, pages=src)
        for peer, rid, _, _ in plan:
            await peer.event("filled", rid, timeout=GUARD_S)
        # every expect first, so all twelve are in flight together once the chunks come
        for peer, rid, _, dst in plan:
            await svc.expect(rid, dst, sender=peer.address)
        for peer, rid, src, _ in plan:  # two chunks each
            await peer.command(op="send", rid=rid, pages=src[:1], last=False)
            await peer.command(op="send", rid=rid, pages=src[1:], last=True)
        results: dict[str, TransferResult] = {}
        async with anyio.create_task_group() as tg:
            async def wait(rid: str) -> None:
                results[rid] = await svc.await_arrival(rid, timeout=GUARD_S)

            for _, rid, _, _ in plan:
                tg.start_soon(wait, rid)
        assert all(r.ok for r in results.values()), [r for r in results.values() if not r.ok]
        for _, rid, _, dst in plan:
            assert torch.equal(svc.kv.pages(dst), pattern(SMALL, rid, width)), rid
            assert results[rid].bytes == width * SMALL.page_bytes
        named = {p for _, _, _, dst in plan for p in dst}
        rest = [p for p in range(SMALL.num_pages) if p not in named]
        assert bool((svc.kv.pages(rest) == 0).all())
        for peer, rid, _, _ in plan:
            assert (await peer.event("completed", rid, timeout=GUARD_S))["status"] == "SUCCESS"
        status = svc.status()
        assert status["live_nixl_handles"] == 0 and status["receiving"] == 0
        assert status["unsettled_pages"] == 0
        assert len(status["peers"]) == prefills
