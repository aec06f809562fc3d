"""The vLLM connector's stats payload (``kvservice.integrations.vllm.stats``): what a side
reports per step, how vLLM's aggregation adds two up, what its log line shows, and the
worker's timing hooks over a scripted engine.  vLLM's own engines carry the same payload
to their stat loggers in tests/integrations/vllm."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvservice.integrations.vllm.stats import Interval, Samples, is_empty, merge, payload_from, summary

from .test_vllm_side import make, ok, worker


def test_an_interval_reports_each_increment_once() -> None:
    counts: Counter[str] = Counter()
    interval = Interval(counts)
    assert interval.take() is None  # nothing happened: vLLM gets None
    counts["handoffs"] += 2
    counts["handoff_forged"] += 1
    assert interval.take() == {"counts": {"handoffs": 2, "handoff_forged": 1}, "load_s": [], "load_bytes": [],
                               "send_s": [], "send_bytes": []}
    assert interval.take() is None
    counts["handoffs"] += 1
    assert interval.take()["counts"] == {"handoffs": 1}  # type: ignore[index]


def test_samples_time_a_request_over_its_tp_peers_and_stay_bounded() -> None:
    samples = Samples(bound=2)
    # a load from two prefill ranks: from the first expect to the last block landed
    samples.ended("load", [ok("r@tp0.0", pages=2, created=1.0, finished=1.25),
                           ok("r@tp1.0", pages=2, created=1.5, finished=2.0)])
    # a send: from its first WRITE posted, not from its creation (the wait for the decode)
    samples.ended("send", [ok("s@tp0.0", pages=3, created=0.0, started=5.0, finished=5.5)])
    samples.ended("send", [ok("n@tp0.0", pages=1, started=None)])  # never posted: nothing to time
    samples.ended("send", [None])
    assert samples.take() == {"load_s": [1.0], "load_bytes": [4 * 4096], "send_s": [0.5], "send_bytes": [3 * 4096]}
    assert samples.take() == {"load_s": [], "load_bytes": [], "send_s": [], "send_bytes": []}

    counts: Counter[str] = Counter()
    interval = Interval(counts, samples)
    for i in range(3):  # one past the bound: counted, not kept
        samples.ended("load", [ok(f"x{i}", pages=1)])
    data = interval.take()
    assert data is not None and len(data["load_s"]) == 2 and data["counts"] == {"samples_dropped": 1}
    assert interval.take() is None


def test_aggregation_and_the_log_line() -> None:
    a = payload_from({"counts": {"loads": 2, "loads_ok": 1}, "load_s": [0.01], "load_bytes": [1 << 20]})
    b = {"counts": {"loads_ok": 1, "load_failed": 1}, "load_s": [0.03, 0.02], "load_bytes": [1 << 20, 1 << 20],
         "send_s": [], "send_bytes": []}
    merged = merge(a, b)
    assert merged["counts"] == {"loads": 2, "loads_ok": 2, "load_failed": 1}
    assert merged["load_s"] == [0.01, 0.03, 0.02]
    assert summary(merged) == {"load_failed": 1, "loads": 2, "loads_ok": 2, "loads_timed": 3, "load_avg_ms": 20.0,
                               "load_p90_ms": 28.0, "load_mib": 3.0}
    assert summary(payload_from(None)) == {} and is_empty(payload_from(None)) and not is_empty(merged)


def test_a_payload_is_copied_and_cleaned() -> None:
    raw: dict[str, Any] = {"counts": {"loads": 1, "bogus": True, "neg": -1, "text": "3"}, "load_s": [0.5, "x"],
                           "send_s": "not a list", "foreign": 1}
    data = payload_from(raw)
    assert data == {"counts": {"loads": 1}, "load_s": [0.5], "load_bytes": [], "send_s": [], "send_bytes": []}
    data["counts"]["loads"] += 1
    data["load_s"].append(1.0)
    assert raw["counts"]["loads"] == 1 and raw["load_s"] == [0.5, "x"]  # what vLLM handed in is untouched


def test_the_worker_times_successful_transfers_only() -> None:
    from kvservice.integrations.vllm.scheduler import RecvSpec, SendSpec, Work

    d, de = worker(1, 0)
    d.start(Work(recvs=[RecvSpec("good", make("g", ("10.0.0.5:7100",), 40, 32), (5, 6)),
                        RecvSpec("bad", make("b", ("10.0.0.5:7100",), 40, 32), (7, 8))]))
    good, bad = de.made["g@tp0.0"], de.made["b@tp0.0"]
    good.state, good.result = "Success", ok("g@tp0.0", pages=2, created=3.0, finished=3.5)
    bad.state, bad.settled = "Failed", True
    assert d.finished(set()) == (set(), {"good"}, set())
    assert d.finished(set()) == (set(), {"bad"}, {"bad"})  # failed, then reported once settled
    assert d.counts == {"loads_ok": 1, "load_failed": 1}
    assert d.samples.take() == {"load_s": [0.5], "load_bytes": [2 * 4096], "send_s": [], "send_bytes": []}

    p, pe = worker(1, 0)
    p.save(Work(sends=[SendSpec("s", (1, 2), 1)]))  # posted in the step that samples its last token
    sent = pe.made["s@tp0.0"]
    sent.state, sent.settled, sent.result = "Success", True, ok("s@tp0.0", pages=2, started=1.0, finished=1.25)
    assert p.finished({"s"}) == ({"s"}, set(), set())
    assert p.samples.take()["send_s"] == [0.25]
