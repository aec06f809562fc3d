"""``benchmarks.door_ticks``'s report over recorded ticks (the recording itself needs a bench run)."""

from __future__ import annotations

from benchmarks.door_ticks.__main__ import report


def test_the_report_reads_the_last_window_of_ticks() -> None:
    # (start, end, thread CPU, posts, seconds in post calls, linger): an early tick outside the
    # window, then 10 ms of ticks posting 10 in 8 ms, with 2 ms of gaps and an idle linger
    ticks = [[0.0, 0.004, 0.004, 4, 0.004, 0.0],
             [10.0, 10.004, 0.0035, 5, 0.0039, 0.0],
             [10.005, 10.009, 0.0035, 5, 0.0038, 0.0],
             [10.0095, 10.010, 0.0, 0, 0.0, 0.01]]
    line = report(ticks, window_s=1.0)
    assert "3 ticks, 10 posts" in line
    assert "in ticks 85 %" in line, line  # 8.5 ms of ticks over 10 ms
    assert "tick wall 850 us" in line and "tick CPU 700 us" in line and "post calls 770 us" in line, line


def test_a_run_without_posts_says_so() -> None:
    assert report([[0.0, 0.01, 0.0, 0, 0.0, 0.01]], window_s=1.0) == "no tick posted anything"
