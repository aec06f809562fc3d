"""Leak accounting: what every process of the soak holds, sampled through the run, and
the verdict on whether any of it grows without bound.

Per process row (``prefill``, ``decodeK``; a sidecar decode adds ``decodeK worker``, the
process driving the daemon) and per resource, a series of (seconds into the run, value).
A restarted decode continues its row with the new process: a row is a role, not a pid.

The verdict on one series (``judge``):

- the first ``WARMUP`` of the run (at least ``WARMUP_MIN_S``) is warm-up and not judged:
  imports, first links, pools and caches filling;
- the rest is cut in two halves by time, A and B; with fewer than ``MIN_POINTS`` samples in
  either, the series is ``short`` (not judged);
- a table with a capacity in the code (``_probe.Table.cap``) cannot grow without bound: it
  is ``capped`` while no sample passes its capacity, ``over cap`` (a failure) once one does;
- otherwise the series **grows** (a failure) when all three hold: B's mean exceeds A's by
  more than the noise floor (``FLOORS`` for the resource, or ``REL_FLOOR`` of A's mean if
  larger); B's least-squares slope is positive; and it is at least half of A's slope.  A
  leak is growth that does not slow down; a cache filling up, or a step (one more peer
  linked) in A, slows down or stops in B and passes.  A step within B is not told apart
  from growth by the samples and fails: something grew late in the run.  Else ``flat``.

The slope reported is the least-squares slope over everything after warm-up, per hour.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

#: the share of the run (by time) that is warm-up, and its least length
WARMUP = 0.2
WARMUP_MIN_S = 5.0
#: fewer samples than this in either half after warm-up: too short to judge
MIN_POINTS = 5
#: noise floor per resource: growth from half A to half B below it is never a leak.  Threads:
#: a child's worker threads (anyio's pool, up to 40, each gone after 10 s idle) come and go
#: with the load it is given, and a 40 s run saw one decode's go 18 -> 22 with nothing leaking;
#: a thread per request, or per fault, would add hundreds
FLOORS: dict[str, float] = {"rss_mib": 16.0, "fds": 8.0, "threads": 8.0, "tcp": 8.0}
DEFAULT_FLOOR = 8.0  # a table's entries
REL_FLOOR = 0.05  # of half A's mean, where larger than the floor
#: verdicts that fail the soak
FAILING = ("grows", "over cap")

#: what /proc says of each process (rows for every process)
PROCESS_RESOURCES: dict[str, str] = {
    "rss_mib": "resident memory, MiB (/proc/PID/status VmRSS)",
    "fds": "open file descriptors (/proc/PID/fd)",
    "threads": "threads (/proc/PID/task)",
    "tcp": "established TCP connections: UCX endpoints over TCP and control links",
}


@dataclass
class Series:
    points: list[tuple[float, float]] = field(default_factory=list)
    cap: int | None = None  # the capacity at the last sample (it may move with what is live)
    over: int = 0  # samples above the capacity at their own time
    missing: bool = False  # the probe found no such table at some sample


@dataclass(frozen=True)
class Trend:
    """One series, judged."""

    process: str
    resource: str
    start: float  # first sample after warm-up
    end: float  # last sample
    peak: float
    slope_per_h: float  # least squares, after warm-up
    verdict: str  # "flat", "grows", "capped", "over cap", "short", "gone"
    cap: int | None = None

    @property
    def fails(self) -> bool:
        return self.verdict in FAILING

    def as_json(self) -> dict[str, object]:
        return {"start": self.start, "end": self.end, "peak": self.peak,
                "slope_per_h": round(self.slope_per_h, 3), "verdict": self.verdict, "cap": self.cap}


class Ledger:
    """Every series of the run, by process row and resource."""

    def __init__(self) -> None:
        self.series: dict[str, dict[str, Series]] = collections.defaultdict(dict)
        self.pids: dict[str, set[int]] = collections.defaultdict(set)  # row -> processes it has had
        self.samples = 0

    def add(self, process: str, resource: str, t: float, value: float | None, cap: int | None = None) -> None:
        s = self.series[process].setdefault(resource, Series())
        if value is None:
            s.missing = True
            return
        s.points.append((t, float(value)))
        if cap is not None:
            s.cap = cap
            s.over += value > cap

    def judge(self) -> list[Trend]:
        t_end = max((p[-1][0] for row in self.series.values() for s in row.values() if (p := s.points)), default=0.0)
        return [judge(proc, res, s, t_end) for proc, row in sorted(self.series.items())
                for res, s in sorted(row.items())]


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope, per second; 0 for fewer than two distinct times."""
    t = np.array([p[0] for p in points])
    v = np.array([p[1] for p in points])
    if len(t) < 2 or float(np.ptp(t)) == 0.0:
        return 0.0
    return float(np.polyfit(t, v, 1)[0])


