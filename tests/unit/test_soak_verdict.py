"""The soak's verdict on a request whose two sides ended differently.

A receiver's verified SUCCESS beside its sender's failure is no false success: the bytes
are proven, and a sender that lost the link before its WRITE was seen DONE cannot know
they landed.  The soak names the cause (the request's fault, a stop or kill of its decode,
a loop stall: one its processes reported during the request, or silence the sender
measured) and fails only on a disagreement nothing explains.  The long run counted three
such disagreements as false successes; that case is here.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvservice.soak import MUST_BE_ZERO, Summary, exit_code, problems
from kvservice.soak._run import longest_stall
from kvservice.soak._summary import disagreement_cause

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
