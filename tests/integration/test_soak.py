"""``kvservice soak`` end to end (real processes, real NIXL), and its verdict.

The run: 150 requests with faults; the five counters that must be zero are zero,
requests succeeded (verified on the receiver) and faults did happen and did
fail requests.  The verdict: a summary with any of those counters above zero
fails the soak, so the run above could have failed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvservice.soak import MUST_BE_ZERO, Summary, exit_code, problems
from tests.helpers import scaled

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.nixl
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_soak_150_transfers_keeps_every_counter_at_zero(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvservice.cli", "soak", "--transfers", "150", "--seed", "1", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=scaled(220), check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert set(summary) == {
        "transfers", "succeeded_verified", "failed_by_reason", "false_success", "hung", "leaked_handles",
        "writes_after_settle", "crashes", "max_loop_lag_ms", "unsettled_pages_max", "faults",
    }
    assert summary["transfers"] == 150
    for key in MUST_BE_ZERO:
        assert summary[key] == 0, (key, summary)
    assert summary["succeeded_verified"] > 0
    # faults happened, and failed requests
    assert summary["faults"].get("sigkill", 0) + summary["faults"].get("sigstop", 0) > 0, summary
    assert sum(summary["faults"].values()) > 0
    assert {"PEER_LOST", "ABORTED", "REMOTE_DISCONNECT", "RECEIVER_KILLED"} & set(summary["failed_by_reason"])
    assert "soak " in proc.stderr  # the progress line
    assert "writes_after_settle" in proc.stdout  # the table


@pytest.mark.parametrize("counter", MUST_BE_ZERO)
def test_any_must_be_zero_counter_fails_the_soak(counter: str) -> None:
    good = Summary(transfers=10, succeeded_verified=10)
    assert exit_code(good.as_json()) == 0 and problems(good.as_json()) == []
    bad = Summary(transfers=10, succeeded_verified=9)
    setattr(bad, counter, 1)
    assert exit_code(bad.as_json()) == 1
    assert problems(bad.as_json()) == [f"{counter} = 1"]


def test_failures_and_faults_alone_do_not_fail_the_soak() -> None:
    s = Summary(transfers=10, succeeded_verified=5, unsettled_pages_max=40, max_loop_lag_ms=900.0)
    s.failed_by_reason.update({"PEER_LOST": 3, "ABORTED": 2})
    s.faults.update({"sigkill": 1})
    assert exit_code(s.as_json()) == 0
