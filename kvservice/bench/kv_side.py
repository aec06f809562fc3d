"""kvservice under test: one ``TransferService`` per process, driven through its public API.

``python -m kvservice.bench.kv_side send|recv CONFIG`` answers JSON lines on stdout.
The sender runs ``send(...)`` -> ``await_completion(...)`` per request with
``concurrency`` clients at a time; the receiver ``expect``s every request of a
run up front (as a decode engine does once it has allocated the pages) and
then ``await_arrival``s each.  Both use kvservice's default configuration.

A ticker task on the sender's loop sleeps ``TICK_S`` again and again while a run
that asks for it (``"lag": true``, the default) is under way, and records how late it
wakes: the loop lag reported per run.  It is a load of its own (about 40 us of this
thread's CPU per tick here, 2026-12-06: 24-62 us per request at 16 or more in flight),
so ``kvservice bench`` measures throughput and CPU in runs without it and the
lag in a run of its own.  ``CONFIG["ticker"]`` false leaves the task out altogether,
for a measurement of what the idle process costs.

The same two processes drive any object with this API: ``kvservice.bench.sidecar_side``
runs them with a ``SidecarClient`` in place of the ``TransferService``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import sys
import time
import tracemalloc
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import structlog

from kvservice import KVLayout, KVPoll, ServiceConfig, TransferService
from kvservice._runtime import freeze_startup_objects
from kvservice.bench._lines import emit, take_stdout

#: opens the API under test for a child's CONFIG (an async context manager yielding it)
Opener = Callable[[dict[str, Any]], AbstractAsyncContextManager[Any]]

TICK_S = 0.001
RUN_TIMEOUT_S = 120.0
KILL_WAIT_S = 10.0  # a request not ended this long after the kill is reported PENDING


class Ticker:
    """How late the loop wakes a task sleeping ``TICK_S`` (samples between ``start``
    and ``stop``), and how long the cyclic GC paused the process meanwhile: by the clock,
    and by this thread's CPU time, which the machine's load does not inflate."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.gc_pauses: list[float] = []  # cyclic-GC pauses during the run, seconds
        self.gc_cpu: list[float] = []  # their CPU time, seconds
        self.since = float("inf")
        self._on = asyncio.Event()  # set from start(probe=True) to stop(): it ticks only then
        self._gc_started = self._gc_cpu_started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now, cpu = time.monotonic(), time.thread_time()
        if phase == "start":
            self._gc_started, self._gc_cpu_started = now, cpu
        elif self._gc_started >= self.since:
            self.gc_pauses.append(now - self._gc_started)
            self.gc_cpu.append(cpu - self._gc_cpu_started)

    async def run(self) -> None:
        while True:
            await self._on.wait()
            t0 = time.monotonic()
            await anyio.sleep(TICK_S)
            t1 = time.monotonic()
            if t0 >= self.since:  # a sleep begun before start() is not the run's
                self.lags.append(max(0.0, t1 - t0 - TICK_S))

    def start(self, probe: bool = True) -> None:
        """Record GC pauses from now on, and with ``probe`` tick and record the lag too."""
        self.lags.clear()
        self.gc_pauses.clear()
        self.gc_cpu.clear()
        self.since = time.monotonic()
        if probe:
            self._on.set()

    def stop(self) -> list[float]:
        self.since = float("inf")
        self._on.clear()
        return list(self.lags)


def make_config(cfg: dict[str, Any]) -> ServiceConfig:
    layout = KVLayout(num_pages=int(cfg["num_pages"]), **cfg["layout"])
    extra = dict(cfg.get("service", {}))
    return ServiceConfig(layout=layout, **{"ucx_env": {"UCX_NET_DEVICES": "lo"}, "drain_grace_s": 1.0, **extra})


def open_service(cfg: dict[str, Any]) -> AbstractAsyncContextManager[Any]:
    """The in-process service of this method: a ``TransferService`` of its own."""
    return TransferService(make_config(cfg))


