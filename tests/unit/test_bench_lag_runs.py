"""``kvservice bench`` takes the sender's loop lag in a run of its own: the probe ticks every
millisecond on the loop it measures (about 40 us of that thread's CPU per tick here), a load
the throughput and CPU runs must not carry, nor raw NIXL's runs beside them.

The methods here are scripted stand-ins that record how each run was asked for (the real
ones are driven by ``tests/system/test_bench_smoke.py``); the ticker is the real one, on a
real event loop."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import anyio
import pytest

from kvservice.bench import run as bench_run
from kvservice.bench.kv_side import TICK_S, Ticker
from kvservice.bench.run import aggregate, evaluate, run_cases
from kvservice.bench.workloads import QUICK, Case, Request


class Scripted:
    """A method that records each run's ``case.lag`` and answers a sample; ``lags`` only
    when the run asked for them and the method records any."""

    def __init__(self, name: str, records_lag: bool, req_s: float) -> None:
        self.name, self.records_lag, self.req_s = name, records_lag, req_s
        self.asked: list[tuple[str, bool]] = []

    def start(self) -> None: ...

    def close(self) -> None: ...

    def measure(self, case: Case, prefix: str) -> dict[str, Any]:
        self.asked.append((case.key, case.lag))
        n = len(case.requests)
        sample: dict[str, Any] = {"start": 100.0, "end": 100.0 + n / self.req_s, "latencies": [0.001] * n,
                                  "cpu_s": {"send": 1e-4 * n}, "loop_cpu_s": {"send": 5e-5 * n}}
        if self.records_lag and case.lag:
            sample["lags"] = [0.0005, 0.004]
        return sample


def cases() -> list[Case]:
    reqs = [Request(f"r{i}", [i], [i]) for i in range(4)]
    return [Case("w3", "c1", 1, reqs), Case("w3", "c4", 4, reqs)]


def test_throughput_runs_carry_no_probe_and_each_case_gets_one_lag_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_run, "measured_cpu", lambda m, case, prefix: m.measure(case, prefix))
    raw, kv = Scripted("raw_nixl", False, 1000.0), Scripted("kvservice", True, 800.0)
    plan = replace(QUICK, repeats=3)
    got = run_cases([raw, kv], cases(), plan)

    assert all(lag is False for _, lag in raw.asked) and len(raw.asked) == 6
    assert [a for a in kv.asked if a[1]] == [("w3/c1", True), ("w3/c4", True)]  # one each, after the repeats
    assert [lag for _, lag in kv.asked[:6]] == [False] * 6
    for key in ("w3/c1", "w3/c4"):
        runs = got[key]["kvservice"]
        assert [("req_s" in r, "lag_p99_ms" in r) for r in runs] == [(True, False)] * 3 + [(False, True)]

    agg = {c["key"]: c for c in aggregate(cases(), got, [raw, kv])}
    kv_c1 = agg["w3/c1"]["methods"]["kvservice"]
    assert kv_c1["repeats"] == 3 and kv_c1["req_s"] == pytest.approx(800.0)
    assert kv_c1["lag_max_ms"] == pytest.approx(4.0) and kv_c1["loop_cpu_send_us"] == pytest.approx(50.0)
    assert agg["w3/c1"]["kv_over_raw"]["per_repeat"] == pytest.approx([0.8] * 3)  # the lag run is no repeat
    rows = {r["target"]: r for r in evaluate({"cases": list(agg.values())})}
    assert rows["sender loop lag max, in-flight scaling (w3)"]["measured"] == pytest.approx(4.0)


def test_the_ticker_ticks_only_in_a_run_that_asks() -> None:
    async def main() -> tuple[list[float], list[float]]:
        ticker = Ticker()
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker.run)
            ticker.start(probe=False)
            await anyio.sleep(20 * TICK_S)
            quiet = ticker.stop()
            ticker.start(probe=True)
            t0 = time.monotonic()
            await anyio.sleep(20 * TICK_S)
            ticking = ticker.stop()
            assert time.monotonic() - t0 < 5.0
            tg.cancel_scope.cancel()
        return quiet, ticking

    quiet, ticking = anyio.run(main)
    assert quiet == []
    assert 1 <= len(ticking) <= 21
