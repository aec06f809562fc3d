"""Where each request's CPU goes, per process: a diagnostic, not part of ``kvservice bench``.

    .venv/bin/python -m benchmarks.cpu --cases w2/c1,w3/c64 --repeats 3
    .venv/bin/python -m benchmarks.cpu --cases w3/c64 --profile /tmp/prof   # and py-spy's stacks

Runs the benchmark's methods (raw NIXL, kvservice in process, the sidecar) on the
same cases, as ``kvservice bench`` does, and reads every process's CPU time
(``/proc/PID/task/*/schedstat``, every thread) around each measured run:
microseconds of CPU per request on the sending and the receiving side (the
sidecar's side is its worker and its daemon together, each also shown alone), and
how often each process's threads were put on a CPU per request (``wakes``: every
wake-up, and every preemption, is one; ``kvservice.bench.procfs.threads_by_name``).
Wall time per request and the method's own throughput are printed beside them.
``--threads`` also prints each process's threads by name (``loop``: its main thread,
the event loop's; ``kvservice-nixl``: the service's NIXL thread), with ``--against`` too.

``--against PKG`` (repeatable) adds another kvservice package directory as a method
of its own (``kvservice@PKG``, as ``benchmarks.compare`` runs it, and ``sidecar@PKG``,
its daemons and workers, when ``--methods`` has the sidecar); the methods then
take turns run by run (all started at once, the order rotating each repeat), so
the machine's drift falls on all of them alike.

``--lag-probe`` measures each kvservice and sidecar case twice per repeat, without and
with the sender's loop-lag probe of ``kvservice bench`` (a 1 ms ticker on the loop it
measures), taking turns: what that probe costs, which the bench keeps out of its
throughput and CPU runs.

``--profile DIR`` also samples the kvservice and sidecar processes with py-spy
(``pip install py-spy``; 1 kHz, idle threads left out) during one more run of
each case and folds the samples into the parts of a request's path
(``benchmarks/cpu_parts.py``): per part, microseconds per request, and the
raw stacks are kept in DIR for flame graphs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.compare import shadow
from benchmarks.cpu_parts import fold
from kvservice.bench.methods import KvService, Method, RawNixl, Sidecar, processes, running
from kvservice.bench.procfs import threads_by_name
from kvservice.bench.run import measured_cpu, warm_up
from kvservice.bench.stats import summarize_sample
from kvservice.bench.workloads import FULL, LLAMA3_8B, Case, all_cases

PROFILE_RATE_HZ = 1000


@contextmanager
def sampled(pids: dict[str, int], out: Path | None) -> Iterator[dict[str, Path]]:
    """py-spy on each of ``pids`` while the block runs (nothing when ``out`` is None)."""
    spies: list[subprocess.Popen[bytes]] = []
    files: dict[str, Path] = {}
    if out is not None:
        exe = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
        if exe is None:
            raise SystemExit("--profile needs py-spy (pip install py-spy)")
        for role, pid in pids.items():
            files[role] = out / f"{role}.txt"
            spies.append(subprocess.Popen(
                [exe, "record", "--pid", str(pid), "--rate", str(PROFILE_RATE_HZ), "--format", "raw",
                 "--output", str(files[role]), "--nonblocking", "--full-filenames"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)  # py-spy attaches
    try:
        yield files
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for spy in spies:
            try:
                spy.wait(timeout=30)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()


#: the name ``--threads`` gives a process's main thread: the event loop's in every process measured
LOOP = "loop"


def measure(m: Method, case: Case, repeats: int, tag: str = "") -> dict[str, Any]:
    pids = processes(m)
    per: dict[str, list[float]] = {role: [] for role in pids}
    wakes: dict[str, list[float]] = {role: [] for role in pids}
    by_thread: dict[tuple[str, str], list[tuple[float, float]]] = {}
    walls: list[float] = []
    for i in range(repeats):
        before = {role: threads_by_name(pid, main=LOOP) for role, pid in pids.items()}
        sample = m.measure(replace(case, lag=False), f"cpu{tag}-{case.key}-{i}")
        after = {role: threads_by_name(pid, main=LOOP) for role, pid in pids.items()}
        n = len(case.requests)
        for role in pids:
            deltas = {name: (cpu - before[role].get(name, (0.0, 0))[0], runs - before[role].get(name, (0.0, 0))[1])
                      for name, (cpu, runs) in after[role].items()}
            per[role].append(sum(cpu for cpu, _ in deltas.values()) / n * 1e6)
            wakes[role].append(sum(runs for _, runs in deltas.values()) / n)
            for name, (cpu, runs) in deltas.items():
                by_thread.setdefault((role, name), []).append((cpu / n * 1e6, runs / n))
        walls.append((sample["end"] - sample["start"]) / n * 1e6)
    return {"cpu_us": {role: statistics.median(v) for role, v in per.items()},
            "wakes": {role: statistics.median(v) for role, v in wakes.items()},
            "threads": {key: (statistics.median(c for c, _ in v), statistics.median(r for _, r in v))
                        for key, v in by_thread.items()},
            "wall_us": statistics.median(walls)}


def _thread_lines(threads: dict[tuple[str, str], tuple[float, float]]) -> list[str]:
    """Per process, its threads that spent at least 1 us per request: CPU and wake-ups per
    request (threads of one name summed: the main thread is ``loop``, the event loop's)."""
    roles = dict.fromkeys(role for role, _ in threads)
    return [f"    {role:<15} " + "  ".join(f"{name} {cpu:.0f} us ({runs:.2f} wakes)"
                                         for (r, name), (cpu, runs) in sorted(threads.items(), key=lambda kv: -kv[1][0])
                                         if r == role and cpu >= 1.0)
            for role in roles]


def probe_cost(m: Method, name: str, case: Case, repeats: int) -> None:
    """What ``kvservice bench``'s loop-lag probe costs: runs without it and with it, taking
    turns, one line each (``kvservice bench`` measures throughput and CPU without it)."""
    got: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    n = len(case.requests)
    for i in range(repeats):
        for lag in (False, True) if i % 2 == 0 else (True, False):
            sample = measured_cpu(m, replace(case, lag=lag), f"probe{i}{'l' if lag else ''}-{case.key}")
            got[lag].append(summarize_sample(sample, 1, n))
    for lag, runs in got.items():
        def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return float(statistics.median([r[key] for r in runs]))
        print(f"{name + (' + lag probe' if lag else ''):<40} {case.key:<9} {med('req_s'):6.0f} req/s | loop CPU "
              f"us/req: send {med('loop_cpu_send_us'):5.0f}  recv {med('loop_cpu_recv_us'):5.0f} | every thread: "
              f"send {med('cpu_send_us'):5.0f}  recv {med('cpu_recv_us'):5.0f}", flush=True)


def _line(name: str, key: str, wall: float, cpu: dict[str, float], wakes: dict[str, float]) -> str:
    return (f"{name:<40} {key:<9} wall {wall:6.0f} us/req | CPU us/req: "
            + "  ".join(f"{role} {us:6.0f}" for role, us in cpu.items())
            + " | wakes/req: " + "  ".join(f"{role} {w:4.1f}" for role, w in wakes.items()))


def profile(m: Method, case: Case, out: Path) -> dict[str, dict[str, float]]:
    """Per process, µs per request in each part of the path (py-spy samples)."""
    out.mkdir(parents=True, exist_ok=True)
    pids = processes(m)
    with sampled(pids, out) as files:
        m.measure(replace(case, lag=False), f"prof-{case.key}")
    n = len(case.requests)
    return {role: fold(path.read_text(), PROFILE_RATE_HZ, n) for role, path in files.items() if path.exists()}


def interleaved(methods: list[Method], cases: list[Case], repeats: int, threads: bool = False) -> None:
    """Every method started together, one run each in turn, per repeat and case (``threads``:
    each process's threads too, the medians of the runs)."""
    got: dict[tuple[str, str], list[dict[str, Any]]] = {(m.name, c.key): [] for m in methods for c in cases}
    with running(methods):
        warm_up(methods, cases)
        for rep in range(repeats):
            for ci, case in enumerate(cases):
                k = (rep + ci) % len(methods)
                for m in methods[k:] + methods[:k]:
                    got[(m.name, case.key)].append(measure(m, case, 1, tag=str(rep)))
    for case in cases:
        for m in methods:
            runs = got[(m.name, case.key)]
            roles = runs[0]["cpu_us"]
            cpu = {role: statistics.median([r["cpu_us"][role] for r in runs]) for role in roles}
            wakes = {role: statistics.median([r["wakes"][role] for r in runs]) for role in roles}
            print(_line(m.name, case.key, statistics.median([r["wall_us"] for r in runs]), cpu, wakes), flush=True)
            if threads:
                keys = dict.fromkeys(key for r in runs for key in r["threads"])
                per = {key: [r["threads"].get(key, (0.0, 0.0)) for r in runs] for key in keys}
                medians = {key: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v))
                           for key, v in per.items()}
                print("\n".join(_thread_lines(medians)), flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="w2/c1,w3/c64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", default="raw_nixl,kvservice,sidecar")
    p.add_argument("--profile", type=Path, metavar="DIR", help="also sample with py-spy, stacks kept in DIR")
    p.add_argument("--lag-probe", action="store_true",
                   help="each case with and without the senders' loop-lag probe, taking turns: what it costs")
    p.add_argument("--threads", action="store_true",
                   help="also each process's threads: CPU and wake-ups per request, by thread name")
    p.add_argument("--against", type=Path, action="append", default=[],
                   help="another kvservice package directory (repeatable): interleaved with --methods")
    args = p.parse_args(argv)
    cases = {c.key: c for c in all_cases(FULL, 1)}
    chosen = [cases[k] for k in args.cases.split(",")]
    lo: dict[str, str | None] = {"UCX_NET_DEVICES": "lo"}
    makers: dict[str, Callable[[], Method]] = {
        "raw_nixl": lambda: RawNixl(LLAMA3_8B, FULL.pool_pages, env=lo),
        "kvservice": lambda: KvService(LLAMA3_8B, FULL.pool_pages, env=lo),
        "sidecar": lambda: Sidecar(LLAMA3_8B, FULL.pool_pages)}
    if args.against:
        with tempfile.TemporaryDirectory(prefix="kvservice-cpu-") as tmp:
            methods = [makers[name]() for name in args.methods.split(",")]
            for i, pkg in enumerate(args.against):
                where = shadow(pkg, Path(tmp) / str(i))
                if "kvservice" in args.methods.split(","):
                    methods.append(KvService(LLAMA3_8B, FULL.pool_pages, env=lo, name=f"kvservice@{pkg}",
                                             path_first=where))
                if "sidecar" in args.methods.split(","):
                    methods.append(Sidecar(LLAMA3_8B, FULL.pool_pages, name=f"sidecar@{pkg}", path_first=where))
            interleaved(methods, chosen, args.repeats, args.threads)
        return
    for name in args.methods.split(","):
        m: Method = makers[name]()
        with running([m]):
            warm_up([m], chosen)
            for case in chosen:
                if args.lag_probe and name != "raw_nixl":
                    probe_cost(m, name, case, args.repeats)
                    continue
                got = measure(m, case, args.repeats)
                print(_line(name, case.key, got["wall_us"], got["cpu_us"], got["wakes"]), flush=True)
                if args.threads:
                    print("\n".join(_thread_lines(got["threads"])), flush=True)
                if args.profile is not None and name != "raw_nixl":
                    parts = profile(m, case, args.profile / name / case.key.replace("/", "-"))
                    for role, by_part in parts.items():
                        shown = "  ".join(f"{k} {v:.0f}" for k, v in by_part.items() if v >= 0.5)
                        print(f"    {role:<15} {shown}", flush=True)


if __name__ == "__main__":
    main()
