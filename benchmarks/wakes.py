"""What one wake-up costs on this machine: a diagnostic, not part of ``kvservice bench``.

    .venv/bin/python -m benchmarks.wakes [--rounds 20000] [--only "thread hop"]

Every request kvservice moves crosses threads and processes a few times: the event loop
hands a tick to its NIXL thread and gets the outcome back, a sidecar's worker and daemon
trade frames over a Unix socket, two services trade frames over their link.  Each crossing
wakes a sleeping thread.  This prints what one such crossing costs here, so the figures of
``benchmarks.cpu`` (CPU and wake-ups per request, per process) can be read against it:

* ``loop turn``: ``await asyncio.sleep(0)`` on a uvloop loop, the floor of any hop;
* ``thread hop``: a no-op call on kvservice's own ``DoorThread`` from a uvloop loop (a
  queue put that wakes the thread, ``call_soon_threadsafe`` back): the loop thread's CPU
  and the wall time per call, as the watchdog pays per tick;
* ``process round trip``: two processes sending one byte back and forth over a Unix
  socket pair, each blocked in ``recv`` meanwhile (each message wakes the other): the
  CPU of one side and the wall time per round trip, two crossings.

CPU is the calling thread's (``time.thread_time``); the sleeping side's wake-up is in its
own thread's figure, about the same again.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence

import uvloop

from kvservice._nixl.door import DoorThread


def _noop() -> None:
    return None


async def _loop_turns(n: int) -> tuple[float, float]:
    t0, w0 = time.thread_time(), time.monotonic()
    for _ in range(n):
        await asyncio.sleep(0)
    return (time.thread_time() - t0) / n, (time.monotonic() - w0) / n


async def _thread_hops(n: int) -> tuple[float, float]:
    door = DoorThread(name="wakes-door")
    try:
        for _ in range(100):  # warm
            await door.call(_noop)
        t0, w0 = time.thread_time(), time.monotonic()
        for _ in range(n):
            await door.call(_noop)
        return (time.thread_time() - t0) / n, (time.monotonic() - w0) / n
    finally:
        door.shutdown()


def _process_round_trips(n: int) -> tuple[float, float]:
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the echoing side: nothing but recv and send until the parent is done
        a.close()
        try:
            for _ in range(n + 100):
                b.recv(1)
                b.send(b"y")
        finally:
            os._exit(0)
    b.close()
    try:
        for _ in range(100):  # warm
            a.send(b"x")
            a.recv(1)
        t0, w0 = time.thread_time(), time.monotonic()
        for _ in range(n):
            a.send(b"x")
            a.recv(1)
        return (time.thread_time() - t0) / n, (time.monotonic() - w0) / n
    finally:
        a.close()
        os.waitpid(pid, 0)


OPERATIONS: dict[str, Callable[[int], tuple[float, float]]] = {
    "loop turn": lambda n: uvloop.run(_loop_turns(n)),
    "thread hop": lambda n: uvloop.run(_thread_hops(n)),
    "process round trip": _process_round_trips,
}


def measure(rounds: int, repeats: int, only: Sequence[str] = ()) -> dict[str, tuple[float, float]]:
    """Name -> (CPU, wall) seconds per operation, medians over ``repeats`` (``only``: these
    operations, by name; all when empty)."""
    names = list(only) or list(OPERATIONS)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            runs[name].append(OPERATIONS[name](rounds))
    return {name: (statistics.median(c for c, _ in got), statistics.median(w for _, w in got))
            for name, got in runs.items()}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wakes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20_000, help="operations per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", action="append", choices=list(OPERATIONS), default=[],
                   help="measure this operation only (repeatable): for a profiler's run")
    args = p.parse_args(argv)
    print(f"medians of {args.repeats} repeats of {args.rounds} operations; load average {os.getloadavg()[0]:.2f}")
    for name, (cpu, wall) in measure(args.rounds, args.repeats, args.only).items():
        print(f"  {name:<20} CPU {cpu * 1e6:6.1f} us   wall {wall * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
