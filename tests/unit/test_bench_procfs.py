"""What ``kvservice bench`` reads from ``/proc`` (``procfs``) and prints from it: the vetting
child's figures, or why there are none, and the CPU per request of each side's processes."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from kvservice._threads import start_thread
from kvservice.bench import procfs, report

#: a process whose name holds a space and a ')': fields count from the last one
STAT = ("4242 (a b) c) S 1 4242 4242 0 -1 4194560 10 0 0 0 "
        "731 45 0 0 20 0 3 0 100 1000000 2000 18446744073709551615")
STATUS = "Name:\tpython\nVmPeak:\t  70000 kB\nVmHWM:\t   60000 kB\nVmRSS:\t   56936 kB\nRssAnon:\t  20000 kB\n"
ROLLUP = ("55c5-7fff ---p 00000000 00:00 0    [rollup]\nRss:   56936 kB\nPss_Anon:  100 kB\n"
          "Pss:   30512 kB\nPss_Dirty:  144 kB\n")


def test_cpu_is_utime_plus_stime_counted_after_the_name() -> None:
    assert procfs.stat_ticks(STAT) == 731 + 45


def test_a_kib_field_is_its_own_line_not_one_it_prefixes() -> None:
    assert procfs.kib_field(STATUS, "VmRSS") == 56936
    assert procfs.kib_field(ROLLUP, "Pss") == 30512  # not Pss_Anon's, which comes first
    assert procfs.kib_field(ROLLUP, "Swap") is None


def test_this_process_reads_positive() -> None:
    used = procfs.usage(os.getpid())
    assert used.rss_mib > 0 and used.cpu_s > 0
    assert used.pss_mib is None or 0 < used.pss_mib <= used.rss_mib


def test_threads_by_name_finds_a_busy_named_thread_and_sums_to_the_whole() -> None:
    done = threading.Event()

    def spin() -> None:
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        done.wait(5)

    t = start_thread(spin, name="procfs-spinner")  # named for the OS too
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            named = procfs.threads_by_name(os.getpid())
            if named.get("procfs-spinner", (0.0, 0))[0] >= 0.05:
                break
            time.sleep(0.01)
        whole = procfs.threads_cpu_s(os.getpid())
    finally:
        done.set()
        t.join()
    assert named["procfs-spinner"][0] >= 0.05 and named["procfs-spinner"][1] >= 1
    assert sum(cpu for cpu, _ in named.values()) <= whole + 0.05  # read just before the whole


def test_threads_by_name_can_name_the_main_thread_apart_from_those_it_started() -> None:
    """Threads a process starts inherit its main thread's name (OpenMP's do): ``main``
    names the main thread alone; what the others of its name spent stays under that name."""
    pid = os.getpid()
    with open(f"/proc/{pid}/task/{pid}/comm") as f:
        comm = f.read().strip()
    main_before = procfs.threads_by_name(pid, main="main")["main"][0]
    end = time.thread_time() + 0.05
    while time.thread_time() < end:  # this test runs on the main thread: it spends there
        pass
    split = procfs.threads_by_name(pid, main="main")
    plain = procfs.threads_by_name(pid)
    assert threading.current_thread() is threading.main_thread()
    assert split["main"][0] >= main_before + 0.05
    others = split.get(comm, (0.0, 0))[0]  # the main thread's namesakes, if any
    assert abs(split["main"][0] + others - plain[comm][0]) < 0.05  # read a moment apart


def test_a_process_that_is_gone_is_an_error_not_a_zero() -> None:
    with pytest.raises(OSError):
        procfs.usage(2**22 + 1)  # above pid_max's largest value: never a process


VETTING = {"children": 3, "ready_s": 1.234, "cpu_s": 0.31, "rss_mib": 55.4, "pss_mib": 29.8,
           "per_child": [], "load_avg": 2.5, "loop": "uvloop"}


def only_memory(vetting: dict[str, Any]) -> dict[str, Any]:
    """``bench.json`` of ``kvservice bench --only memory``: no cases."""
    meta = {"date": "2026-12-02 07:00 UTC", "cpu": "cpu", "cores": 2, "memory_gib": 23.5,
            "versions": {"nixl": "1.5.1", "torch": "2.13.0"}, "load_avg_start": 1.0, "load_avg_end": 1.0}
    return {"meta": meta, "plan": {"repeats": 1}, "methods": ["kvservice"], "skipped": {}, "cases": [],
            "memory": {"n": 64, "ok": 64, "queued_per_request": 1400.0, "peak_per_request": 1600.0},
            "vetting": vetting, "targets": []}


def test_the_memory_part_prints_the_vetting_childs_figures_without_cases() -> None:
    table = report.table(only_memory(VETTING))
    assert "kvservice state per request (tracemalloc, n=64)" in table
    line = next(x for x in table.splitlines() if x.startswith("metadata-vetting child"))
    assert "median of 3" in line and "ready after 1.23 s" in line and "0.31 s CPU" in line
    assert "RSS 55 MiB, PSS 30 MiB" in line


def test_no_pss_is_left_out_not_printed_as_zero() -> None:
    line = report.vetting_line({**VETTING, "pss_mib": None})
    assert "RSS 55 MiB (" in line and "PSS" not in line


def test_a_child_that_did_not_start_is_a_line_saying_why() -> None:
    why = "vetting:uvloop: the vetting process could not create a NIXL agent: NixlUnavailable: ..."
    table = report.table(only_memory({"error": why}))
    assert f"metadata-vetting child (one per service): NOT MEASURED: {why}" in table.splitlines()


# -- CPU per request: the scheduler's per-thread count ------------------------------------------


def test_a_threads_schedstat_is_its_run_time_in_nanoseconds() -> None:
    assert procfs.schedstat_ns("123456789 2000 17\n") == 123456789
    assert procfs.schedstat_runs("123456789 2000 17\n") == 17


def test_the_main_thread_is_part_of_the_whole_and_both_grow_with_work() -> None:
    pid = os.getpid()
    whole0, main0 = procfs.threads_cpu_s(pid), procfs.thread_cpu_s(pid, pid)
    sum(i * i for i in range(300_000))  # CPU on this (the main) thread
    whole1, main1 = procfs.threads_cpu_s(pid), procfs.thread_cpu_s(pid, pid)
    assert main1 > main0 and whole1 > whole0
    assert main1 <= whole1


def test_a_thread_woken_ten_times_has_at_least_ten_more_runs() -> None:
    """Counted while the woken thread still lives (an ended thread leaves the sum); twenty
    hand-offs to it, of which at least ten must have woken a sleeping thread."""
    import threading
    pid = os.getpid()
    wake, done, leave = threading.Event(), threading.Event(), threading.Event()

    def sleeper() -> None:
        for _ in range(20):
            wake.wait(5)
            wake.clear()
            done.set()
        leave.wait(5)

    t = threading.Thread(target=sleeper)
    t.start()
    try:
        before = procfs.threads_cpu_and_runs(pid)[1]
        for _ in range(20):
            done.clear()
            wake.set()
            assert done.wait(5)
        after = procfs.threads_cpu_and_runs(pid)[1]
    finally:
        leave.set()
        t.join(5)
    assert after - before >= 10


def test_the_cpu_table_shows_each_side_and_the_loop_threads() -> None:
    results = only_memory(VETTING)
    nums = {"raw_nixl": {"cpu_send_us": 700.4, "cpu_recv_us": 71.0},
            "kvservice": {"cpu_send_us": 1004.0, "cpu_recv_us": 403.0, "loop_cpu_send_us": 180.0,
                          "loop_cpu_recv_us": 95.0}}
    results["methods"] = ["raw_nixl", "kvservice"]
    results["cases"] = [{"key": "w3/c64", "workload": "w3", "methods": nums},
                        {"key": "w1/contiguous", "workload": "w1", "methods": nums}]
    lines = report.cpu_lines(results)
    assert any(line.startswith("CPU per request, us, send/recv") for line in lines)
    row = next(line for line in lines if line.startswith("w3/c64"))
    assert row.split() == ["w3/c64", "|", "700/71", "1004/403", "|", "180/95"]
    assert not any(line.startswith("w1/") for line in lines)  # one request moves 256 MiB: no such row


def test_no_cpu_figures_no_cpu_table() -> None:
    results = only_memory(VETTING)
    results["cases"] = [{"key": "w3/c64", "workload": "w3", "methods": {"kvservice": {"req_s": 1.0}}}]
    assert report.cpu_lines(results) == []


def test_the_loop_threads_cpu_is_a_target_per_case_and_side() -> None:
    from kvservice.bench.run import TARGETS, evaluate

    kv = {"loop_cpu_send_us": 42.0, "loop_cpu_recv_us": 95.0}
    rows = {r["target"]: r for r in evaluate({"cases": [
        {"key": "w2/c1", "workload": "w2", "methods": {"kvservice": kv}, "runs": {}},
        {"key": "w1/contiguous", "workload": "w1", "methods": {"kvservice": kv}, "runs": {}}]})}
    assert TARGETS["loop_cpu_us"] == 50.0
    send, recv = (rows[f"w2/c1 kvservice loop-thread CPU/request, {side}"] for side in ("sender", "receiver"))
    assert (send["measured"], send["met"], send["goal"]) == (42.0, True, "<= 50 us")
    assert (recv["measured"], recv["met"]) == (95.0, False)
    assert not any(name.startswith("w1/") for name in rows)
