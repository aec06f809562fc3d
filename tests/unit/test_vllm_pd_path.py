"""``benchmarks.vllm_pd``'s segments of a kvservice hand-off, from the marks files of both engines."""

from __future__ import annotations

from pathlib import Path

from benchmarks.vllm_pd import SEGMENTS, Phase, kvservice_path
from kvservice.bench.stats import quantile

PHASES = (Phase("64 tok, 1 in flight", 64, 1, 2),)


def test_segments_and_each_sends_post_time(tmp_path: Path) -> None:
    # two requests of phase 0 (ids ...k0x...), each on its own: a send, then the posts so far
    (tmp_path / "kvservice-r0.txt").write_text(
        "alloc d-rk0x1 10.000\nrecv d-rk0x1 p1 10.001 10.002 10.006 10.007 99\nloaded d-rk0x1 10.008\n"
        "alloc d-rk0x2 20.000\nrecv d-rk0x2 p2 20.001 20.002 20.010 20.011 99\nloaded d-rk0x2 20.012\n")
    (tmp_path / "kvservice-r0-prefill.txt").write_text(
        "send p1 - 9.999 10.003 10.005 10.006 99\nposts - 1 0.006000 99\n"
        "send p2 - 19.999 20.003 20.009 20.010 99\nposts - 2 0.008000 99\n")
    table = kvservice_path(tmp_path, PHASES)
    header, row = table.strip().splitlines()[1:3]
    assert header.split()[-2:] == ["send's", "posts"]
    cells = [float(v) for v in row.split()[-len(SEGMENTS):]]
    got = dict(zip(SEGMENTS, cells, strict=True))
    assert got["expect sent->landed"] == round(quantile([4.0, 8.0], 0.5), 1)
    assert got["send 1st write-expect sent"] == 1.0
    assert got["send's posts"] == round(quantile([6.0, 2.0], 0.5), 1)  # 6 ms, then 8 - 6 (not 8)


def test_marks_without_post_lines_leave_that_segment_empty(tmp_path: Path) -> None:
    (tmp_path / "kvservice-r0.txt").write_text(
        "alloc d-rk0x1 10.000\nrecv d-rk0x1 p1 10.001 10.002 10.006 10.007 99\nloaded d-rk0x1 10.008\n")
    (tmp_path / "kvservice-r0-prefill.txt").write_text("send p1 - 9.999 10.003 10.005 10.006 99\n")
    row = kvservice_path(tmp_path, PHASES).strip().splitlines()[2]
    assert row.split()[-1] == "nan"
