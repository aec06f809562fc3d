"""The soak's counters, the verdict on them, and how they are printed."""

from __future__ import annotations

import collections
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._leaks import FAILING, Trend, leak_table

#: counters that must stay 0; any other value fails the soak (exit status 1)
MUST_BE_ZERO = ("false_success", "unexplained_disagreements", "hung", "leaked_handles", "writes_after_settle",
                "crashes")

#: in a sender's failure message: its link ended because the peer sent nothing, not even a
#: heartbeat, for longer than ``peer_timeout_s`` (``_control.links``, "peer silent for 2.10s")
SILENCE = "peer silent for"


def disagreement_cause(fault: str, touched: bool, sent: Mapping[str, Any], stalled: bool, cut: bool = False) -> str:
    """Why a request's receiver verified every byte (``SUCCESS``) while its sender reported
    the failure ``sent``: the request's own fault (an abort or a deadline: the race
    settle.md documents), ``"stop/kill"`` when the soak stopped or killed its decode
    meanwhile (``touched``), ``"cut"`` when the soak cut its decode's network meanwhile or
    just before (``cut``: a link silent since the cut may end after it), ``"loop stall"``
    when the sender lost the link (``PEER_LOST``)
    while the loop of one of the two services was held long enough to end a link
    (``stalled``: the processes reported such a stall during the request) or to silence
    the soak did not inject (the sender's message says so), and ``"none"`` when nothing
    explains it.

    A loop held that long ends the link as a stop would: its peer hears nothing for
    ``peer_timeout_s``.  On a loaded machine that is the machine's fault, not the soak's:
    the soak counts it, it does not inject it.

    None of these is a false success: the receiver's ``SUCCESS`` is proven byte for byte,
    and a sender that had not seen its last WRITE end ``DONE`` when it lost the link cannot
    know the data landed, so it must not say ``SUCCESS``.  Only ``"none"`` fails the soak
    (``unexplained_disagreements``): a sender failing a request to a live, running peer
    without a cause is a defect."""
    if fault != "none":
        return fault
    if touched:
        return "stop/kill"
    if cut:
        return "cut"
    if sent.get("reason") == "PEER_LOST" and (stalled or SILENCE in str(sent.get("message") or "")):
        return "loop stall"
    return "none"


@dataclass
class Summary:
    transfers: int = 0  # requests that ran (each ends in exactly one bucket below, or in hung)
    succeeded_verified: int = 0
    failed_by_reason: collections.Counter[str] = field(default_factory=collections.Counter)
    false_success: int = 0  # a SUCCESS whose bytes differ from what was sent
    #: receiver SUCCESS (verified), sender failed, and no fault or stall explains it
    unexplained_disagreements: int = 0
    hung: int = 0
    leaked_handles: int = 0
    writes_after_settle: int = 0
    crashes: int = 0
    max_loop_lag_ms: float = 0.0
    unsettled_pages_max: int = 0
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    # not in the JSON: context for the table and for whoever reads a failure
    cuts_by_kind: collections.Counter[str] = field(default_factory=collections.Counter)  # netcut, by how
    cuts_healed: int = 0  # cuts after which a request to that decode, begun after the restore, succeeded
    cuts_killed_first: int = 0  # cuts whose decode the soak killed before that
    heal_s_max: float = 0.0  # the longest from a restore to that success
    cuts_unhealed_at_end: int = 0  # cuts whose decode lived to the end without that
    canaries_checked: int = 0
    settled_to_success: int = 0  # receiver failed, settled as SUCCESS (lost the abort race), bytes verified
    disagreements: collections.Counter[str] = field(default_factory=collections.Counter)
    prefill_loop_lag_ms: float = 0.0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    # the leak accounting (``_leaks``): every series judged, and how many processes each row had
    leaks: list[Trend] = field(default_factory=list)
    leak_pids: dict[str, int] = field(default_factory=dict)
    leak_samples: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "transfers": self.transfers, "succeeded_verified": self.succeeded_verified,
            "failed_by_reason": dict(sorted(self.failed_by_reason.items())),
            "false_success": self.false_success, "unexplained_disagreements": self.unexplained_disagreements,
            "hung": self.hung, "leaked_handles": self.leaked_handles,
            "writes_after_settle": self.writes_after_settle, "crashes": self.crashes,
            "max_loop_lag_ms": round(self.max_loop_lag_ms, 3), "unsettled_pages_max": self.unsettled_pages_max,
            "faults": dict(sorted(self.faults.items())),
            "seconds": round(self.seconds, 1),
            "leaks": {proc: {t.resource: t.as_json() for t in self.leaks if t.process == proc}
                      for proc in sorted({t.process for t in self.leaks})},
        }

    def note(self, text: str) -> None:
        """Say why a must-be-zero counter moved (the first few are printed)."""
        if len(self.notes) < 50:
            self.notes.append(text)


