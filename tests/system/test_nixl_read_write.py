"""``python -m benchmarks.nixl_read_write`` runs: two pinned processes with real NIXL agents, a
WRITE and a READ of the same blocks each way, and a row per size with both times."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nixl]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("busy", ["none", "prefill"])
def test_both_ops_are_timed_for_every_size(busy: str) -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    cores = cores if len(cores) == 2 else cores * 2
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.nixl_read_write", "--tokens", "64", "256", "--repeats", "2",
         "--busy", busy, "--cores", *map(str, cores)],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["64", "256"], done.stdout
    for row in rows:
        write_ms, read_ms = float(row[2]), float(row[3])
        assert write_ms > 0 and read_ms > 0, row
