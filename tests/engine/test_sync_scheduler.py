"""The synchronous scheduler example as real processes with real NIXL: the decode is
SIGKILLed mid-run and restarted on the same address; every request is accounted for,
and every success was byte-verified by the decode that received it."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from examples.sync_scheduler import Child, request_ids
from tests.helpers import scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

N = 24
CRASH_AFTER = 6
LOST_WITH_THE_DECODE = {"PEER_LOST", "REMOTE_DISCONNECT", "TIMEOUT"}


def ends(child: Child) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for ev in child.seen:
        if ev["event"] == "end":
            assert ev["rid"] not in found, f"{ev['rid']} ended twice"
            found[ev["rid"]] = ev
    return found


def summary(child: Child) -> dict[str, Any]:
    (found,) = [ev for ev in child.seen if ev["event"] == "summary"]
    return found


def test_sync_scheduler_survives_a_decode_sigkill_and_restart() -> None:
    # The prefill admits nothing until the first decode is up (a router's order). A send waits
    # --bootstrap-timeout for the decode's expect: the requests admitted while the decode is
    # dead wait for the restarted one to start, which on a loaded machine took over 16 s
    # (a service's start and its vetting child), and that is slow, not lost.  A request the
    # dead decode announced but whose Expect it did not get out holds a prefill slot for the
    # whole --bootstrap-timeout (nobody expects it any more); the restarted decode's first
    # requests wait behind it, so its --arrival-timeout outlasts that (CI: the default 15 s
    # did not, and every request of the restarted decode timed out).
    common = ["--requests", str(N), "--step", "0.02", "--bootstrap-timeout", f"{scaled(25):g}",
              "--arrival-timeout", f"{scaled(40):g}", "--max-seconds", f"{scaled(90):g}"]
    prefill = Child(["prefill", *common, "--hold"])
    decode = again = None
    try:
        ready = prefill.wait_for(lambda ev: ev["event"] == "ready", scaled(60))
        assert ready is not None, "prefill did not start"
        decode = Child(["decode", *common, "--prefill", ready["address"]])
        d_ready = decode.wait_for(lambda ev: ev["event"] == "ready", scaled(60))
        assert d_ready is not None, "decode did not start"
        prefill.go()

        def mid_run(_: dict[str, Any]) -> bool:
            assert decode is not None
            got = ends(decode)
            announced = [ev["rid"] for ev in decode.seen if ev["event"] == "expecting"]
            in_flight = [rid for rid in announced if rid not in got]
            return sum(ev["status"] == "SUCCESS" for ev in got.values()) >= CRASH_AFTER and bool(in_flight)

        assert decode.wait_for(mid_run, scaled(60)) is not None, "the decode never got mid-run"
        os.kill(decode.pid, signal.SIGKILL)
        assert decode.finish(10) == -signal.SIGKILL
        announced = [ev["rid"] for ev in decode.seen if ev["event"] == "expecting"]
        cut = [rid for rid in announced if rid not in ends(decode)]
        assert cut, "nothing was in flight when the decode died"
        first = int(max(announced)[1:]) + 1
        port = d_ready["address"].rsplit(":", 1)[1]
        again = Child(["decode", *common, "--prefill", ready["address"], "--first", str(first), "--port", port])
        assert prefill.finish(scaled(90)) == 0
        assert again.finish(scaled(90)) == 0
    finally:
        for child in (prefill, decode, again):
            if child is not None and child.proc.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
                child.proc.wait()

    sent = ends(prefill)
    assert set(sent) == set(request_ids(N)), "a request was lost on the prefill"
    p = summary(prefill)
    assert (p["taken"], p["ended"], p["pending"]) == (N, N, 0)
    assert p["live_nixl_handles"] == 0 and p["sending"] == 0
    first_decode, second_decode = ends(decode), ends(again)
    # every success a decode reported, it verified byte for byte
    for got in (first_decode, second_decode):
        for ev in got.values():
            assert ev["status"] != "SUCCESS" or ev["verified"] is True, ev
    # the crash failed only what the dead decode had in flight, with the loss as the reason
    failed = {rid: ev for rid, ev in sent.items() if ev["status"] == "FAILED"}
    assert failed, "the SIGKILL failed nothing on the prefill"
    for rid, ev in failed.items():
        assert rid in cut and ev["reason"] in LOST_WITH_THE_DECODE, ev
    # after the restart everything succeeds, on both sides
    after = request_ids(N)[first:]
    assert set(second_decode) == set(after)
    assert all(second_decode[rid]["status"] == "SUCCESS" for rid in after), second_decode
    assert all(sent[rid]["status"] == "SUCCESS" for rid in after)
    d = summary(again)
    assert (d["pending"], d["unsettled"]) == (0, 0)
    # and what the first decode received before it died, the prefill delivered
    assert all(sent[rid]["status"] == "SUCCESS" for rid, ev in first_decode.items() if ev["status"] == "SUCCESS")
