"""A control for loop-lag numbers: an otherwise idle process whose event loop ticks.

``python -m kvservice.bench.lagprobe`` runs the same ticker as the kvservice sender
(sleep ``TICK_S``, record how late it wakes) on the same kind of loop, and on
``{"op": "window", "start": t0, "end": t1}`` answers the lag quantiles of its
samples in that window.  Lag it sees comes from the machine (the scheduler,
other processes), not from kvservice: it is the floor under the sender's lag.
"""

from __future__ import annotations

import collections
import json
import sys
import time
from typing import Any

import anyio

from kvservice.bench._lines import emit, take_stdout
from kvservice.bench.kv_side import TICK_S
from kvservice.bench.stats import quantile

MAX_SAMPLES = 600_000  # ten minutes at one tick per millisecond


async def _main(loop: str) -> None:
    samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=MAX_SAMPLES)

    async def tick() -> None:
        while True:
            t0 = time.monotonic()
            await anyio.sleep(TICK_S)
            t1 = time.monotonic()
            samples.append((t1, max(0.0, t1 - t0 - TICK_S)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        emit({"event": "ready", "loop": loop})
        async for line in anyio.wrap_file(sys.stdin):
            cmd: dict[str, Any] = json.loads(line)
            if cmd["op"] == "window":
                lags = [lag for t, lag in samples if cmd["start"] <= t <= cmd["end"]]
                emit({"event": "window", "n": len(lags), "p50_ms": quantile(lags, 0.5) * 1e3,
                      "p99_ms": quantile(lags, 0.99) * 1e3, "max_ms": max(lags, default=0.0) * 1e3})
            elif cmd["op"] == "exit":
                break
        tg.cancel_scope.cancel()


def main() -> None:
    take_stdout()
    loop = sys.argv[1] if len(sys.argv) > 1 else "uvloop"
    anyio.run(_main, loop, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})


if __name__ == "__main__":
    main()
