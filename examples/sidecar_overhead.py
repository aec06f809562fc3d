"""What the sidecar costs per request: the same transfers sent in-process and
through a prefill sidecar, in the same run, to the same decode sidecar.

    python examples/sidecar_overhead.py [--requests 400] [--pages 1]

For each request the receiver's ``expect`` is made first (not timed) and a
barrier request behind it makes sure the sender knows its destination; then
``send(last=True)`` + ``await_completion()`` is timed on the sending side.
The two paths alternate in rounds, so drift in machine load hits both.  The
difference of the medians is the client-to-sidecar overhead per request (one
send frame, its reply and the pushed result over the Unix socket).  Also
printed: the round trip of a ``status`` call, the floor of any sidecar call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import anyio

from kvservice import KVLayout, ServiceConfig, SidecarClient, TransferService
from kvservice._runtime import configure_logging, run

try:
    from sidecars import daemon
except ImportError:
    from examples.sidecars import daemon


async def timed_requests(svc: TransferService | SidecarClient, dw: SidecarClient, tag: str, n: int,
                         pages: int) -> list[tuple[float, float]]:
    """(send() call, send() to completion) in seconds, per request."""
    src = list(range(pages))
    rids = [f"{tag}-{i}" for i in range(n)]
    for i, rid in enumerate(rids):  # destinations: the receiver's pool, round robin
        dst = [(i * pages + k) % dw.layout.num_pages for k in range(pages)]
        await dw.expect(rid, dst, sender=svc.address)
    barrier = f"{tag}-barrier"
    await dw.expect(barrier, [0], sender=svc.address)  # control frames are ordered: once this
    assert (await svc.await_completion(await svc.send(barrier, [0], last=True), timeout=30)).ok
    times = []  # ... has completed, every expect before it has reached the sender
    for rid in rids:
        t0 = time.perf_counter()
        handle = await svc.send(rid, src, last=True)
        t1 = time.perf_counter()
        result = await svc.await_completion(handle)
        times.append((t1 - t0, time.perf_counter() - t0))
        assert result.ok, result
    for rid in [*rids, barrier]:
        assert (await dw.await_arrival(rid, timeout=30)).ok
    return times


def summary(times: list[float]) -> tuple[float, float, float]:
    ordered = sorted(times)
    return statistics.median(ordered), ordered[int(0.9 * (len(ordered) - 1))], ordered[int(0.99 * (len(ordered) - 1))]


async def main(args: argparse.Namespace) -> int:
    configure_logging("warning")
    prefill, decode = daemon("prefill"), daemon("decode")
    try:
        await prefill.start()
        await decode.start()
        async with SidecarClient(prefill.socket) as via_sidecar, SidecarClient(decode.socket) as dw:
            layout = KVLayout(**via_sidecar.welcome.layout) if via_sidecar.welcome else KVLayout()
            config = ServiceConfig(layout=layout, ucx_env={"UCX_NET_DEVICES": "lo"})
            async with TransferService(config) as in_process:
                results: dict[str, list[tuple[float, float]]] = {"in-process": [], "sidecar": []}
                per_round = max(1, args.requests // args.rounds)
                await timed_requests(in_process, dw, "warm-in", 20, args.pages)  # connections, caches
                await timed_requests(via_sidecar, dw, "warm-sc", 20, args.pages)
                for r in range(args.rounds):
                    results["in-process"] += await timed_requests(in_process, dw, f"in{r}", per_round, args.pages)
                    results["sidecar"] += await timed_requests(via_sidecar, dw, f"sc{r}", per_round, args.pages)
                rtts = []
                for _ in range(200):
                    t0 = time.perf_counter()
                    await via_sidecar.fetch_status()
                    rtts.append(time.perf_counter() - t0)
    finally:
        with anyio.CancelScope(shield=True):
            await decode.stop()
            await prefill.stop()

    nbytes = args.pages * layout.page_bytes
    print(f"{len(results['sidecar'])} requests per path, {args.pages} page(s) = {nbytes} bytes each; "
          "microseconds on the sending side:")
    print(f"{'path':<12} {'send() median':>14} {'p90':>7} {'send..completion median':>24} {'p90':>7} {'p99':>7}")
    medians = {}
    for path, pairs in results.items():
        call, _, _ = summary([c for c, _ in pairs])
        call90 = summary([c for c, _ in pairs])[1]
        med, p90, p99 = summary([t for _, t in pairs])
        medians[path] = (call, med)
        print(f"{path:<12} {call * 1e6:>14.0f} {call90 * 1e6:>7.0f} {med * 1e6:>24.0f} "
              f"{p90 * 1e6:>7.0f} {p99 * 1e6:>7.0f}")
    extra_call = (medians["sidecar"][0] - medians["in-process"][0]) * 1e6
    extra_total = (medians["sidecar"][1] - medians["in-process"][1]) * 1e6
    print(f"sidecar overhead per request (difference of medians): send() {extra_call:+.0f} us, "
          f"send..completion {extra_total:+.0f} us")
    med, p90, _ = summary(rtts)
    print(f"status() round trip over the Unix socket: median {med * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us")
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="client-to-sidecar overhead per request, vs in-process")
    p.add_argument("--requests", type=int, default=400, help="timed requests per path")
    p.add_argument("--rounds", type=int, default=8, help="alternations between the two paths")
    p.add_argument("--pages", type=int, default=1, help="pages per request")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(run(main, parse(sys.argv[1:])))  # uvloop when installed, like the daemons
