"""``kvservice bench``: kvservice against raw NIXL and the memory-copy limit, in
process and as a sidecar (``kvservice serve`` daemons and their workers).

Every method moves the same requests of the same layout; methods take turns
case by case, in an order that rotates with each repeat, so noise from the
machine falls on all of them alike.  Reported numbers are medians over
repeats; ratios are per-repeat ratios, then their median.

    kvservice bench                      # full run, results into docs/perf/
    kvservice bench --quick --out /tmp/b # CI smoke run: seconds, asserts nothing about speed
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _lines, report
from benchmarks._lines import REPO_ROOT, Child, ChildError
from benchmarks.methods import SETUP_TIMEOUT_S, KvService, Limit, Method, RawNixl, Sidecar
from benchmarks.stats import combine, median, quantile, ratios, summarize_sample
from benchmarks.workloads import FULL, LLAMA3_8B, QUICK, Case, Plan, all_cases, page_bytes, ring_requests
from kvservice.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE

PARTS = {"w1", "w2", "w3", "memory", "kill"}
KILL_BATCH = 5  # victims started at once for the SIGKILL test
KILL_POOL_PAGES = 32
TARGETS = {
    "w1_ratio": 0.9, "w2_ratio": 0.8, "lag_p99_ms": 2.0, "lag_max_ms": 10.0,
    "state_per_request_bytes": 4096, "kill_p99_ms": 100.0,
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    versions = {}
    for pkg in ("nixl", "torch", "numpy", "anyio", "uvloop"):
        try:
            from importlib.metadata import version

            versions[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - informational only
            versions[pkg] = "n/a"
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib,
        "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
        "versions": versions, "load_avg_start": os.getloadavg()[0],
    }


# -- the interleaved runs ---------------------------------------------------------------------------


def run_cases(methods: list[Method], cases: list[Case], plan: Plan,
              probe: Child | None = None) -> dict[str, dict[str, list[dict[str, Any]]]]:
    pbytes = page_bytes(LLAMA3_8B)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c.key: {m.name: [] for m in methods} for c in cases}
    for rep in range(plan.repeats):
        for ci, case in enumerate(cases):
            k = (rep + ci) % len(methods)
            order = methods[k:] + methods[:k]
            line = []
            for m in order:
                sample = m.measure(case, f"{rep}.{ci}")
                s = summarize_sample(sample, case.pages * pbytes, len(case.requests))
                if probe is not None and "lag_p99_ms" in s:
                    floor = probe.call("window", "window", start=sample["start"], end=sample["end"])
                    s["probe_lag_p99_ms"], s["probe_lag_max_ms"] = floor["p99_ms"], floor["max_ms"]
                runs[case.key][m.name].append(s)
                line.append(f"{m.name} {s['gbps']:.2f} GB/s")
            log(f"  [{rep + 1}/{plan.repeats}] {case.key:<16} " + ", ".join(line))
    return runs


def warm_up(methods: list[Method], cases: list[Case]) -> None:
    """First connection and first transfers cost milliseconds: pay them before measuring."""
    short = next((c for c in cases if c.workload != "w1"), cases[0])
    warm = [cases[0], Case(short.workload, "warm", 16, short.requests[:32])]
    for m in methods:
        for i, case in enumerate(warm):
            m.measure(case, f"warm{i}")


# -- kvservice-only measurements -----------------------------------------------------------------


def memory_per_request(kv: KvService, n: int) -> dict[str, Any]:
    """tracemalloc on the sender: Python heap per request with ``n`` one-page requests at once."""
    assert kv.send is not None and kv.recv is not None
    pool = int(kv.cfg["num_pages"])
    reqs = [{"rid": f"mem-{i}", "src": [i % pool], "dst": [i % pool]} for i in range(n)]
    kv.recv.call("expect", "expecting", 120, requests=reqs, sender=kv.address)
    got = kv.send.call("memory", "memory", 180, requests=reqs)
    kv.recv.wait("arrived", 180)
    return got


def kill_test(kv: KvService, plan: Plan) -> dict[str, Any]:
    """SIGKILL the receiver with requests in flight; time until every one of them is Failed.

    Latency per try: the last in-flight request's ``finished_at`` minus the
    moment just before ``kill()``, both on the machine's monotonic clock.
    """
    assert kv.send is not None
    tries: list[dict[str, Any]] = []
    cfg = {**kv.cfg, "num_pages": KILL_POOL_PAGES}
    while len(tries) < plan.kill_tries:
        victims = [Child("benchmarks.kv_side", "recv", cfg)
                   for _ in range(min(KILL_BATCH, plan.kill_tries - len(tries)))]
        try:
            for v in victims:
                v.wait("ready", SETUP_TIMEOUT_S)
            for v in victims:
                t = len(tries)
                case = Case("kill", str(t), plan.kill_requests, ring_requests(
                    "k", [plan.kill_pages] * plan.kill_requests, plan.pool_pages, KILL_POOL_PAGES))
                reqs = case.with_prefix(f"kill{t}")
                v.call("expect", "expecting", 60, requests=reqs, sender=kv.address, wait=False)
                kv.send.call("kill_watch", "sent", 60, requests=reqs)
                t_kill = time.monotonic()
                v.kill()
                ended = kv.send.wait("ended", 60)["results"]
                # in flight: not already complete when the kill was sent
                inflight = [r for r in ended if r["status"] != "SUCCESS" or r["finished"] > t_kill]
                failed = [r for r in inflight if r["status"] == "FAILED"]
                hanging = [r for r in inflight if r["status"] == "PENDING"]
                worst = max((r["finished"] - t_kill for r in failed), default=0.0)
                tries.append({"inflight": len(inflight), "failed": len(failed), "pending": len(hanging),
                              "succeeded_after_kill": len(inflight) - len(failed) - len(hanging),
                              "reasons": sorted({str(r["reason"]) for r in failed}),
                              "worst_ms": worst * 1e3})
                log(f"  kill try {t + 1}: {len(failed)}/{len(inflight)} in flight failed, "
                    f"last after {worst * 1e3:.1f} ms")
        finally:
            for v in victims:
                v.close(timeout=5)
    worst = [t["worst_ms"] for t in tries]
    return {
        "tries": tries, "p99_ms": quantile(worst, 0.99), "max_ms": max(worst, default=0.0),
        "median_ms": median(worst),
        # every request that did not complete ended Failed (none left pending)
        "all_failed": all(t["pending"] == 0 for t in tries),
        "succeeded_after_kill": sum(t["succeeded_after_kill"] for t in tries),
        "inflight_per_try": median([float(t["inflight"]) for t in tries]),
    }


# -- putting it together ----------------------------------------------------------------------------


def aggregate(cases: list[Case], runs: dict[str, dict[str, list[dict[str, Any]]]],
              methods: list[Method]) -> list[dict[str, Any]]:
    pbytes = page_bytes(LLAMA3_8B)
    out = []
    for case in cases:
        per = runs[case.key]
        entry: dict[str, Any] = {
            "key": case.key, "workload": case.workload, "variant": case.variant,
            "concurrency": case.concurrency, "requests": len(case.requests),
            "bytes": case.pages * pbytes, "methods": {m.name: combine(per[m.name]) for m in methods},
            "runs": per,
        }
        key = "gbps" if case.workload == "w1" else "req_s"
        for method, ratio in (("kvservice", "kv_over_raw"), ("sidecar", "sidecar_over_raw")):
            if method in per and "raw_nixl" in per:
                r = ratios(per[method], per["raw_nixl"], key)
                entry[ratio] = {"metric": key, "median": median(r), "per_repeat": r}
        out.append(entry)
    return out


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue, measured value, and whether it was met."""
    rows: list[dict[str, Any]] = []
    cases = {c["key"]: c for c in results["cases"]}

    def add(name: str, measured: float | None, target: float, better: str, unit: str = "", note: str = "") -> None:
        met = None if measured is None else (measured >= target if better == "higher" else measured <= target)
        rows.append({"target": name, "measured": measured, "goal": f"{'>=' if better == 'higher' else '<='} "
                     f"{target:g}{unit}", "met": met, "note": note})

    for key, c in cases.items():
        if "kv_over_raw" not in c:
            continue
        if c["workload"] == "w1":
            add(f"{key} kv/raw GB/s", c["kv_over_raw"]["median"], TARGETS["w1_ratio"], "higher")
        elif c["workload"] == "w2":
            add(f"{key} kv/raw req/s", c["kv_over_raw"]["median"], TARGETS["w2_ratio"], "higher")
    for label, wl in (("256 MiB requests (w1)", "w1"), ("in-flight scaling (w3)", "w3")):
        kvr = [r for c in cases.values() if c["workload"] == wl for r in c["runs"].get("kvservice", [])]
        if kvr:
            floor_p99 = [r["probe_lag_p99_ms"] for r in kvr if "probe_lag_p99_ms" in r]
            floor_max = [r["probe_lag_max_ms"] for r in kvr if "probe_lag_max_ms" in r]
            add(f"sender loop lag p99, {label}", median([r["lag_p99_ms"] for r in kvr]),
                TARGETS["lag_p99_ms"], "lower", " ms",
                f"idle-process floor {median(floor_p99):.2f} ms" if floor_p99 else "")
            add(f"sender loop lag max, {label}", max(r["lag_max_ms"] for r in kvr),
                TARGETS["lag_max_ms"], "lower", " ms",
                f"idle-process floor {max(floor_max):.2f} ms" if floor_max else "")
    mem = results.get("memory")
    if mem:
        add("kvservice state per in-flight request (peak)", mem["peak_per_request"],
            TARGETS["state_per_request_bytes"], "lower", " B")
    kill = results.get("kill")
    if kill:
        add("SIGKILL -> all in-flight Failed, p99 of tries", kill["p99_ms"], TARGETS["kill_p99_ms"], "lower", " ms")
        rows.append({"target": "SIGKILL: every in-flight request Failed", "measured": kill["all_failed"],
                     "goal": "true", "met": kill["all_failed"]})
    return rows


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvservice bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small CI smoke variant (seconds)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "perf",
                   help="directory for bench.json and bench.png (default: docs/perf/ of the checkout)")
    p.add_argument("--repeats", type=int, help="repeats per case (default: 5, quick: 1)")
    p.add_argument("--only", default="w1,w2,w3,memory,kill",
                   help="comma-separated subset of w1,w2,w3,memory,kill")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="event loop of the kvservice processes (the sidecar's daemons and workers too)")
    p.add_argument("--kv-gc", choices=("freeze", "off"), default="freeze",
                   help="cyclic GC in the kvservice processes: frozen start-up heap (default), or also "
                        "no automatic collection (a diagnostic for GC pauses in the loop lag)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-chart", action="store_true", help="skip the PNG")
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            log("kvservice bench: --repeats must be at least 1")
            return EXIT_USAGE
        plan = Plan(**{**plan.__dict__, "repeats": args.repeats})
    only = set(args.only.split(","))
    if not only <= PARTS:
        log(f"kvservice bench: --only takes a comma-separated subset of {','.join(sorted(PARTS))}, "
            f"got {args.only!r}")
        return EXIT_USAGE
    cases = [c for c in all_cases(plan, args.seed) if c.workload in only]
    meta = machine()
    t0 = time.monotonic()
    log(f"kvservice bench ({'quick' if args.quick else 'full'}): {len(cases)} cases x {plan.repeats} repeats "
        f"on {meta['cores']} cores, load {meta['load_avg_start']:.2f}")

    log_file = tempfile.NamedTemporaryFile("w", prefix="kvservice-bench-", suffix=".log", delete=False)
    _lines.child_stderr = log_file  # NIXL and UCX write to stderr; keep the terminal readable
    kv = KvService(LLAMA3_8B, plan.pool_pages, loop=args.loop, gc=args.kv_gc)
    methods: list[Method] = [Limit(LLAMA3_8B, plan.pool_pages), RawNixl(LLAMA3_8B, plan.pool_pages), kv]
    sidecar = Sidecar(LLAMA3_8B, plan.pool_pages, loop=args.loop)
    why_not = sidecar.unavailable()
    skipped = {sidecar.name: why_not} if why_not else {}
    if why_not is None:
        methods.append(sidecar)
    results: dict[str, Any] = {"meta": meta, "plan": plan.__dict__, "layout": LLAMA3_8B,
                               "options": {"loop": args.loop, "kv_gc": args.kv_gc, "seed": args.seed},
                               "methods": [m.name for m in methods] + list(skipped), "skipped": skipped}
    probe: Child | None = None
    try:
        probe = Child("benchmarks.lagprobe", args.loop, {})
        for m in methods:
            m.start()
        probe.wait("ready", SETUP_TIMEOUT_S)
        log(f"  started in {time.monotonic() - t0:.1f} s")
        if cases:
            warm_up(methods, cases)
            runs = run_cases(methods, cases, plan, probe)
            results["cases"] = aggregate(cases, runs, methods)
        else:
            results["cases"] = []
        if "memory" in only:
            n = 4096 if not args.quick else 64
            results["memory"] = memory_per_request(kv, n)
            log(f"  memory: {results['memory']['peak_per_request']:.0f} B per in-flight request (peak, n={n})")
        if "kill" in only:
            results["kill"] = kill_test(kv, plan)
    except ChildError as exc:
        log(f"kvservice bench: {exc} (children's stderr: {log_file.name})")
        return EXIT_FAILED
    finally:
        for m in methods:
            m.close()
        if probe is not None:
            probe.close()
        log_file.close()
    os.unlink(log_file.name)
    results["targets"] = evaluate(results)
    meta["load_avg_end"] = os.getloadavg()[0]
    meta["wall_s"] = round(time.monotonic() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    report.write_json(results, args.out / "bench.json")
    print(report.table(results))
    png = None
    if not args.no_chart:
        png = report.chart(results, args.out / "bench.png")
        log(f"chart: {png}" if png else "chart: skipped (matplotlib is not installed: pip install matplotlib)")
    (args.out / "results.md").write_text(report.markdown(results, png.name if png else None))
    log(f"results: {args.out / 'bench.json'} ({meta['wall_s']} s)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
