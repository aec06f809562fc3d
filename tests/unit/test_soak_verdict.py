"""The soak's verdict on a request whose two sides ended differently.

A receiver's verified SUCCESS beside its sender's failure is no false success: the bytes
are proven, and a sender that lost the link before its WRITE was seen DONE cannot know
they landed.  The soak names the cause (the request's fault, a stop or kill of its decode,
a loop stall: one its processes reported during the request, or silence the sender
measured) and fails only on a disagreement nothing explains.  The long run counted three
such disagreements as false successes; that case is here.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import kvservice.soak as soak_cli
from kvservice.soak import MUST_BE_ZERO, Summary, exit_code, problems
from kvservice.soak._run import longest_stall
from kvservice.soak._summary import disagreement_cause, unattributed

#: what the prefill reported in the long run: its link to a live, never-stopped decode
#: ended because no heartbeat came for longer than peer_timeout_s (1.5 s)
STALLED = {"status": "FAILED", "reason": "PEER_LOST",
           "message": "lost peer 10.0.0.2:4242: TimeoutError('peer silent for 2.31s')"}
RESET = {"status": "FAILED", "reason": "PEER_LOST",
         "message": "lost peer 10.0.0.2:4242: ConnectionResetError(104, 'Connection reset by peer')"}


@pytest.mark.parametrize(("fault", "touched", "sent", "stalled", "cause"), [
    ("abort_send", False, STALLED, False, "abort_send"),  # the request's own fault comes first
    ("recv_deadline", True, RESET, False, "recv_deadline"),
    ("none", True, RESET, False, "stop/kill"),  # the soak stopped or killed its decode meanwhile
    ("none", False, STALLED, False, "loop stall"),  # silence nobody injected: a stall of the machine
    ("none", False, RESET, True, "loop stall"),  # a loop held past the link's timeout meanwhile
    ("none", False, RESET, False, "none"),  # a live peer's link reset with nothing to explain it
    ("none", False, {**STALLED, "reason": "TIMEOUT"}, True, "none"),  # a stall explains only a lost link
    ("none", False, {**STALLED, "message": None}, False, "none"),
])
def test_each_disagreement_is_named_for_its_cause(fault: str, touched: bool, sent: dict[str, Any],
                                                  stalled: bool, cause: str) -> None:
    assert disagreement_cause(fault, touched, sent, stalled) == cause


def test_a_stall_counts_for_the_requests_it_overlaps() -> None:
    prefill = [(10.0, 2.0), (30.0, 0.6)]  # held 8..10 s, 29.4..30 s
    decode = [(50.0, 1.4)]  # 48.6..50 s
    assert longest_stall([prefill, decode], 9.0, 9.5) == 2.0  # inside
    assert longest_stall([prefill, decode], 5.0, 8.0) == 2.0  # ends as the stall begins
    assert longest_stall([prefill, decode], 10.0, 12.0) == 2.0  # begins as it ends
    assert longest_stall([prefill, decode], 10.5, 29.0) == 0.0  # between
    assert longest_stall([prefill, decode], 20.0, 60.0) == 1.4  # the longest of those met
    assert longest_stall([], 0.0, 100.0) == 0.0


def test_a_stall_passes_the_soak_and_an_unexplained_disagreement_fails_it() -> None:
    s = Summary(transfers=3, succeeded_verified=3)
    s.disagreements["recv SUCCESS, send PEER_LOST (loop stall)"] += 3
    assert s.as_json()["false_success"] == 0
    assert exit_code(s.as_json()) == 0
    s.unexplained_disagreements = 1
    assert exit_code(s.as_json()) == 1
    assert problems(s.as_json()) == ["unexplained_disagreements = 1"]
    assert "unexplained_disagreements" in MUST_BE_ZERO and "false_success" in MUST_BE_ZERO


@pytest.mark.parametrize("failed", [{"PEER_LOST": 3, "TIMEOUT": 1}, {"PEER_LOST": 3, "REFUSED": 2}])
def test_a_passing_run_keeps_the_childrens_log_only_for_a_failure_no_fault_explains(
        failed: dict[str, int], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """A run passes with a refusal among its failures (a cut can cost a vetting charge), but
    which refusal it was is in the children's log only: that log is kept, and the run says
    where; a run whose failures its faults explain removes it, as before."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # the CLI configures the process's logging (level error): later tests in this process
    # capture logs, so it is left as it is
    monkeypatch.setattr(soak_cli, "configure_logging", lambda *args, **kwargs: None)
    monkeypatch.setattr(soak_cli, "run", lambda *args: Summary(transfers=10, failed_by_reason=Counter(failed)))
    assert soak_cli.main(["--transfers", "10"]) == 0
    out = capsys.readouterr().out
    logs = list(tmp_path.glob("kvservice-soak-*"))
    if "REFUSED" in failed:
        assert "failures no fault explains (REFUSED=2)" in out and len(logs) == 1 and str(logs[0]) in out, out
        assert (logs[0] / "children.log").exists()
    else:
        assert "no fault explains" not in out and logs == [], out
    assert unattributed({"failed_by_reason": failed}) == (["REFUSED=2"] if "REFUSED" in failed else [])
