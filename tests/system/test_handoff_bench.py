"""``python -m benchmarks.handoff`` runs end to end: a raw NIXL pull and kvservice, this
checkout and one ``--against`` (the same package, through the shadow directory the option
builds), each reporting its times and, for kvservice, each side's loop CPU and process CPU per
request and the state of every post it made.
A smoke test of the benchmark: it asserts the rows are there, never how fast anything is."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def test_handoff_bench_reports_each_method() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.handoff", "--pages", "1", "--requests", "2", "--rounds", "1",
         "--gap-s", "0.06", "--against", str(REPO / "kvservice")],
        cwd=REPO, capture_output=True, text=True, timeout=scaled(280))
    assert out.returncode == 0, out.stderr[-4000:]
    rows = {m.group(1): m for m in re.finditer(
        r"^1\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+(-|(\d+) / (\d+))\s+(-|(\d+) / (\d+))"
        r"(?:\s+(\d+) of (\d+))?$",
        out.stdout, re.M)}
    assert set(rows) == {"pull", "kvservice", f"kvservice@{REPO / 'kvservice'}"}, out.stdout
    assert rows["pull"].group(4) == "1.00" and rows["pull"].group(5) == rows["pull"].group(8) == "-"
    for name, row in rows.items():
        assert float(row.group(2)) > 0, out.stdout
        if name != "pull":  # one post per request, warm-up's excluded; each loop spent something
            assert row.group(12) == "2", out.stdout
            assert int(row.group(6)) > 0 and int(row.group(7)) > 0, out.stdout
            # each whole process spent at least what its loop thread did
            assert int(row.group(9)) >= int(row.group(6)) and int(row.group(10)) >= int(row.group(7)), out.stdout
