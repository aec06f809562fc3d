"""``kvservice bench --quick`` runs end to end and reports every method and workload.

A smoke test of the benchmark itself: it asserts that each number is there
and positive, never how fast anything is.  The sidecar method starts real
``kvservice serve`` daemons; they must be gone, with their names, afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvservice.bench.methods import NAME_PREFIX

pytestmark = [pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
MEASURED = ("limit", "raw_nixl", "kvservice", "sidecar")


def test_quick_bench_reports_every_method_and_workload(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "kvservice.cli", "bench", "--quick", "--out", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as bench:
        try:
            stdout, stderr = bench.communicate(timeout=280)
        except subprocess.TimeoutExpired:
            bench.kill()
            stdout, stderr = bench.communicate(timeout=30)
    assert bench.returncode == 0, stderr[-4000:]
    assert "kv/raw" in stdout and "sc/raw" in stdout  # the terminal table
    # the sidecar's daemons took their socket directory and shared pools with them
    tag = f"{NAME_PREFIX}{bench.pid}-"
    left = [p for d in ("/tmp", "/dev/shm") if os.path.isdir(d) for p in os.listdir(d) if p.startswith(tag)]
    assert not left, left

    results = json.loads((tmp_path / "bench.json").read_text())
    assert set(MEASURED) <= set(results["methods"])
    assert results["skipped"] == {}, results["skipped"]

    cases = results["cases"]
    assert {c["workload"] for c in cases} == {"w1", "w2", "w3"}
    assert {c["variant"] for c in cases if c["workload"] == "w1"} == {"contiguous", "scattered"}
    for case in cases:
        for method in MEASURED:
            numbers = case["methods"][method]
            for key in ("gbps", "req_s", "lat_p50_ms", "lat_p99_ms"):
                assert numbers[key] > 0, (case["key"], method, key, numbers)
        for method, ratio in (("kvservice", "kv_over_raw"), ("sidecar", "sidecar_over_raw")):
            assert case["methods"][method]["lag_samples"] > 0
            assert case[ratio]["median"] > 0

    memory = results["memory"]
    assert memory["ok"] == memory["n"] and memory["peak_per_request"] > 0
    kill = results["kill"]
    assert kill["tries"] and all(t["inflight"] > 0 for t in kill["tries"])
    assert {row["target"] for row in results["targets"]}  # every target evaluated

    chart = tmp_path / "bench.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not chart.exists()
    else:
        assert chart.stat().st_size > 10_000
