"""What ``/proc`` says a process costs: its CPU time so far and its resident memory.

Linux only.  The readers take a pid and read ``/proc/<pid>/``; the parsers beside them
take the files' text, so that what they pick out of it is testable without a process.

- CPU: ``stat``'s ``utime`` + ``stime`` (the process's user and system time so far, its
  threads' included; clock ticks, 10 ms on most kernels), in seconds; and, finer, the sum of
  ``task/*/schedstat``'s first field (nanoseconds each live thread has run), for spans too
  short for clock ticks.  That file's third field counts the thread's turns on a CPU
  (``threads_cpu_and_runs``): how often something woke it or it was preempted.
- RSS: ``status``'s ``VmRSS``: the pages resident now, each counted whole even when shared
  with other processes (the shared libraries' pages too).
- PSS: ``smaps_rollup``'s ``Pss``: the same pages, each shared one divided by the number of
  processes sharing it, so that the PSS of every process on the machine adds up to what
  they use together.  ``None`` where the kernel has no ``smaps_rollup`` (before 4.14).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

KIB_PER_MIB = 1024


@dataclass(frozen=True, slots=True)
class Usage:
    """One reading of one process."""

    cpu_s: float
    rss_mib: float
    pss_mib: float | None


def stat_ticks(text: str) -> int:
    """``utime + stime`` in clock ticks, from the text of ``/proc/<pid>/stat``.

    The second field (the command name, in parentheses) may hold spaces and
    parentheses itself: fields are counted after its *last* ``)``; ``utime`` and
    ``stime`` are fields 14 and 15 of the line, 12th and 13th after the name."""
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def kib_field(text: str, name: str) -> int | None:
    """The value (kB) of the line ``name:  N kB`` of ``status`` or ``smaps_rollup`` text."""
    prefix = name + ":"
    for line in text.splitlines():
        if line.startswith(prefix):
            return int(line[len(prefix):].split()[0])
    return None


def cpu_s(pid: int) -> float:
    """The CPU time (user + system) ``pid`` has used so far, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        return stat_ticks(f.read()) / os.sysconf("SC_CLK_TCK")


def schedstat_ns(text: str) -> int:
    """Nanoseconds a thread has run, from the text of ``/proc/<pid>/task/<tid>/schedstat``."""
    return int(text.split()[0])


def schedstat_runs(text: str) -> int:
    """How many times a thread was put on a CPU (its third field: one per wake-up or
    preemption), from the text of ``/proc/<pid>/task/<tid>/schedstat``."""
    return int(text.split()[2])


def thread_cpu_s(pid: int, tid: int) -> float:
    """The CPU time thread ``tid`` of ``pid`` has run, in seconds, to the nanosecond (its
    main thread: ``tid == pid``).  ``OSError`` if it is gone."""
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return schedstat_ns(f.read()) / 1e9


def _threads_schedstat(pid: int) -> list[str]:
    """The ``schedstat`` text of each of ``pid``'s live threads (one that ends meanwhile is
    left out).  ``OSError`` if ``pid`` is gone."""
    texts = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                texts.append(f.read())
        except OSError:  # a thread that just ended
            continue
    return texts


def threads_cpu_s(pid: int) -> float:
    """The CPU time ``pid``'s live threads have run, in seconds, to the nanosecond (the
    scheduler's own count; a thread that has ended is no longer in it, so read it around a
    span in which the process starts and ends no threads).  ``OSError`` if ``pid`` is gone."""
    return sum(schedstat_ns(t) for t in _threads_schedstat(pid)) / 1e9


def threads_cpu_and_runs(pid: int) -> tuple[float, int]:
    """``threads_cpu_s`` and, from the same reading, ``schedstat_runs`` summed over the live
    threads: what waking the process cost, in scheduler round trips."""
    texts = _threads_schedstat(pid)
    return sum(schedstat_ns(t) for t in texts) / 1e9, sum(schedstat_runs(t) for t in texts)


def threads_by_name(pid: int, *, main: str | None = None) -> dict[str, tuple[float, int]]:
    """``threads_cpu_and_runs`` per thread name (``task/<tid>/comm``; threads of one name
    summed): which of a process's threads spend what.  ``main``: the name to give the
    process's main thread instead (threads it starts inherit its name, OpenMP's among them).
    ``OSError`` if ``pid`` is gone."""
    out: dict[str, tuple[float, int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = main if main is not None and tid == str(pid) else f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                text = f.read()
        except OSError:  # a thread that just ended
            continue
        cpu, runs = out.get(name, (0.0, 0))
        out[name] = (cpu + schedstat_ns(text) / 1e9, runs + schedstat_runs(text))
    return out


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = kib_field(f.read(), "VmRSS")
    if kib is None:  # a zombie has no VmRSS line
        raise ProcessLookupError(f"process {pid} has no resident memory (it has exited)")
    return kib / KIB_PER_MIB


def pss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            kib = kib_field(f.read(), "Pss")
    except FileNotFoundError:
        if not os.path.exists(f"/proc/{pid}"):
            raise
        return None  # the kernel has no smaps_rollup
    return None if kib is None else kib / KIB_PER_MIB


def usage(pid: int) -> Usage:
    """CPU so far, RSS and PSS of ``pid`` now (``OSError`` if it is gone)."""
    return Usage(cpu_s(pid), rss_mib(pid), pss_mib(pid))
