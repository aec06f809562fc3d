"""Who ran on a core while each send of a vLLM bench run was being copied.

For issue #24's question: is a WRITE in the vLLM benchmark slow because the prefill's core
is shared (vLLM's engine, kvservice's loop and its NIXL thread are pinned to one core), or
is the copy itself slow? Record the core's context switches during a run, with the
monotonic clock the marks use, then give this module the recording and the prefill's marks:

    perf record -k CLOCK_MONOTONIC -e sched:sched_switch -C 0 -o /tmp/core0.perf &
    PYTHONPATH=$PWD "$(bash scripts/engine-env.sh vllm)/bin/python" -m benchmarks.vllm_pd \\
        --phases "2048 tok" --configs kvservice --out /tmp/vpd
    kill -INT <perf's pid>
    perf script -i /tmp/core0.perf -F time,trace > /tmp/core0.txt
    python -m benchmarks.core_windows /tmp/core0.txt /tmp/vpd/marks/kvservice-r0-prefill.txt

For every send (``send`` marks: first WRITE posted to its end seen) it prints the window and
how long each thread (by its OS name: kvservice's threads name themselves) ran on the core
within it, then the sums over all windows. Idle time is the core's ``swapper``.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from collections.abc import Iterable
from pathlib import Path

#: ``perf script -F time,trace`` of a ``sched:sched_switch`` event
SWITCH = re.compile(r"^\s*(?P<t>\d+\.\d+):\s+prev_comm=(?P<prev>.+?) prev_pid=(?P<prev_pid>\d+) .*? ==> "
                    r"next_comm=(?P<next>.+?) next_pid=(?P<next_pid>\d+) ")

#: (start, end, "comm[tid]") of each stretch a thread ran on the core
Run = tuple[float, float, str]


def runs(lines: Iterable[str]) -> list[Run]:
    """The stretches between one switch and the next, each given to the thread switched in."""
    out: list[Run] = []
    current: tuple[float, str] | None = None
    for line in lines:
        m = SWITCH.match(line)
        if m is None:
            continue
        t = float(m["t"])
        if current is not None:
            out.append((current[0], t, current[1]))
        current = (t, f"{m['next']}[{m['next_pid']}]")
    return out


def windows(marks: Iterable[str]) -> list[tuple[str, float, float]]:
    """(send id, first WRITE, end) of each ``send`` mark of a prefill's marks."""
    out = []
    for line in marks:
        f = line.split()
        if f and f[0] == "send" and f[4] != "nan":
            out.append((f[1], float(f[4]), float(f[5])))
    return out


def in_window(stretches: list[Run], start: float, end: float) -> dict[str, float]:
    """Seconds each thread ran on the core within ``[start, end]``."""
    got: dict[str, float] = collections.defaultdict(float)
    for a, b, who in stretches:
        overlap = min(b, end) - max(a, start)
        if overlap > 0:
            got[who] += overlap
    return dict(got)


def report(stretches: list[Run], sends: list[tuple[str, float, float]], top: int = 5) -> str:
    if not stretches:
        return "no context switches in the recording (perf script -F time,trace of sched:sched_switch)"
    lo, hi = stretches[0][0], stretches[-1][1]
    lines: list[str] = []
    total: collections.defaultdict[str, float] = collections.defaultdict(float)
    span = 0.0
    for rid, start, end in sends:
        if start < lo or end > hi:
            continue  # outside the recording
        span += end - start
        got = in_window(stretches, start, end)
        for who, s in got.items():
            total[_name(who)] += s
        busiest = sorted(got.items(), key=lambda kv: -kv[1])[:top]
        lines.append(f"{rid}: {1e3 * (end - start):.1f} ms: "
                     + ", ".join(f"{who} {1e3 * s:.1f}" for who, s in busiest))
    if not span:
        return "no send's window lies within the recording"
    lines.append(f"\nall {len(lines)} windows, {1e3 * span:.1f} ms: share of the core by thread name")
    for who, s in sorted(total.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {who:<24} {1e3 * s:9.1f} ms  {100 * s / span:5.1f} %")
    return "\n".join(lines)


def _name(who: str) -> str:
    return who.rsplit("[", 1)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.core_windows", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("switches", type=Path, help="perf script -F time,trace of sched:sched_switch on one core")
    ap.add_argument("marks", type=Path, help="the prefill's marks (benchmarks.vllm_pd's marks/*-prefill.txt)")
    args = ap.parse_args(argv)
    with args.switches.open() as f:
        stretches = runs(f)
    print(report(stretches, windows(args.marks.read_text().splitlines())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
