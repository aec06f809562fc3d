"""Before/after: this checkout's kvservice against other versions of it, interleaved.

    git worktree add ../kv-before <commit>
    .venv/bin/python -m benchmarks.compare --against ../kv-before/kvservice --repeats 5 \\
        --cases w2/c1,w2/c16,w2/c256

Every version runs under this checkout's benchmark code (``kvservice.bench.kv_side``)
with the same workloads, taking turns with raw NIXL case by case, so versions
measured minutes apart on a busy machine are not compared.  Prints, per case,
each method's median throughput, its median per-repeat ratio to raw NIXL, its
latency and its sender's worst cyclic-GC pause; with ``--lag`` its runs carry the
sender's loop-lag probe (a 1 ms ticker, about 40 us of the loop's CPU per tick) and
its lag is printed too.  ``kvservice bench`` measures throughput without that probe.

Compare a worktree with a worktree, not with this checkout's own row: the checkout's
``kvservice`` row reads lower than the very same commit run as an ``--against`` (2026-12-05,
2 cores, load 1.6, ``--repeats 16``: w2/c1 x0.84 vs x0.87, w3/c256 x0.88 vs x0.91; the same
order in every run that day).  Why is not established.  So for before/after, add a worktree of
this commit too and read the two ``--against`` rows:

    git worktree add ../kv-after HEAD
    .venv/bin/python -m benchmarks.compare --against ../kv-after/kvservice \
        --against ../kv-before/kvservice --repeats 16 --cases w2/c1,w3/c256
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvservice._exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from kvservice.bench import _lines
from kvservice.bench._lines import ChildError
from kvservice.bench.methods import KvService, Method, RawNixl, running
from kvservice.bench.stats import median, ratios, summarize_sample
from kvservice.bench.workloads import FULL, LLAMA3_8B, Case, all_cases, page_bytes


def shadow(package: Path, into: Path) -> Path:
    """A directory holding only a link named ``kvservice`` to ``package``."""
    if not (package / "__init__.py").is_file():
        raise ValueError(f"{package} is not a kvservice package directory")
    into.mkdir(parents=True, exist_ok=True)
    (into / "kvservice").symlink_to(package.resolve(), target_is_directory=True)
    return into


def add_against(p: argparse.ArgumentParser) -> None:
    """``--against DIR`` (repeatable): the other versions a before/after benchmark runs."""
    p.add_argument("--against", type=Path, action="append", default=[],
                   help="another kvservice package directory (repeatable)")


def against_versions(packages: Sequence[Path], tmp: Path) -> list[KvService]:
    """One ``KvService`` per ``--against`` package, each run from a shadow directory under
    ``tmp``; ``ValueError`` naming the package that is not one."""
    methods = []
    for i, pkg in enumerate(packages):
        try:
            where = shadow(pkg, tmp / str(i))
        except (OSError, ValueError) as exc:
            raise ValueError(f"--against {pkg}: {exc}") from exc
        methods.append(KvService(LLAMA3_8B, FULL.pool_pages, name=f"kvservice@{pkg}", path_first=where))
    return methods


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_against(p)
    p.add_argument("--cases", default="w1/contiguous,w1/scattered,w2/c1,w2/c16,w2/c256",
                   help="comma-separated case keys of the full plan")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, help="cut w2/w3 cases to this many requests")
    p.add_argument("--lag", action="store_true",
                   help="probe the senders' loop lag during the runs (a load of its own)")
    args = p.parse_args(list(argv))
    cases = {c.key: c for c in all_cases(FULL, 1)}
    try:
        chosen = [cases[k] for k in args.cases.split(",")]
    except KeyError as exc:
        print(f"unknown case {exc}; known: {', '.join(cases)}", file=sys.stderr)
        return EXIT_USAGE
    if args.requests:
        chosen = [c if c.workload == "w1" else Case(c.workload, c.variant, c.concurrency, c.requests[: args.requests])
                  for c in chosen]
    chosen = [replace(c, lag=args.lag) for c in chosen]
    with tempfile.TemporaryDirectory(prefix="kvservice-compare-") as tmp, \
            tempfile.TemporaryFile("w") as log:
        _lines.child_stderr = log
        methods: list[Method] = [RawNixl(LLAMA3_8B, FULL.pool_pages), KvService(LLAMA3_8B, FULL.pool_pages)]
        try:
            methods += against_versions(args.against, Path(tmp))
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return EXIT_USAGE
        try:
            with running(methods):
                for m in methods:
                    m.measure(chosen[0], "warm")
                runs = _interleave(methods, chosen, args.repeats)
        except ChildError as exc:
            print(f"compare: {exc}", file=sys.stderr)
            return EXIT_FAILED
    print(f"load average {os.getloadavg()[0]:.2f}; medians of {args.repeats} repeats; x = median per-repeat "
          "ratio to raw NIXL (GB/s for w1, requests/s otherwise)")
    for case in chosen:
        print(case.key)
        key = "gbps" if case.workload == "w1" else "req_s"
        for m in methods:
            r = runs[case.key][m.name]
            lag = (f"  loop lag p99 {median([x['lag_p99_ms'] for x in r]):.2f} max "
                   f"{max(x['lag_max_ms'] for x in r):.1f} ms") if "lag_p99_ms" in r[0] else ""
            if "gc_pause_lag_max_ms" in r[0]:
                lag += (f"  gc pause max {max(x['gc_pause_lag_max_ms'] for x in r):.1f} ms (CPU "
                        f"{max(x.get('gc_pause_cpu_lag_max_ms', 0.0) for x in r):.1f} ms)")
            print(f"  {m.name:<40} {median([x['gbps'] for x in r]):6.2f} GB/s {median([x['req_s'] for x in r]):7.0f} "
                  f"req/s  x{median(ratios(r, runs[case.key]['raw_nixl'], key)):.2f}  latency p50 "
                  f"{median([x['lat_p50_ms'] for x in r]):.2f} p99 {median([x['lat_p99_ms'] for x in r]):.2f} ms{lag}")
    return EXIT_OK


def _interleave(methods: list[Method], cases: list[Case], repeats: int) -> dict[str, dict[str, list[dict[str, Any]]]]:
    pbytes = page_bytes(LLAMA3_8B)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c.key: {m.name: [] for m in methods} for c in cases}
    for rep in range(repeats):
        for ci, case in enumerate(cases):
            k = (rep + ci) % len(methods)
            for m in methods[k:] + methods[:k]:
                sample = m.measure(case, f"{rep}.{ci}")
                runs[case.key][m.name].append(summarize_sample(sample, case.pages * pbytes, len(case.requests)))
    return runs


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
