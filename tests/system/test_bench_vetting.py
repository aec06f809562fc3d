"""``kvservice bench``'s memory part measures the metadata-vetting child every service starts.

Its figures (time to ready, CPU, RSS) must be there, positive, in ``bench.json`` and in the
report; a child that cannot start must be a line saying why, not a zero and not a crash.
Nothing here is a speed check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvservice.bench import report, vetting
from tests.helpers import scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def test_only_memory_reports_the_vetting_childs_cost(tmp_path: Path) -> None:
    args = ["bench", "--quick", "--only", "memory", "--methods", "kvservice", "--no-chart", "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, "-m", "kvservice.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=scaled(280), check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp_path / "bench.json").read_text())
    vet = results["vetting"]
    assert "error" not in vet, vet
    assert vet["children"] == vetting.QUICK_RUNS == len(vet["per_child"])
    assert vet["ready_s"] > 0 and vet["cpu_s"] > 0 and vet["rss_mib"] > 0, vet
    assert vet["pss_mib"] is None or 0 < vet["pss_mib"] <= vet["rss_mib"], vet
    line = report.vetting_line(vet)
    assert line in done.stdout.splitlines()  # the terminal table
    assert line in (tmp_path / "results.md").read_text().splitlines()
    assert "kvservice state per request (tracemalloc" in done.stdout  # the memory part's other line


def test_a_vetting_child_that_cannot_start_is_an_error_that_says_why() -> None:
    # no such UCX transport: the vetting child cannot create its agent (its parent, the
    # bench's child, creates none and stays up to say so)
    got = vetting.measure("asyncio", 1, {"UCX_TLS": "no-such-transport"})
    assert set(got) == {"error"}, got
    assert "could not create a NIXL agent" in got["error"], got
    assert report.vetting_line(got).startswith("metadata-vetting child (one per service): NOT MEASURED: ")
