"""The sending loop's CPU per request, with the kvservice of the working directory: a diagnostic.

    cd <a checkout or build> && <venv>/bin/python -m benchmarks.loop_cpu --case w3/c1 --concurrency 4

For comparing builds of the package that ``benchmarks.cpu --against`` cannot copy (one
compiled with mypyc keeps a shared library beside the package, not in it): this module
imports kvservice as the interpreter finds it (``-m`` puts the working directory first),
and its receiver child (``kvservice.bench.kv_side``) runs in the same directory.  One ``TransferService`` sends a W2 or
W3 case of the full plan ``--rounds`` times over (each round's requests expected by the
receiver first), ``--concurrency`` clients sending one request after another, and the
event loop's thread CPU (``time.thread_time``) and wall time per request are printed, with
where kvservice was imported from, and per request the watchdog's ticks (its round trips to
the NIXL thread) and the loop thread's wake-ups (its voluntary context switches, from
``/proc/thread-self/status``).  Expects are sent before the clock starts, so unlike
``kvservice bench`` the figure leaves reading them out; the sender holds them all, so
``--rounds`` times the case's requests may not pass its ``max_unknown_expects`` (10,000: 39
rounds of W3), which would refuse the rest and leave their sends waiting.

``--parts`` also prints the loop thread's CPU per request inside each of a request's main
calls (``PARTS``; inclusive: an indented part runs inside the one above it), timed with
``time.thread_time_ns`` around each call, which adds about 1 us per call to the total.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, nullcontext
from typing import Any, NamedTuple

import anyio
import anyio.to_thread

import kvservice
from kvservice import TransferService
from kvservice.bench._lines import Child
from kvservice.bench.kv_side import make_config, quiet_logs
from kvservice.bench.workloads import FULL, LLAMA3_8B, all_cases
from kvservice.testing.inspect import inside

#: how long the receiver's Expects get to reach the sender before the clock starts
SETTLE_S = 1.0


#: the sender's and the receiver's configuration: the full plan's pool, as ``kvservice bench``
CFG: dict[str, Any] = {"layout": LLAMA3_8B, "num_pages": FULL.pool_pages, "loop": "uvloop", "gc": "freeze",
                       "service": {}}

Expect = Callable[[list[dict[str, Any]]], Awaitable[None]]

#: what ``--parts`` times, as (depth, module, owner in it or "", function), in the order
#: printed: each is patched where its callers look it up, and the depth is how far it is
#: nested in the ones above it on a request's path.  ``TransferService.send`` is a coroutine
#: that does not suspend on this path (no ``receiver=``), so its time is its own.
PARTS: tuple[tuple[int, str, str, str], ...] = (
    (0, "kvservice._service", "TransferService", "send"),
    (1, "kvservice._transfer.plane", "RequestPlane", "send"),
    (2, "kvservice._transfer.watchdog", "Watchdog", "_submit"),
    (3, "kvservice._transfer.watchdog", "Watchdog", "_plan"),
    (4, "kvservice._transfer.watchdog", "", "chunk_post"),
    (5, "kvservice.memory._pairing", "Indexer", "indices"),
    (5, "kvservice._transfer.posts", "", "encode_notif"),
    (3, "kvservice._nixl.door", "DoorThread", "submit"),
    (0, "kvservice._transfer.watchdog", "Watchdog", "_digest"),
    (1, "kvservice._transfer.plane", "RequestPlane", "finish"),
)


def part_name(owner: str, fn: str) -> str:
    return f"{owner}.{fn}" if owner else fn


@contextmanager
def timed_parts() -> Iterator[dict[str, int]]:
    """Wrap each of ``PARTS`` to add the calling thread's CPU inside it (ns) to the yielded
    counts, by ``part_name``; put the originals back on the way out."""
    spent: dict[str, int] = {}
    undo: list[tuple[Any, str, Any]] = []

    def timed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def timed_coroutine(*args: Any, **kwargs: Any) -> Any:
                start = time.thread_time_ns()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    spent[name] = spent.get(name, 0) + time.thread_time_ns() - start
            return timed_coroutine

        @functools.wraps(fn)
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0) + time.thread_time_ns() - start
        return timed_call

    try:
        for _, module_name, owner_name, fn_name in PARTS:
            module = importlib.import_module(module_name)
            owner = getattr(module, owner_name) if owner_name else module
            original = getattr(owner, fn_name)
            undo.append((owner, fn_name, original))
            setattr(owner, fn_name, timed(original, part_name(owner_name, fn_name)))
        yield spent
    finally:
        for owner, fn_name, original in reversed(undo):
            setattr(owner, fn_name, original)


@asynccontextmanager
async def beside_a_receiver() -> AsyncIterator[tuple[TransferService, Expect]]:
    """A ``TransferService`` in this process and a ``kvservice.bench.kv_side`` receiver child,
    both ready: yields the service and ``expect(requests)``, which has the receiver expect
    them from it.  On the way out (without an error) waits until every one has arrived."""
    quiet_logs()
    recv = Child("kvservice.bench.kv_side", "recv", CFG)
    try:
        async with TransferService(make_config(CFG)) as svc:
            svc.kv.tensor.fill_(1.0)
            await anyio.to_thread.run_sync(recv.wait, "ready", 120.0)

            def call(reqs: list[dict[str, Any]]) -> None:
                recv.call("expect", "expecting", 120.0, requests=reqs, sender=svc.address)

            async def expect(reqs: list[dict[str, Any]]) -> None:
                await anyio.to_thread.run_sync(call, reqs)

            yield svc, expect
            await anyio.to_thread.run_sync(recv.wait, "arrived", 120.0)
    finally:
        recv.close()


def wakeups() -> int:
    """The calling thread's voluntary context switches so far: each is a sleep it was woken from."""
    with open("/proc/thread-self/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split(":")[1])
    raise RuntimeError("no voluntary_ctxt_switches in /proc/thread-self/status")


class Run(NamedTuple):
    """One measured run: requests sent, the loop thread's CPU and the wall time (seconds),
    the watchdog's ticks and the loop thread's wake-ups."""
    requests: int
    cpu: float
    wall: float
    ticks: int
    wakeups: int
    #: with ``parts``: the loop thread's CPU inside each of ``PARTS`` (ns), by ``part_name``
    parts: dict[str, int]


async def run(case_key: str, rounds: int, concurrency: int, parts: bool = False) -> Run:
    """One measured run of ``case_key`` (``parts``: with ``PARTS`` timed)."""
    case = {c.key: c for c in all_cases(FULL, 1)}[case_key]
    async with beside_a_receiver() as (svc, expect):
        todo: list[dict[str, Any]] = []
        for i in range(rounds):
            reqs = case.with_prefix(f"loop{i}")
            await expect(reqs)
            todo += reqs
        await anyio.sleep(SETTLE_S)
        pending = iter(todo)

        async def client() -> None:
            for r in pending:
                await svc.await_completion(await svc.send(r["rid"], r["src"], last=True))

        watchdog = inside(svc).plane.watchdog
        with timed_parts() if parts else nullcontext({}) as spent:
            ticks0, wakes0 = watchdog.ticks, wakeups()
            cpu0, wall0 = time.thread_time(), time.monotonic()
            async with anyio.create_task_group() as tg:
                for _ in range(concurrency):
                    tg.start_soon(client)
            cpu, wall = time.thread_time() - cpu0, time.monotonic() - wall0
            ticks, wakes = watchdog.ticks - ticks0, wakeups() - wakes0
    return Run(len(todo), cpu, wall, ticks, wakes, dict(spent))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loop_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="w3/c1", help="a W2 or W3 case of the full plan (its requests)")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--rounds", type=int, default=20, help="times over the case's requests")
    p.add_argument("--parts", action="store_true", help="also the loop's CPU inside each of a request's main calls")
    args = p.parse_args(argv)
    cases = {c.key: c for c in all_cases(FULL, 1)}
    if args.case not in cases:
        p.error(f"--case: one of {', '.join(k for k in cases if k.startswith(('w2/', 'w3/')))}")
    if args.rounds < 1 or args.concurrency < 1:
        p.error("--rounds and --concurrency must be at least 1")
    held = args.rounds * len(cases[args.case].requests)
    bound = make_config(CFG).max_unknown_expects
    if held > bound:  # the receiver's Expects all reach the sender before the clock starts
        p.error(f"--rounds {args.rounds} has the sender hold {held} Expects up front, past its "
                f"max_unknown_expects ({bound}), which refuses the rest: at most "
                f"{bound // (held // args.rounds)} rounds of {args.case}")
    import torch

    torch.set_num_threads(1)
    r = anyio.run(run, args.case, args.rounds, args.concurrency, args.parts, backend="asyncio",
                  backend_options={"use_uvloop": True})
    n = r.requests
    print(f"{kvservice.__file__}: {args.case} x{args.rounds}, {args.concurrency} in flight, {n} requests: "
          f"loop CPU {r.cpu / n * 1e6:.0f} us per request, wall {r.wall / n * 1e6:.0f} us per request, "
          f"{r.ticks / n:.2f} ticks and {r.wakeups / n:.2f} loop wake-ups per request")
    if args.parts:
        print("loop CPU per request inside (inclusive; indented: inside the one above):")
        for depth, _, owner, fn in PARTS:
            name = part_name(owner, fn)
            print(f"  {'  ' * depth}{name} {r.parts.get(name, 0) / n / 1e3:.1f} us")


if __name__ == "__main__":
    main()
