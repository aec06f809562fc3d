"""What the vetting child costs each service (each SGLang or vLLM rank): its start time,
CPU and resident memory.

Starts ``MetadataVetter``'s child as a service does, waits until it serves, and reads its
``VmRSS`` and ``utime + stime`` from ``/proc/<pid>/``.  Run it with the interpreter the
ranks use (for SGLang: ``$(bash scripts/engine-env.sh sglang)/bin/python``), kvservice on
``PYTHONPATH``::

    PYTHONPATH=$PWD python -m benchmarks.vetting_cost 5
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import anyio

from kvservice._nixl.trial import nixl_build
from kvservice._trust.vetting import MetadataVetter

UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


async def once() -> tuple[float, float, float]:
    """(seconds to ready, CPU seconds, RSS MiB) of one child."""
    async with anyio.create_task_group() as tg:
        vetter = MetadataVetter(tg, UCX_ENV)
        t0 = time.perf_counter()
        vetter.start()
        await vetter.ready()
        took = time.perf_counter() - t0
        pid = vetter.pid
        if not vetter.serving or pid is None:
            raise SystemExit("the vetting child did not start")
        measured = took, cpu_s(pid), rss_mib(pid)
        tg.cancel_scope.cancel()
    return measured


async def main(runs: int) -> None:
    nixl_build()  # a service has NIXL imported (its door) before its child starts: not counted
    results = [await once() for _ in range(runs)]
    print(f"{'start s':>8} {'cpu s':>6} {'rss MiB':>8}")
    for took, cpu, rss in results:
        print(f"{took:8.2f} {cpu:6.2f} {rss:8.0f}")
    print(f"median: start {statistics.median(r[0] for r in results):.2f} s, "
          f"cpu {statistics.median(r[1] for r in results):.2f} s, "
          f"rss {statistics.median(r[2] for r in results):.0f} MiB; load average {os.getloadavg()[0]:.1f}; "
          f"{sys.executable}")


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 5)