async def drive(svc: Any, ticker: Ticker, requests: list[dict[str, Any]], concurrency: int, *,
                lag: bool = True) -> dict[str, Any]:
    """One measured run on the sender (``svc``: a ``TransferService`` or a
    ``SidecarClient``): ``concurrency`` clients, each sending one
    request after another until none is left.  Clients join one per loop turn, as
    a server's connections would, rather than as one burst of thousands of sends
    in a single turn.  ``lag``: the ticker probes the loop meanwhile (``"lags"``: its
    samples; ``None`` without it)."""
    # The run's requests as tuples of plain values, which the cyclic GC stops tracking at
    # its first collection: as parsed (a dict and two lists each, every request of the
    # run, 12,288 objects at 4,096) every full collection in the sender walked them, which
    # is the driver's load, not the service's.  ``requests`` is this run's own list.
    n = len(requests)
    todo = iter([(r["rid"], tuple(r["src"])) for r in requests])
    requests.clear()
    lat: list[float] = []
    failed: list[str] = []

    async def client() -> None:
        for rid, src in todo:
            t0 = time.monotonic()
            handle = await svc.send(rid, list(src), last=True)
            result = await svc.await_completion(handle)
            if result.ok:
                lat.append(time.monotonic() - t0)
            else:
                failed.append(f"{rid}: {result.reason} {result.message}")

    ticker.start(probe=lag)
    start = time.monotonic()
    with anyio.fail_after(RUN_TIMEOUT_S):
        # asyncio's own tasks: an anyio task holds ~27 objects the cyclic GC walks (its
        # handle, state, cancel scope, events, sets), an asyncio task ~8; at 4,096
        # clients those, not kvservice's, were most of what a collection walked.
        async with asyncio.TaskGroup() as clients:
            for _ in range(min(concurrency, n)):
                clients.create_task(client(), name="bench-client")
                await anyio.lowlevel.checkpoint()
    end = time.monotonic()
    if lag:
        # A run shorter than one tick would have no lag sample: let the ticker's sleep begun
        # during the run end first (after ``end``, so throughput is not affected).
        await anyio.sleep(2 * TICK_S)
    lags = ticker.stop()
    return {"event": "done", "start": start, "end": end, "latencies": lat, "lags": lags if lag else None,
            "gc_max_s": max(ticker.gc_pauses, default=0.0), "gc_cpu_max_s": max(ticker.gc_cpu, default=0.0),
            "ok": len(lat), "failed": failed[:5],
            "nfailed": len(failed)}


