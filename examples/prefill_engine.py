"""A small asyncio "prefill engine" that hands its KV cache to a sidecar.

The engine schedules requests (at most ``--running`` at once), allocates pages
in the sidecar's shared KV pool, "computes" each request's KV chunk by chunk
straight into those pages, and hands every chunk to the sidecar with
``send()``.  It never owns a NIXL agent: a transfer failure is a
``TransferResult`` it counts, never an exception that takes it down.

A decode worker (next to the decode sidecar) announces each request with
``expect()`` and verifies every byte that arrives.  If the decode sidecar dies,
its requests fail, the engine keeps going, and the decode side is reconnected
when a sidecar is back.  At the end every request is accounted for.

Against sidecars you started (see docs/sidecar.md)::

    python examples/prefill_engine.py --requests 200

Self-contained, with a decode crash and restart in the middle::

    python examples/prefill_engine.py --spawn --requests 60 --crash-after 20

Switching the engine to in-process is one line: ``TransferService(config)``
instead of ``SidecarClient(socket)`` in ``main()``.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from dataclasses import dataclass

import anyio
import anyio.abc
import anyio.lowlevel
import torch

from kvservice import KVServiceError, SidecarClient, TransferResult
from kvservice.testing import pattern

try:
    from sidecars import Daemon, daemon  # run as a script: examples/ is on sys.path
except ImportError:  # imported as examples.prefill_engine
    from examples.sidecars import Daemon, daemon


class PageAllocator:
    """A free list over a pool's pages; ``alloc`` waits until enough are free."""

    def __init__(self, num_pages: int) -> None:
        self.free = list(range(num_pages))
        self._changed = anyio.Condition()

    async def alloc(self, n: int) -> list[int]:
        async with self._changed:
            while len(self.free) < n:
                await self._changed.wait()
            pages, self.free = self.free[:n], self.free[n:]
            return pages

    async def release(self, pages: list[int]) -> None:
        async with self._changed:
            self.free.extend(pages)
            self._changed.notify_all()


@dataclass
class Request:
    rid: str
    npages: int
    abandoned: bool = False  # the decode side cannot take it: stop waiting for a receiver


class PrefillEngine:
    def __init__(self, svc: SidecarClient, *, running: int, chunk_pages: int) -> None:
        self.svc = svc
        self.pages = PageAllocator(svc.layout.num_pages)
        self.slots = anyio.CapacityLimiter(running)
        self.chunk_pages = chunk_pages

    async def prefill(self, req: Request) -> TransferResult:
        """Compute ``req``'s KV into the shared pool, hand it to the sidecar, wait for the result."""
        async with self.slots:
            pages = await self.pages.alloc(req.npages)
            try:
                kv = pattern(self.svc.layout, req.rid, req.npages)  # stands in for the forward pass
                handle = None
                for start in range(0, req.npages, self.chunk_pages):
                    chunk = pages[start:start + self.chunk_pages]
                    self.svc.kv.write(chunk, kv[:, :, start:start + len(chunk)])
                    handle = await self.svc.send(req.rid, chunk, last=start + len(chunk) == req.npages)
                    await anyio.lowlevel.checkpoint()  # the next layer group would be computed here
                assert handle is not None
                if req.abandoned:  # no receiver will come: don't sit out the bootstrap timeout
                    await self.svc.abort(req.rid)
                return await self.svc.await_completion(handle, timeout=30)
            finally:
                await self.pages.release(pages)  # the sidecar is done with them: sent, or failed


class DecodeWorker:
    """Announces requests to the decode sidecar and verifies what lands.

    ``run`` keeps a connection up: when the sidecar goes away it reconnects
    (every 0.2 s) until it is back, for as long as the example runs.
    """

    def __init__(self, socket: str) -> None:
        self.socket = socket
        self.client: SidecarClient | None = None
        self.pages: PageAllocator | None = None
        self.verified = 0
        self.lost: collections.Counter[str] = collections.Counter()
        self.connected = anyio.Event()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        started = False
        while True:
            try:
                async with SidecarClient(self.socket, name="decode-worker", drain_grace_s=0) as client:
                    self.client, self.pages = client, PageAllocator(client.layout.num_pages)
                    self.connected.set()
                    if not started:
                        started = True
                        task_status.started()
                    await client.wait_disconnected()
            except KVServiceError as exc:  # not there (yet): requests are abandoned meanwhile
                if not started:
                    started = True
                    print(f"-- decode sidecar not reachable yet: {exc}", flush=True)
                    task_status.started()
            self.client = None
            if self.connected.is_set():
                self.connected = anyio.Event()
            await anyio.sleep(0.2)

    async def expect(self, req: Request, sender: str) -> tuple[SidecarClient, list[int]] | None:
        client, allocator = self.client, self.pages
        if client is None or allocator is None or not client.connected:
            return None
        pages = await allocator.alloc(req.npages)
        try:
            await client.expect(req.rid, pages, sender=sender)
        except KVServiceError:
            await allocator.release(pages)
            return None
        return client, pages

    async def receive(self, client: SidecarClient, req: Request, pages: list[int]) -> bool:
        """True if every byte arrived intact."""
        try:
            result = await client.await_arrival(req.rid, timeout=30)
        except KVServiceError:
            self.lost["DECODE_GONE"] += 1
            return False
        if result.ok and torch.equal(client.kv.pages(pages), pattern(client.layout, req.rid, len(pages))):
            self.verified += 1
        else:
            self.lost["CORRUPT" if result.ok else (result.reason.value if result.reason else "?")] += 1
        if client is self.client and self.pages is not None:
            await self.pages.release(pages)
        return result.ok


