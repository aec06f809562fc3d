"""How long a peer link takes to set up: dial, handshake, vetting and NIXL load on both
sides, ``expect()`` returning.  Pairs of in-process services on 127.0.0.1, one link each.

    python -m benchmarks.link_setup [--pairs 6] [--cold]

By default each service's vetting child is started before the link is timed, so the
figure is what every link pays; ``--cold`` times each pair's first link with the
children starting (what the first peer of a service waits, once).  Runs on code
without vetting too (then there is nothing to start), for a before/after comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio

from kvservice import KVLayout, ServiceConfig, TransferService

LAYOUT = KVLayout(layers=2, page_tokens=16, kv_heads=2, head_dim=64, dtype="bfloat16", num_pages=64)


async def one_link(cold: bool) -> float:
    cfg = ServiceConfig(layout=LAYOUT, ucx_env={"UCX_NET_DEVICES": "lo"}, drain_grace_s=0.5)
    async with TransferService(cfg) as tx, TransferService(cfg) as rx:
        if not cold:
            for svc in (tx, rx):
                vetter = getattr(svc, "_vetter", None)
                if vetter is not None:
                    await vetter.ready()
        t0 = time.perf_counter()
        await rx.expect("r1", [1, 2], sender=tx.address)
        elapsed = time.perf_counter() - t0
        await rx.abort("r1")
    return elapsed


async def main(pairs: int, cold: bool) -> None:
    times = [await one_link(cold) for _ in range(pairs)]
    ms = ", ".join(f"{t * 1e3:.1f}" for t in times)
    print(f"link set-up ({'cold' if cold else 'warm'}): median {statistics.median(times) * 1e3:.1f} ms "
          f"over {pairs} pairs ({ms})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--cold", action="store_true")
    args = parser.parse_args()
    anyio.run(main, args.pairs, args.cold)
