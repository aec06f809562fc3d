"""From raw samples to the numbers the report shows: rates, percentiles, medians, ratios."""

from __future__ import annotations

import math
import statistics
from typing import Any


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (0 for an empty list)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def summarize_sample(sample: dict[str, Any], nbytes: int, nreq: int) -> dict[str, Any]:
    """One run of one method: throughput, latency percentiles (ms) and, if recorded, loop lag (ms)."""
    elapsed = sample["end"] - sample["start"]
    lat = sample.get("latencies", [])
    out: dict[str, Any] = {
        "elapsed_s": elapsed,
        "gbps": nbytes / elapsed / 1e9,
        "req_s": nreq / elapsed,
        "lat_p50_ms": quantile(lat, 0.50) * 1e3,
        "lat_p99_ms": quantile(lat, 0.99) * 1e3,
    }
    for key in ("cpu", "loop_cpu"):  # CPU per request of each side's processes, or their main threads
        for side, seconds in sample.get(f"{key}_s", {}).items():
            out[f"{key}_{side}_us"] = seconds / nreq * 1e6
    lags = sample.get("lags")
    if lags is not None:
        out.update(lag_p50_ms=quantile(lags, 0.50) * 1e3, lag_p99_ms=quantile(lags, 0.99) * 1e3,
                   lag_max_ms=max(lags, default=0.0) * 1e3, lag_samples=len(lags))
    if "gc_max_s" in sample:
        out.update(gc_pause_lag_max_ms=sample["gc_max_s"] * 1e3,
                   gc_pause_cpu_lag_max_ms=sample.get("gc_cpu_max_s", 0.0) * 1e3)
    return out


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats; loop-lag max is the worst of all repeats."""
    if not runs:
        return {}
    out: dict[str, Any] = {"repeats": sum("elapsed_s" in r for r in runs)}
    for key in dict.fromkeys(k for r in runs for k in r):  # a lag run's keys are not every run's
        values = [r[key] for r in runs if key in r]
        out[key] = max(values) if key.endswith("lag_max_ms") else median(values)
    return out


def ratios(a_runs: list[dict[str, Any]], b_runs: list[dict[str, Any]], key: str) -> list[float]:
    """Per-repeat ``a / b`` of ``key`` (runs of one repeat share an index)."""
    return [a[key] / b[key] for a, b in zip(a_runs, b_runs, strict=False) if b.get(key)]
