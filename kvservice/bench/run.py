"""The measuring part of ``kvservice bench``: the interleaved runs of the methods,
the kvservice-only measurements (memory per request, SIGKILL of a receiver), and
the aggregation of samples into the report's numbers and targets.

Every method moves the same requests of the same layout; methods take turns
case by case, in an order that rotates with each repeat, so noise from the
machine falls on all of them alike.  Reported numbers are medians over
repeats; ratios are per-repeat ratios, then their median.  The sender's loop lag
(kvservice, the sidecar) is taken in one more run per case and method, after the
repeats: its probe ticks every millisecond on the loop it measures, a load the
throughput and CPU runs are spared (``kv_side.Ticker``).
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvservice.bench._lines import Child
from kvservice.bench.methods import SETUP_TIMEOUT_S, SIDES, KvService, Method, processes
from kvservice.bench.procfs import thread_cpu_s, threads_cpu_s
from kvservice.bench.stats import combine, median, quantile, ratios, summarize_sample
from kvservice.bench.workloads import LLAMA3_8B, Case, Plan, page_bytes, ring_requests

PARTS = {"w1", "w2", "w3", "memory", "kill"}
KILL_BATCH = 5  # victims started at once for the SIGKILL test
KILL_POOL_PAGES = 32
TARGETS = {
    "w1_ratio": 0.9, "w2_ratio": 0.9, "w3_ratio": 0.9, "sidecar_ratio": 0.85, "lag_p99_ms": 2.0,
    "lag_max_ms": 10.0, "gc_pause_ms": 10.0, "state_per_request_bytes": 4096, "kill_p99_ms": 100.0,
    "kv_over_mooncake": 1.0, "loop_cpu_us": 50.0,
}
UNITS = {"gbps": "GB/s", "req_s": "req/s"}
#: (method, over method, where ``aggregate`` keeps the per-case ratio); the ``/tcp`` methods ran
#: over TCP alike (NIXL with ``UCX_TLS=tcp``, Mooncake's TCP transport)
RATIOS = (
    ("kvservice", "raw_nixl", "kv_over_raw"), ("sidecar", "raw_nixl", "sidecar_over_raw"),
    ("kvservice/tcp", "raw_nixl/tcp", "kv_over_raw_tcp"), ("kvservice/tcp", "mooncake/tcp", "kv_over_mooncake"),
    ("raw_nixl/tcp", "mooncake/tcp", "raw_over_mooncake"),
    ("kvservice/verify", "kvservice", "verify_over_kv"),  # kvservice bench --verify-landing
    ("kvservice/identity", "kvservice", "identity_over_kv"),  # kvservice bench --identity
)


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
                sample = measured_cpu(m, replace(case, lag=False), f"{rep}.{ci}")
                s = summarize_sample(sample, case.pages * pbytes, len(case.requests))
                runs[case.key][m.name].append(s)
                line.append(f"{m.name} {s['gbps']:.2f} GB/s")
            log(f"  [{rep + 1}/{plan.repeats}] {case.key:<16} " + ", ".join(line))
    for ci, case in enumerate(cases):  # the loop lag, in a run of its own per case and method
        for m in methods:
            if getattr(m, "records_lag", False):
                sample = m.measure(replace(case, lag=True), f"lag.{ci}")
                s = {k: v for k, v in summarize_sample(sample, 1, 1).items() if k.startswith("lag_")}
                if probe is not None:
                    floor = probe.call("window", "window", start=sample["start"], end=sample["end"])
                    s["probe_lag_p99_ms"], s["probe_lag_max_ms"] = floor["p99_ms"], floor["max_ms"]
                runs[case.key][m.name].append(s)
    return runs


def measured_cpu(m: Method, case: Case, prefix: str) -> dict[str, Any]:
    """``m.measure(case, prefix)``, with the CPU time each side's processes on this host
    spent in it (the scheduler's count): ``sample["cpu_s"]``, side -> seconds of every
    thread, and ``sample["loop_cpu_s"]``, side -> seconds of the processes' main threads,
    where kvservice's event loops run (its Python, the bench client's few lines, no NIXL
    call: those run on the door thread).  The driver's work between the readings (a few
    control lines) is in neither."""
    pids = processes(m)
    before = {role: (threads_cpu_s(pid), thread_cpu_s(pid, pid)) for role, pid in pids.items()}
    sample = m.measure(case, prefix)
    cpu: dict[str, float] = {}
    loop: dict[str, float] = {}
    for role, pid in pids.items():
        side = SIDES[role]
        cpu[side] = cpu.get(side, 0.0) + threads_cpu_s(pid) - before[role][0]
        loop[side] = loop.get(side, 0.0) + thread_cpu_s(pid, pid) - before[role][1]
    sample["cpu_s"], sample["loop_cpu_s"] = cpu, loop
    return sample


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
        victims = [Child("kvservice.bench.kv_side", "recv", cfg, env=kv.env)
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
        for method, base, ratio in RATIOS:
            if method in per and base in per:
                r = ratios(per[method], per[base], key)
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
            continue
        add(f"{key} kv/raw req/s", c["kv_over_raw"]["median"], TARGETS[f"{c['workload']}_ratio"], "higher")
        if "sidecar_over_raw" in c and c["concurrency"] > 1:  # one request at a time: no sidecar goal
            add(f"{key} sidecar/raw req/s", c["sidecar_over_raw"]["median"], TARGETS["sidecar_ratio"], "higher")
    for key, c in cases.items():
        kv = c["methods"].get("kvservice", {})
        if c["workload"] in ("w2", "w3"):
            for side, label in (("send", "sender"), ("recv", "receiver")):
                if f"loop_cpu_{side}_us" in kv:
                    add(f"{key} kvservice loop-thread CPU/request, {label}", kv[f"loop_cpu_{side}_us"],
                        TARGETS["loop_cpu_us"], "lower", " us")
    for key, c in cases.items():
        if "kv_over_mooncake" in c:
            add(f"{key} kv/mooncake {UNITS[c['kv_over_mooncake']['metric']]}, both over TCP",
                c["kv_over_mooncake"]["median"], TARGETS["kv_over_mooncake"], "higher")
    for label, wl in (("256 MiB requests (w1)", "w1"), ("in-flight scaling (w3)", "w3")):
        kvr = [r for c in cases.values() if c["workload"] == wl for r in c["runs"].get("kvservice", [])
               if "lag_p99_ms" in r]
        if kvr:
            floor_p99 = [r["probe_lag_p99_ms"] for r in kvr if "probe_lag_p99_ms" in r]
            floor_max = [r["probe_lag_max_ms"] for r in kvr if "probe_lag_max_ms" in r]
            add(f"sender loop lag p99, {label}", median([r["lag_p99_ms"] for r in kvr]),
                TARGETS["lag_p99_ms"], "lower", " ms",
                f"idle-process floor {median(floor_p99):.2f} ms" if floor_p99 else "")
            add(f"sender loop lag max, {label}", max(r["lag_max_ms"] for r in kvr),
                TARGETS["lag_max_ms"], "lower", " ms",
                f"idle-process floor {max(floor_max):.2f} ms" if floor_max else "")
    top = max((c for c in cases.values() if c["workload"] == "w3"), key=lambda c: c["concurrency"], default=None)
    if top is not None and top["runs"].get("kvservice"):
        pauses = [r["gc_pause_lag_max_ms"] for r in top["runs"]["kvservice"] if "gc_pause_lag_max_ms" in r]
        if pauses:
            add(f"worst cyclic-GC pause in the sender, {top['concurrency']:,} in flight ({top['key']})",
                max(pauses), TARGETS["gc_pause_ms"], "lower", " ms")
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
