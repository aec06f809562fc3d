"""``kvservice bench --quick`` runs end to end and reports every method and workload.

A smoke test of the benchmark itself: it asserts that each number is there
and positive, never how fast anything is.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
MEASURED = ("limit", "raw_nixl", "kvservice")


def test_quick_bench_reports_every_method_and_workload(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvservice.cli", "bench", "--quick", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=280, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "kv/raw" in proc.stdout  # the terminal table

    results = json.loads((tmp_path / "bench.json").read_text())
    assert set(MEASURED) <= set(results["methods"])
    assert "sidecar" in results["methods"]  # measured, or listed with why not
    for skipped, why in results["skipped"].items():
        assert skipped in results["methods"] and why

    cases = results["cases"]
    assert {c["workload"] for c in cases} == {"w1", "w2", "w3"}
    assert {c["variant"] for c in cases if c["workload"] == "w1"} == {"contiguous", "scattered"}
    for case in cases:
        for method in MEASURED:
            numbers = case["methods"][method]
            for key in ("gbps", "req_s", "lat_p50_ms", "lat_p99_ms"):
                assert numbers[key] > 0, (case["key"], method, key, numbers)
        assert case["methods"]["kvservice"]["lag_samples"] > 0
        assert case["kv_over_raw"]["median"] > 0

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
