"""The sending loop's CPU per request, with the kvservice of the working directory: a diagnostic.

    cd <a checkout or build> && <venv>/bin/python -m benchmarks.loop_cpu --case w3/c1 --concurrency 4

For comparing builds of the package that ``benchmarks.cpu --against`` cannot copy (one
compiled with mypyc keeps a shared library beside the package, not in it): this module
imports kvservice as the interpreter finds it (``-m`` puts the working directory first),
and its receiver child (``kvservice.bench.kv_side``) runs in the same directory.  One ``TransferService`` sends a W2 or
W3 case of the full plan ``--rounds`` times over (each round's requests expected by the
receiver first), ``--concurrency`` clients sending one request after another, and the
event loop's thread CPU (``time.thread_time``) and wall time per request are printed, with
where kvservice was imported from.  Expects are sent before the clock starts, so unlike
``kvservice bench`` the figure leaves reading them out.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread

import kvservice
from kvservice import TransferService
from kvservice.bench._lines import Child
from kvservice.bench.kv_side import make_config, quiet_logs
from kvservice.bench.workloads import FULL, LLAMA3_8B, all_cases

#: how long the receiver's Expects get to reach the sender before the clock starts
SETTLE_S = 1.0


async def run(case_key: str, rounds: int, concurrency: int) -> tuple[int, float, float]:
    """(requests, loop CPU seconds, wall seconds) of one measured run."""
    quiet_logs()
    cfg: dict[str, Any] = {"layout": LLAMA3_8B, "num_pages": FULL.pool_pages, "loop": "uvloop",
                           "gc": "freeze", "service": {}}
    case = {c.key: c for c in all_cases(FULL, 1)}[case_key]
    recv = Child("kvservice.bench.kv_side", "recv", cfg)
    try:
        async with TransferService(make_config(cfg)) as svc:
            svc.kv.tensor.fill_(1.0)
            await anyio.to_thread.run_sync(recv.wait, "ready", 120.0)
            todo: list[dict[str, Any]] = []

            def expect(reqs: list[dict[str, Any]]) -> None:
                recv.call("expect", "expecting", 120.0, requests=reqs, sender=svc.address)

            for i in range(rounds):
                reqs = case.with_prefix(f"loop{i}")
                await anyio.to_thread.run_sync(expect, reqs)
                todo += reqs
            await anyio.sleep(SETTLE_S)
            pending = iter(todo)

            async def client() -> None:
                for r in pending:
                    await svc.await_completion(await svc.send(r["rid"], r["src"], last=True))

            cpu0, wall0 = time.thread_time(), time.monotonic()
            async with anyio.create_task_group() as tg:
                for _ in range(concurrency):
                    tg.start_soon(client)
            cpu, wall = time.thread_time() - cpu0, time.monotonic() - wall0
            await anyio.to_thread.run_sync(recv.wait, "arrived", 120.0)
    finally:
        recv.close()
    return len(todo), cpu, wall


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loop_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="w3/c1", help="a W2 or W3 case of the full plan (its requests)")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--rounds", type=int, default=20, help="times over the case's requests")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    n, cpu, wall = anyio.run(run, args.case, args.rounds, args.concurrency, backend="asyncio",
                             backend_options={"use_uvloop": True})
    print(f"{kvservice.__file__}: {args.case} x{args.rounds}, {args.concurrency} in flight, {n} requests: "
          f"loop CPU {cpu / n * 1e6:.0f} us per request, wall {wall / n * 1e6:.0f} us per request")


if __name__ == "__main__":
    main()