def judge(process: str, resource: str, s: Series, t_end: float) -> Trend:
    """The verdict on one series; ``t_end``: the run's last sample time (the module docstring)."""
    warm = max(WARMUP_MIN_S, WARMUP * t_end)
    after = [p for p in s.points if p[0] >= warm]
    if s.missing and not s.points:
        return Trend(process, resource, 0.0, 0.0, 0.0, 0.0, "gone", s.cap)
    if not after:
        after = s.points[-1:] or [(0.0, 0.0)]
    start, end = after[0][1], after[-1][1]
    peak = max(p[1] for p in s.points) if s.points else 0.0
    slope_h = _slope(after) * 3600
    mid = (warm + t_end) / 2
    a = [p for p in after if p[0] < mid]
    b = [p for p in after if p[0] >= mid]
    if s.missing:
        verdict = "gone"
    elif s.cap is not None:
        verdict = "over cap" if s.over else "capped"
    elif len(a) < MIN_POINTS or len(b) < MIN_POINTS:
        verdict = "short"
    else:
        mean_a = float(np.mean([p[1] for p in a]))
        mean_b = float(np.mean([p[1] for p in b]))
        floor = max(FLOORS.get(resource, DEFAULT_FLOOR), REL_FLOOR * abs(mean_a))
        slope_a, slope_b = _slope(a), _slope(b)
        grows = mean_b - mean_a > floor and slope_b > 0 and slope_b >= 0.5 * slope_a
        verdict = "grows" if grows else "flat"
    return Trend(process, resource, start, end, peak, slope_h, verdict, s.cap)


def leak_table(trends: list[Trend], pids: dict[str, int]) -> str:
    """Resources as rows, processes as columns: ``start -> end (slope/h) verdict``."""
    procs = sorted({t.process for t in trends})
    by = {(t.process, t.resource): t for t in trends}
    resources = list(dict.fromkeys(t.resource for t in sorted(trends, key=_order)))
    head = ["resource"] + [f"{p} ({pids.get(p, 0)} pid{'' if pids.get(p, 0) == 1 else 's'})" for p in procs]
    rows = [head]
    for res in resources:
        row = [res]
        for p in procs:
            t = by.get((p, res))
            row.append("-" if t is None else _cell(t))
        rows.append(row)
    widths = [max(len(r[k]) for r in rows) for k in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _order(t: Trend) -> tuple[int, str]:
    return (0 if t.resource in PROCESS_RESOURCES else 1, t.resource)


def _num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 10 or x == int(x) else f"{x:.1f}"


def _cell(t: Trend) -> str:
    if t.verdict == "gone":
        return "gone"
    flag = {"grows": " GROWS", "over cap": f" OVER CAP {t.cap}", "short": " (short)",
            "capped": f" cap {t.cap}"}.get(t.verdict, "")
    return f"{_num(t.start)}->{_num(t.end)} ({t.slope_per_h:+.1f}/h){flag}"
