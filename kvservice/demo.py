"""``kvservice demo``: the service's promise, shown end to end in well under a minute.

This process is the prefill side (an in-process ``TransferService``); the
decode side is a real child process (``kvservice.testing.peer``).  Three phases:

1. **steady**: a few dozen chunked requests; the decode side verifies every
   byte of every page against the request's pattern.
2. **crash**: a stream of requests, and the decode process is SIGKILLed
   mid-stream.  Every request still ends (Success or Failed with a reason),
   the prefill loop keeps ticking, no NIXL handle is left behind.
3. **restart**: decode comes back on the same address as a new NIXL agent;
   requests succeed again.

Exit status 0 when every expectation held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

from ._config import ServiceConfig
from ._results import TransferResult
from ._runtime import configure_logging, freeze_startup_objects, run
from ._service import TransferService
from .memory._layout import KVLayout
from .testing import PeerProcess, pattern

DEMO_LAYOUT = KVLayout(layers=8, page_tokens=16, kv_heads=4, head_dim=128, dtype="bfloat16", num_pages=1024)
UCX_ENV = {"UCX_NET_DEVICES": "lo"}


@dataclass
class Phase:
    name: str
    requests: int = 0
    ok: int = 0
    verified: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    notes: list[str] = field(default_factory=list)

    def add(self, result: TransferResult) -> None:
        self.requests += 1
        if result.ok:
            self.ok += 1
            self.bytes += result.bytes
        else:
            assert result.reason is not None
            self.failures[result.reason.value] += 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _child_config(layout: KVLayout, port: int) -> dict[str, Any]:
    return {
        "layout": {
            "layers": layout.layers, "page_tokens": layout.page_tokens, "kv_heads": layout.kv_heads,
            "head_dim": layout.head_dim, "dtype": layout.dtype, "num_pages": layout.num_pages,
        },
        "port": port, "ucx_env": UCX_ENV, "drain_grace_s": 1.0,
    }


class PagePool:
    """Hands out disjoint pages, so concurrent requests never share one."""

    def __init__(self, num_pages: int, rng: np.random.Generator) -> None:
        self._free = list(range(num_pages))
        self._rng = rng

    def take(self, n: int, contiguous: bool) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"demo page pool exhausted ({len(self._free)} free, {n} wanted)")
        self._free.sort()
        if contiguous:
            for i in range(len(self._free) - n + 1):
                if self._free[i + n - 1] - self._free[i] == n - 1:
                    run = self._free[i : i + n]
                    del self._free[i : i + n]
                    return run
        picked = sorted(self._rng.choice(len(self._free), size=n, replace=False), reverse=True)
        return [self._free.pop(int(i)) for i in picked]

    def give(self, pages: Sequence[int]) -> None:
        self._free.extend(pages)


@dataclass
class Request:
    rid: str
    src: list[int]
    dst: list[int]


class Demo:
    def __init__(self, svc: TransferService, layout: KVLayout, rng: np.random.Generator) -> None:
        self.svc = svc
        self.layout = layout
        self.rng = rng
        self.src_pool = PagePool(layout.num_pages, rng)
        self.dst_pool = PagePool(layout.num_pages, rng)
        self.seq = 0

    async def prepare(self, npages: int) -> Request:
        """Pick pages (contiguous here, scattered there) and write the request's KV here.

        Generating and writing the payload is CPU work: it runs in a worker thread
        so the event loop (and the service's heartbeats) keep going meanwhile."""
        self.seq += 1
        req = Request(f"demo-{self.seq}", self.src_pool.take(npages, True), self.dst_pool.take(npages, False))
        data = await anyio.to_thread.run_sync(pattern, self.layout, req.rid, npages)
        await anyio.to_thread.run_sync(self.svc.kv.write, req.src, data)
        return req

    def release(self, req: Request) -> None:
        self.src_pool.give(req.src)
        self.dst_pool.give(req.dst)

    async def send(self, req: Request, chunks: int, timeout: float) -> TransferResult:
        bounds = np.linspace(0, len(req.src), chunks + 1).astype(int)
        handle = None
        for i in range(chunks):
            handle = await self.svc.send(req.rid, req.src[bounds[i] : bounds[i + 1]],
                                         last=i == chunks - 1, timeout=timeout)
        assert handle is not None
        return await self.svc.await_completion(handle)


async def _steady(demo: Demo, decode: PeerProcess, name: str, n: int, wave: int = 8) -> Phase:
    """``n`` requests in waves of ``wave`` concurrent ones; every byte verified on decode."""
    phase = Phase(name)
    for first in range(0, n, wave):
        reqs = [await demo.prepare(int(demo.rng.integers(8, 33))) for _ in range(min(wave, n - first))]
        for req in reqs:
            await decode.command(op="expect", rid=req.rid, pages=req.dst, sender=demo.svc.address, timeout=10)
        for req in reqs:
            await decode.event("expecting", req.rid)
        results: list[TransferResult] = []

        async def one(req: Request, into: list[TransferResult]) -> None:
            into.append(await demo.send(req, chunks=2, timeout=10))

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for req in reqs:
                tg.start_soon(one, req, results)
        phase.seconds += time.perf_counter() - t0
        for result in results:
            phase.add(result)
        await _collect_arrivals(decode, {r.rid for r in reqs}, phase, timeout=10)
        for req in reqs:
            demo.release(req)
    if phase.ok != n or phase.verified != n:
        phase.notes.append(f"expected {n} verified successes, got {phase.ok} ok / {phase.verified} verified")
    return phase


async def _collect_arrivals(decode: PeerProcess, rids: set[str], phase: Phase, timeout: float) -> None:
    with anyio.move_on_after(timeout):
        while rids:
            ev = await decode.event("arrived", timeout=timeout)
            if ev["rid"] not in rids:
                continue
            rids.discard(ev["rid"])
            if ev["status"] == "SUCCESS" and ev["verified"]:
                phase.verified += 1
            elif ev["status"] == "SUCCESS":
                phase.notes.append(f"{ev['rid']}: bytes differ on the decode side")
    if rids:
        phase.notes.append(f"no arrival reported for {sorted(rids)}")


async def _crash(demo: Demo, decode: PeerProcess, n: int) -> tuple[Phase, float, int]:
    """Decode expects ``n`` requests; we stream them and SIGKILL decode after the third."""
    phase = Phase("crash")
    reqs = [await demo.prepare(32) for _ in range(n)]
    for req in reqs:
        await decode.command(op="expect", rid=req.rid, pages=req.dst, sender=demo.svc.address, timeout=10)
    await anyio.sleep(0.2)  # let the expects reach this side
    results: list[TransferResult] = []
    three_done = anyio.Event()
    ticks = 0
    killed_at = 0.0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.002)
            ticks += 1

    async def one(req: Request, delay: float) -> None:
        await anyio.sleep(delay)
        results.append(await demo.send(req, chunks=4, timeout=5))
        if sum(r.ok for r in results) >= 3:
            three_done.set()

    async def killer() -> None:
        nonlocal killed_at
        with anyio.fail_after(10):
            await three_done.wait()
        decode.signal(signal.SIGKILL)
        killed_at = time.monotonic()

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        async with anyio.create_task_group() as work:
            work.start_soon(killer)
            for i, req in enumerate(reqs):
                work.start_soon(one, req, i * 0.01)
        ticks_during = ticks
        tg.cancel_scope.cancel()
    phase.seconds = time.perf_counter() - t0
    for r in results:
        phase.add(r)
    for req in reqs:
        demo.release(req)
    failed_after_kill = [r.finished_at - killed_at for r in results if not r.ok and r.finished_at >= killed_at]
    # the slowest of the requests that were outstanding at the kill: how long the
    # prefill side took to learn each of them had failed
    detect = max((r.finished_at - max(killed_at, r.created_at) for r in results if not r.ok), default=0.0)
    await decode.proc.wait()
    if phase.requests != n:
        phase.notes.append(f"only {phase.requests} of {n} requests ended")
    if not failed_after_kill:
        phase.notes.append("the kill failed nothing: the crash came too late to show anything")
    allowed = {"PEER_LOST", "REMOTE_DISCONNECT", "BACKEND"}
    if set(phase.failures) - allowed:
        phase.notes.append(f"unexpected failure reasons: {dict(phase.failures)}")
    if ticks_during == 0:
        phase.notes.append("the prefill event loop did not tick during the crash")
    return phase, detect, ticks_during