async def gc_probe(svc: Any, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """What a full collection costs with every request of ``requests`` in flight, each
    awaited by a client task of its own (``drive``'s shape at ``concurrency = n``):
    the objects the cyclic GC tracks per live request, by type, and the CPU time
    (this thread's, so not the machine's load) of one full collection then.

    Every client sends in one loop turn; the snapshot is taken in the turn after,
    before the watchdog has digested more than a tick or two, so nearly all are live
    (bound and queued for their post, as most of them are at 4,096 in flight)."""
    n = len(requests)
    todo = [(r["rid"], tuple(r["src"])) for r in requests]  # as ``drive`` holds them
    requests.clear()  # first: objects made later must not reuse the ids of these in ``before``
    t0 = time.thread_time()
    gc.collect()
    base_cpu = time.thread_time() - t0
    before = {id(o) for o in gc.get_objects()}
    handles: list[Any] = []
    results: list[Any] = []

    all_sent = asyncio.Event()

    async def client(rid: str, src: tuple[int, ...]) -> None:
        handle = await svc.send(rid, list(src), last=True)
        handles.append(handle)
        if len(handles) == n:
            all_sent.set()
        results.append(await svc.await_completion(handle))

    async with asyncio.TaskGroup() as clients:
        for rid, src in todo:
            clients.create_task(client(rid, src), name="bench-client")
        await all_sent.wait()
        live = sum(h.result is None for h in handles)
        # What survives a young collection, as the requests' objects have by the time a
        # full one runs: tuples of untracked items (a chunk, a deadline entry) leave the
        # GC's lists at their first collection.
        gc.collect(1)
        new = [o for o in gc.get_objects() if id(o) not in before]
        by_type: dict[str, int] = {}
        for o in new:
            name = type(o).__qualname__
            by_type[name] = by_type.get(name, 0) + 1
        tracked = len(new)
        del new
        t0, c0 = time.thread_time(), time.monotonic()
        gc.collect()
        cpu, wall = time.thread_time() - t0, time.monotonic() - c0
    top = dict(sorted(by_type.items(), key=lambda kv: -kv[1])[:12])
    return {"event": "gc_probe", "n": n, "live": live, "tracked": tracked,
            "per_request": tracked / n, "by_type": top, "collect_cpu_s": cpu,
            "collect_wall_s": wall, "base_collect_cpu_s": base_cpu, "ok": sum(r.ok for r in results),
            "failed": sorted({f"{r.reason} {r.message}" for r in results if not r.ok})[:5]}


async def sender(cfg: dict[str, Any], stdin: Any, open_svc: Opener = open_service) -> None:
    ticker = Ticker()
    async with open_svc(cfg) as svc, anyio.create_task_group() as tg:
        svc.kv.tensor.fill_(1.0)  # touch every page once
        if cfg.get("ticker", True):  # off where the process's idle cost is measured (benchmarks/idle.py)
            tg.start_soon(ticker.run)
        freeze_startup_heap(cfg.get("gc", "freeze"))
        emit({"event": "ready", "address": svc.address, "pid": os.getpid()})

        async def memory(requests: list[dict[str, Any]]) -> dict[str, Any]:
            """Python heap held per request: after ``send`` of every request (before any
            is posted) and at the peak while they are in flight; and the objects the
            cyclic GC tracks per queued request (its handle included), which every
            collection of the oldest generation walks."""
            tracemalloc.start()
            tracemalloc.reset_peak()
            tracked = len(gc.get_objects())
            base, _ = tracemalloc.get_traced_memory()
            handles = [await svc.send(r["rid"], r["src"], last=True) for r in requests]
            queued, _ = tracemalloc.get_traced_memory()
            tracked = len(gc.get_objects()) - tracked - 1  # the list of handles
            results = [await svc.await_completion(h) for h in handles]
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            n = len(requests)
            return {"event": "memory", "n": n, "queued_per_request": (queued - base) / n,
                    "gc_objects_per_request": tracked / n,
                    "peak_per_request": (peak - base) / n, "ok": sum(r.ok for r in results)}

        async def kill_watch(requests: list[dict[str, Any]]) -> None:
            """Send ``requests``; report when each ended and how (the receiver gets killed)."""
            handles = [await svc.send(r["rid"], r["src"], last=True) for r in requests]
            for _ in range(10_000):  # up to ~10 s, until every request is bound to the receiver
                if not any(h.poll() is KVPoll.Bootstrapping for h in handles):
                    break
                await anyio.sleep(0.001)
            emit({"event": "sent", "n": len(handles)})
            with anyio.move_on_after(KILL_WAIT_S):
                for h in handles:
                    await h.wait()
            emit({"event": "ended", "results": [
                {"rid": h.request_id, "status": h.result.status.value if h.result else "PENDING",
                 "reason": h.result.reason.value if h.result and h.result.reason else None,
                 "finished": h.result.finished_at if h.result else None} for h in handles]})

        async for line in stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "run":
                emit(await drive(svc, ticker, cmd["requests"], int(cmd["concurrency"]),
                                 lag=bool(cmd.get("lag", True))))
            elif op == "gc_probe":
                emit(await gc_probe(svc, cmd["requests"]))
            elif op == "memory":
                emit(await memory(cmd["requests"]))
            elif op == "kill_watch":
                tg.start_soon(kill_watch, cmd["requests"])
            elif op == "hold":  # sent, never expected: held until the service closes
                for r in cmd["requests"]:
                    await svc.send(r["rid"], r["src"], last=True)
                emit({"event": "holding", "n": len(cmd["requests"])})
            elif op == "exit":
                break
            else:
                emit({"event": "error", "message": f"unknown op {op!r}"})
        tg.cancel_scope.cancel()


async def receiver(cfg: dict[str, Any], stdin: Any, open_svc: Opener = open_service, *,
                   seen_at_return: bool = False) -> None:
    """``seen_at_return``: an arrival counts when ``await_arrival`` returns it here,
    not at its ``finished_at`` (when the service saw it): for a service in another
    process, whose news of an arrival takes a hop to reach this one."""
    async with open_svc(cfg) as svc, anyio.create_task_group() as tg:
        svc.kv.tensor.zero_()  # touch every page once
        freeze_startup_heap(cfg.get("gc", "freeze"))
        emit({"event": "ready", "address": svc.address, "pid": os.getpid()})

        async def arrivals(rids: list[str]) -> None:
            last, failed = 0.0, []
            with anyio.move_on_after(RUN_TIMEOUT_S):
                for rid in rids:
                    result = await svc.await_arrival(rid)
                    last = max(last, time.monotonic() if seen_at_return else result.finished_at)
                    if not result.ok:
                        failed.append(f"{rid}: {result.reason} {result.message}")
            emit({"event": "arrived", "last": last, "nfailed": len(failed), "failed": failed[:5]})

        async for line in stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "expect":
                for r in cmd["requests"]:
                    await svc.expect(r["rid"], r["dst"], sender=cmd["sender"])
                emit({"event": "expecting", "n": len(cmd["requests"])})
                if cmd.get("wait", True):
                    tg.start_soon(arrivals, [r["rid"] for r in cmd["requests"]])
            elif op == "exit":
                break
            else:
                emit({"event": "error", "message": f"unknown op {op!r}"})
        tg.cancel_scope.cancel()


def freeze_startup_heap(mode: str) -> None:
    """What a serving process does once it is up: move everything allocated so far
    (torch, NIXL and the rest of the imports: ~170k objects here) out of the cyclic
    GC's reach.  Without it every full collection walks them all, 100-250 ms on
    this machine, and those pauses, not kvservice, dominate the loop-lag maximum.

    ``mode`` "off" also turns automatic collection off: a diagnostic (``kvservice
    bench --kv-gc off``) that shows which part of the lag is GC pauses."""
    freeze_startup_objects()
    if mode == "off":
        gc.disable()


async def _main(role: str, cfg: dict[str, Any], open_svc: Opener, seen_at_return: bool) -> None:
    stdin = anyio.wrap_file(sys.stdin)
    if role == "send":
        await sender(cfg, stdin, open_svc)
    else:
        await receiver(cfg, stdin, open_svc, seen_at_return=seen_at_return)


def quiet_logs() -> None:
    """stdout carries the replies: structlog goes to stderr, errors only."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def main(open_svc: Opener = open_service, *, seen_at_return: bool = False) -> None:
    """``python -m ... send|recv CONFIG``, with the API ``open_svc`` opens."""
    take_stdout()
    import torch

    quiet_logs()
    torch.set_num_threads(1)
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    loop = cfg.get("loop", "uvloop")
    anyio.run(_main, role, cfg, open_svc, seen_at_return, backend="asyncio",
              backend_options={"use_uvloop": loop == "uvloop"})


if __name__ == "__main__":
    main()
