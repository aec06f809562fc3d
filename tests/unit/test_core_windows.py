"""``benchmarks.core_windows``: who ran on a core within each send's window, from ``perf script``."""

from __future__ import annotations

import pytest

from benchmarks.core_windows import in_window, report, runs, windows


def switch(t: str, prev: str, prev_pid: int, nxt: str, next_pid: int) -> str:
    """A line of ``perf script -F time,trace`` for one ``sched:sched_switch``."""
    return (f" {t}: prev_comm={prev} prev_pid={prev_pid} prev_prio=120 prev_state=S ==> "
            f"next_comm={nxt} next_pid={next_pid} next_prio=120")


LINES = [
    switch("100.000000", "swapper/0", 0, "kvservice-nixl", 7),
    switch("100.004000", "kvservice-nixl", 7, "VLLM::EngineCore", 5),
    switch("100.006000", "VLLM::EngineCore", 5, "kvservice-nixl", 7),
    switch("100.010000", "kvservice-nixl", 7, "swapper/0", 0),
    switch("100.020000", "swapper/0", 0, "python", 9),
    "not a switch line",
]


def test_runs_give_each_stretch_to_the_thread_switched_in() -> None:
    assert runs(LINES) == [(100.0, 100.004, "kvservice-nixl[7]"), (100.004, 100.006, "VLLM::EngineCore[5]"),
                           (100.006, 100.01, "kvservice-nixl[7]"), (100.01, 100.02, "swapper/0[0]")]


def test_time_within_a_window_is_cut_at_its_edges() -> None:
    got = in_window(runs(LINES), 100.002, 100.012)
    assert got == pytest.approx({"kvservice-nixl[7]": 0.006, "VLLM::EngineCore[5]": 0.002, "swapper/0[0]": 0.002})


def test_the_report_sums_by_thread_name_over_the_sends_in_the_recording() -> None:
    marks = ["send p1 - 99.9 100.000 100.010 100.011 100.012",
             "send p2 - 50.0 50.100 50.200 50.300 50.301",  # before the recording: left out
             "posts - 1 0.004 100.013"]
    assert windows(marks) == [("p1", 100.0, 100.01), ("p2", 50.1, 50.2)]
    text = report(runs(LINES), windows(marks))
    assert text.splitlines()[0] == "p1: 10.0 ms: kvservice-nixl[7] 8.0, VLLM::EngineCore[5] 2.0"
    assert "all 1 windows, 10.0 ms" in text
    assert "kvservice-nixl                 8.0 ms   80.0 %" in text