async def run(prefill_socket: str, decode: DecodeWorker, args: argparse.Namespace,
              crash: Daemon | None = None) -> int:
    rng = random.Random(args.seed)
    results: dict[str, TransferResult] = {}
    restarted_at: float | None = None
    crash_now = anyio.Event()
    async with anyio.create_task_group() as workers, \
            SidecarClient(prefill_socket, name="prefill-engine") as svc:  # or TransferService(config)
        await workers.start(decode.run)
        engine = PrefillEngine(svc, running=args.running, chunk_pages=args.chunk_pages)

        async def one(i: int) -> None:
            req = Request(f"req-{i}-{rng.randrange(1 << 30)}", rng.randint(1, args.max_pages))
            announced = await decode.expect(req, sender=svc.address)
            req.abandoned = announced is None

            async def watch_decode(client: SidecarClient, pages: list[int]) -> None:
                if not await decode.receive(client, req, pages) and req.rid not in results:
                    req.abandoned = True  # the receiver is gone: end the send now, not at a timeout
                    try:
                        await svc.abort(req.rid)
                    except KVServiceError:
                        pass  # not sent yet: prefill() sees `abandoned` after its last send

            async with anyio.create_task_group() as tg:
                if announced is not None:
                    tg.start_soon(watch_decode, *announced)
                results[req.rid] = await engine.prefill(req)
            if sum(r.ok for r in results.values()) >= args.crash_after:
                crash_now.set()

        async def stream(first: int, count: int) -> None:
            async with anyio.create_task_group() as tg:
                for i in range(first, first + count):
                    tg.start_soon(one, i)
                    await anyio.sleep(args.interval)

        async def crash_and_restart() -> None:
            nonlocal restarted_at
            assert crash is not None and crash.proc is not None
            await crash_now.wait()
            print(f"-- SIGKILL the decode sidecar (pid {crash.proc.pid}) after {len(results)} requests", flush=True)
            crash.kill()
            await crash.proc.wait()
            await crash.start()  # same socket and segment names: the stale ones are cleaned up
            with anyio.fail_after(30):
                while decode.client is None or not decode.client.connected:
                    await decode.connected.wait()
            restarted_at = time.monotonic()
            print("-- decode sidecar restarted; the decode worker has reconnected", flush=True)

        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            if crash is not None:
                tg.start_soon(crash_and_restart)
            await stream(0, args.requests)
        if crash is not None:  # a second wave, after the restart, to show the recovery
            await stream(args.requests, args.after_restart)
        elapsed = time.monotonic() - t0
        status = await svc.fetch_status()
        workers.cancel_scope.cancel()

    submitted = args.requests + (args.after_restart if crash is not None else 0)
    by_outcome = collections.Counter("SUCCESS" if r.ok else f"FAILED {r.reason.value if r.reason else '?'}"
                                     for r in results.values())
    print(f"\n{len(results)} of {submitted} requests ended in {elapsed:.1f}s, as the prefill engine saw them:")
    for outcome, n in sorted(by_outcome.items()):
        print(f"  {outcome:<28} {n:>5}")
    if restarted_at is not None:
        after = [r for r in results.values() if r.created_at > restarted_at]
        print(f"after the restart: {sum(r.ok for r in after)} of {len(after)} succeeded")
    print(f"decode worker: {decode.verified} verified byte for byte; not received: {dict(decode.lost) or 'none'}")
    print(f"prefill sidecar outcomes: {status.outcomes}")
    accounted = len(results) == submitted
    print("every request accounted for" if accounted else "SOME REQUESTS WERE NOT ACCOUNTED FOR")
    return 0 if accounted and decode.lost["CORRUPT"] == 0 else 1


async def main(args: argparse.Namespace) -> int:
    if not args.spawn:
        code = 1
        try:
            code = await run(args.prefill_socket, DecodeWorker(args.decode_socket), args)
        except* KVServiceError as group:  # e.g. no prefill sidecar: say so, no traceback
            print(f"error: {group.exceptions[0]} (start it: kvservice serve --config config/prefill.toml)",
                  file=sys.stderr)
        return code
    prefill, decode = daemon("prefill"), daemon("decode")
    try:
        await prefill.start()
        await decode.start()
        print(f"metrics: prefill http://{prefill.http}/metrics, decode http://{decode.http}/metrics", flush=True)
        return await run(prefill.socket, DecodeWorker(decode.socket), args,
                         crash=decode if args.crash_after >= 0 else None)
    finally:
        with anyio.CancelScope(shield=True):
            await decode.stop()
            await prefill.stop()


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--prefill-socket", default="/tmp/kvservice-prefill.sock")
    p.add_argument("--decode-socket", default="/tmp/kvservice-decode.sock")
    p.add_argument("--spawn", action="store_true", help="start both sidecars here (ephemeral ports)")
    p.add_argument("--crash-after", type=int, default=-1,
                   help="with --spawn: SIGKILL the decode sidecar after this many successes, then restart it")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--after-restart", type=int, default=10,
                   help="with --crash-after: requests sent once the decode sidecar is back")
    p.add_argument("--running", type=int, default=8, help="requests prefilling at once")
    p.add_argument("--max-pages", type=int, default=12)
    p.add_argument("--chunk-pages", type=int, default=4)
    p.add_argument("--interval", type=float, default=0.02, help="seconds between arrivals")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(anyio.run(main, parse(sys.argv[1:])))
