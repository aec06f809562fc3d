"""What a full cyclic-GC collection costs at thousands of requests in flight, for this
checkout's kvservice and other versions of it, interleaved.

    .venv/bin/python -m benchmarks.gc_probe --against ../kv-before/kvservice --requests 4096 --repeats 5 \\
        --history 10000

Per version (two processes each, ``kvservice.bench.kv_side``'s ``gc_probe``): the
receiver expects every request, the sender sends them all at once, each awaited by a
client task of its own, and in the next loop turn counts the objects the cyclic GC
tracks that were not there before (per request, and the most common types) and
times one full collection by the CPU time of its thread, which the machine's load
does not inflate the way it inflates a wall-clock pause.  Prints medians over the
repeats and the first repeat's objects by type.  ``--history N`` first completes N
requests per version, so that a service's result history (``results_kept``) is as full as
it is by the time ``kvservice bench`` reaches ``w3/c4096``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.compare import add_against, against_versions
from kvservice._exits import EXIT_OK, EXIT_USAGE
from kvservice.bench.methods import RUN_TIMEOUT_S, KvService
from kvservice.bench.stats import median
from kvservice.bench.workloads import FULL, LLAMA3_8B, Case, ring_requests


def probe(m: KvService, n: int, prefix: str) -> dict[str, Any]:
    assert m.send is not None and m.recv is not None
    reqs = Case("w3", f"c{n}", n, ring_requests("g", [1] * n, FULL.pool_pages, FULL.pool_pages)).with_prefix(prefix)
    m.recv.call("expect", "expecting", RUN_TIMEOUT_S, requests=reqs, sender=m.address)
    got = m.send.call("gc_probe", "gc_probe", RUN_TIMEOUT_S, requests=reqs)
    m.recv.wait("arrived", RUN_TIMEOUT_S)
    if got["ok"] != n:
        raise SystemExit(f"{m.name}: {got['ok']} of {n} requests completed: {got['failed']}")
    return got


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gc_probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_against(p)
    p.add_argument("--requests", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--history", type=int, default=0,
                   help="first complete this many requests per version (256 in flight), so that its "
                        "result history is as full as the bench's is when it reaches w3/c4096")
    args = p.parse_args(list(argv))
    with tempfile.TemporaryDirectory(prefix="kvservice-gcprobe-") as tmp:
        methods = [KvService(LLAMA3_8B, FULL.pool_pages)]
        try:
            methods += against_versions(args.against, Path(tmp))
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return EXIT_USAGE
        runs: dict[str, list[dict[str, Any]]] = {m.name: [] for m in methods}
        try:
            for m in methods:
                m.start()
                probe(m, 64, "warm")
                for i in range(0, args.history, 1024):
                    k = min(1024, args.history - i)
                    m.measure(Case("w3", "c256", 256, ring_requests(f"h{i}-", [1] * k, FULL.pool_pages,
                                                                    FULL.pool_pages)), "hist")
            for rep in range(args.repeats):
                k = rep % len(methods)
                for m in methods[k:] + methods[:k]:
                    runs[m.name].append(probe(m, args.requests, f"p{rep}"))
        finally:
            for m in methods:
                m.close()
    print(f"{args.requests} requests in flight ({args.history} completed before), medians of {args.repeats} repeats")
    for name, r in runs.items():
        print(f"  {name:<40} live {median([x['live'] for x in r]):5.0f}  tracked/request "
              f"{median([x['per_request'] for x in r]):5.2f}  full collection CPU "
              f"{median([x['collect_cpu_s'] for x in r]) * 1e3:6.2f} ms (none in flight "
              f"{median([x['base_collect_cpu_s'] for x in r]) * 1e3:5.2f} ms; wall "
              f"{median([x['collect_wall_s'] for x in r]) * 1e3:6.2f} ms)")
        print("      " + ", ".join(f"{t} {c / args.requests:.2f}" for t, c in r[0]["by_type"].items()))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