def _table(phases: Sequence[Phase]) -> str:
    head = f"{'phase':<8} {'requests':>8} {'ok':>4} {'verified':>8} {'MiB':>8} {'GB/s':>6}  failures by reason"
    lines = [head, "-" * len(head)]
    for p in phases:
        gbps = p.bytes / p.seconds / 1e9 if p.seconds else 0.0
        fails = ", ".join(f"{k}={v}" for k, v in sorted(p.failures.items())) or "-"
        lines.append(f"{p.name:<8} {p.requests:>8} {p.ok:>4} {p.verified:>8} "
                     f"{p.bytes / 2**20:>8.1f} {gbps:>6.2f}  {fails}")
    return "\n".join(lines)


async def _main(requests: int, seed: int) -> int:
    layout = DEMO_LAYOUT
    rng = np.random.default_rng(seed)
    port = _free_port()
    config = ServiceConfig(layout=layout, ucx_env=UCX_ENV, drain_grace_s=1.0, bootstrap_timeout_s=5.0)
    print(f"kvservice demo: layout {layout.layers} layers x K/V x {layout.num_pages} pages of "
          f"{layout.page_bytes // 1024} KiB ({layout.pool_bytes / 2**20:.0f} MiB pool per side), pid {os.getpid()}")
    phases: list[Phase] = []
    async with TransferService(config) as svc, anyio.create_task_group() as tg:
        demo = Demo(svc, layout, rng)
        freeze_startup_objects()
        decode = await PeerProcess.start(tg, _child_config(layout, port))
        print(f"prefill (this process) at {svc.address}; decode (pid {decode.pid}) at {decode.address}")
        phases.append(await _steady(demo, decode, "steady", requests))
        crash, detect, ticks = await _crash(demo, decode, n=16)
        phases.append(crash)
        print(f"decode SIGKILLed mid-stream: every affected request resolved Failed within {detect * 1000:.1f} ms "
              f"of the kill (or of its send); prefill loop ticked {ticks} times meanwhile")
        decode = await PeerProcess.start(tg, _child_config(layout, port))
        print(f"decode restarted (pid {decode.pid}) at {decode.address} as a new NIXL agent")
        phases.append(await _steady(demo, decode, "restart", max(8, requests // 4)))
        status = svc.status()
        await decode.stop()
        tg.cancel_scope.cancel()
    print()
    print(_table(phases))
    problems = [f"{p.name}: {note}" for p in phases for note in p.notes]
    if status.live_nixl_handles != 0:
        problems.append(f"{status.live_nixl_handles} NIXL handles still live")
    print(f"\nprefill loop lag: p99 {status.loop_lag_p99_s * 1000:.2f} ms, "
          f"max {status.loop_lag_max_s * 1000:.2f} ms; live NIXL handles at the end: {status.live_nixl_handles}")
    for problem in problems:
        print(f"FAILED EXPECTATION: {problem}")
    print("demo: all expectations held" if not problems else "demo: FAILED")
    return 0 if not problems else 1


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(
        prog="kvservice demo",
        description="The service's promise, shown end to end in well under a minute: this process is the "
                    "prefill side, a child process the decode side.  Three phases: steady (chunked "
                    "requests, every byte verified), crash (the decode process is killed mid-stream; "
                    "every request still ends, no NIXL handle is left), restart (the decode comes "
                    "back; requests succeed again).  Exit status 0 when every expectation held.")
    parser.add_argument("--requests", type=int, default=32, help="requests in the steady phase (default 32)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the requests' sizes and the pages they use, so a run repeats (default 0)")
    parser.add_argument("--log-level", default="error", help="structlog level (default error)")
    args = parser.parse_args(list(argv))
    if args.requests < 1:
        parser.error("--requests must be >= 1")
    configure_logging(args.log_level)
    return run(_main, args.requests, args.seed)