def problems(summary: dict[str, Any]) -> list[str]:
    """The counters of ``summary`` (its JSON form) that break the soak's promise, and the
    resources that grow without bound (``_leaks``), each named with its process."""
    bad = [f"{key} = {summary[key]}" for key in MUST_BE_ZERO if summary.get(key, 0) != 0]
    for proc, resources in summary.get("leaks", {}).items():
        for res, t in resources.items():
            if t["verdict"] in FAILING:
                cap = "" if t["cap"] is None else f", cap {t['cap']}"
                bad.append(f"leak: {proc} {res} {t['verdict']} (after warm-up {t['start']:g} -> {t['end']:g}, "
                           f"{t['slope_per_h']:+.1f}/h{cap})")
    return bad


#: failure reasons none of the soak's faults (kills, stops, cuts, aborts, deadlines) should cause.
#: They do not fail a run (a refusal can follow a cut: a vetting charge), but a run that saw one
#: keeps its children's log, which says which refusal it was
UNATTRIBUTED = ("INCOMPATIBLE", "REFUSED", "PEER_REPORTED", "CORRUPTED")


def unattributed(summary: dict[str, Any]) -> list[str]:
    """``reason=count`` for each failure of ``summary`` (its JSON form) in ``UNATTRIBUTED``."""
    failed = summary.get("failed_by_reason", {})
    return [f"{reason}={failed[reason]}" for reason in UNATTRIBUTED if failed.get(reason)]


def exit_code(summary: dict[str, Any]) -> int:
    return 1 if problems(summary) else 0


def table(s: Summary) -> str:
    rows: list[tuple[str, str]] = [
        ("transfers", str(s.transfers)),
        ("succeeded, verified", f"{s.succeeded_verified} (of them settled to SUCCESS after a failure: "
                                f"{s.settled_to_success})"),
        ("failed by reason", ", ".join(f"{k}={v}" for k, v in sorted(s.failed_by_reason.items())) or "-"),
        ("faults injected", ", ".join(f"{k}={v}" for k, v in sorted(s.faults.items())) or "-"),
        ("canaries checked", str(s.canaries_checked)),
        *([("network cuts", ", ".join(f"{k}={v}" for k, v in sorted(s.cuts_by_kind.items()))
            + f"; healed (a later request to that decode succeeded): {s.cuts_healed} (at most "
            f"{s.heal_s_max:.1f}s after the restore), killed first: "
            f"{s.cuts_killed_first}, not healed by the end: {s.cuts_unhealed_at_end}")]
          if s.cuts_by_kind else []),
        ("both sides differ", ", ".join(f"{k}={v}" for k, v in sorted(s.disagreements.items())) or "-"),
        ("unsettled pages, max", str(s.unsettled_pages_max)),
        ("loop lag max (ms)", f"{s.max_loop_lag_ms:.1f} (prefill, never stopped: {s.prefill_loop_lag_ms:.1f})"),
        ("seconds", f"{s.seconds:.1f}"),
    ]
    rows += [(key, str(getattr(s, key))) for key in MUST_BE_ZERO]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if s.leaks:
        lines += ["", f"leak accounting ({s.leak_samples} samples; after warm-up: start->end (slope per hour), "
                      "GROWS and OVER CAP fail; (short): too few samples to judge):", leak_table(s.leaks, s.leak_pids)]
    return "\n".join(lines)


def dumps(s: Summary) -> str:
    return json.dumps(s.as_json(), indent=2)
