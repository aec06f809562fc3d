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
"""

from __future__ import annotations

import argparse
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
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


async def run(case_key: str, rounds: int, concurrency: int) -> Run:
    """One measured run of ``case_key``."""
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
        ticks0, wakes0 = watchdog.ticks, wakeups()
        cpu0, wall0 = time.thread_time(), time.monotonic()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(client)
        cpu, wall = time.thread_time() - cpu0, time.monotonic() - wall0
        ticks, wakes = watchdog.ticks - ticks0, wakeups() - wakes0
    return Run(len(todo), cpu, wall, ticks, wakes)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loop_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="w3/c1", help="a W2 or W3 case of the full plan (its requests)")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--rounds", type=int, default=20, help="times over the case's requests")
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
    r = anyio.run(run, args.case, args.rounds, args.concurrency, backend="asyncio",
                  backend_options={"use_uvloop": True})
    n = r.requests
    print(f"{kvservice.__file__}: {args.case} x{args.rounds}, {args.concurrency} in flight, {n} requests: "
          f"loop CPU {r.cpu / n * 1e6:.0f} us per request, wall {r.wall / n * 1e6:.0f} us per request, "
          f"{r.ticks / n:.2f} ticks and {r.wakeups / n:.2f} loop wake-ups per request")


if __name__ == "__main__":
    main()
