"""The connector's counters and transfer times, as vLLM collects a connector's stats.

vLLM asks each connector object for its stats once per engine step
(``get_kv_connector_stats``: the workers' in the model runner, the scheduler's after it
read the workers' reports), adds the two up (``KVConnectorStats.aggregate``), and hands
the sum to its stat loggers: the log line (``KV Transfer metrics: ...``, every
``VLLM_LOG_STATS_INTERVAL``) and its Prometheus families (``metrics.KVServicePromMetrics``).
What travels is a plain dict (it crosses vLLM's process boundaries as msgpack), this
module's *payload*::

    {"counts": {"loads_ok": 1, "handoff_forged": 2, ...},     # since the last step asked
     "load_s": [...], "load_bytes": [...],                      # one per successful load
     "send_s": [...], "send_bytes": [...]}                      # one per successful send

``counts`` are the increments of the sides' own ``counts`` (``SchedulerSide.counts``,
``WorkerSide.counts``: they stay cumulative there) since the last payload.  A load's time
runs from the decode's worker starting it (the expect) to its last block landed; a send's
from its first WRITE posted to its completion (not the wait for the decode's expect before
it).  Bytes are what moved, over every TP peer of the request.

Nothing here imports vLLM: ``metrics`` wraps it in vLLM's classes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from ..._results import TransferResult

__all__ = ["SERIES", "Interval", "Samples", "is_empty", "merge", "payload_from", "summary"]

#: the per-request series of a payload
SERIES = ("load_s", "load_bytes", "send_s", "send_bytes")
#: samples of one series kept between two of vLLM's asks; past this, a request is only
#: counted (``samples_dropped``): vLLM asks every step, so only a stalled engine gets there
MAX_SAMPLES = 4096


class Samples:
    """Times and bytes of the transfers that succeeded since vLLM last asked (a worker's)."""

    def __init__(self, bound: int = MAX_SAMPLES) -> None:
        self._bound = bound
        self._series: dict[str, list[float]] = {name: [] for name in SERIES}
        self.dropped = 0

    def ended(self, side: str, results: Sequence[TransferResult | None]) -> None:
        """One request's transfers ended well: ``side`` is ``"load"`` or ``"send"``,
        ``results`` its transfers' (one per TP peer)."""
        done = [r for r in results if r is not None]
        starts = [r.created_at if side == "load" else r.started_at for r in done]
        known = [s for s in starts if s is not None]
        if not done or not known:
            return
        times, sizes = self._series[f"{side}_s"], self._series[f"{side}_bytes"]
        if len(times) >= self._bound:
            self.dropped += 1
            return
        times.append(max(max(r.finished_at for r in done) - min(known), 0.0))
        sizes.append(sum(r.bytes for r in done))

    def take(self) -> dict[str, list[float]]:
        series, self._series = self._series, {name: [] for name in SERIES}
        return series


class Interval:
    """One connector object's stats since vLLM last asked: the increments of ``counts``
    (a side's cumulative counters) and, on a worker, its ``samples``."""

    def __init__(self, counts: Counter[str], samples: Samples | None = None) -> None:
        self._counts = counts
        self._samples = samples
        self._seen: Counter[str] = Counter()
        self._dropped = 0

    def take(self) -> dict[str, Any] | None:
        """The payload since the last call; None when nothing happened."""
        now = Counter(self._counts)
        counts = dict(now - self._seen)  # counters only grow: what is left is the increment
        self._seen = now
        data: dict[str, Any] = {"counts": counts}
        if self._samples is not None:
            data.update(self._samples.take())
            if self._samples.dropped > self._dropped:
                counts["samples_dropped"] = self._samples.dropped - self._dropped
                self._dropped = self._samples.dropped
        return None if is_empty(data) else payload_from(data)


def payload_from(data: Mapping[str, Any] | None) -> dict[str, Any]:
    """A payload of our own, copied from ``data`` (what vLLM hands back: a dict that other
    stat loggers may hold too); missing parts empty, foreign keys and values dropped."""
    data = data or {}
    counts = data.get("counts")
    out: dict[str, Any] = {"counts": {str(k): int(v) for k, v in counts.items()
                                      if isinstance(v, int) and not isinstance(v, bool) and v > 0}
                           if isinstance(counts, Mapping) else {}}
    for name in SERIES:
        values = data.get(name)
        out[name] = [float(v) for v in values if isinstance(v, (int, float))] if isinstance(values, list) else []
    return out


def is_empty(data: Mapping[str, Any]) -> bool:
    return not data.get("counts") and not any(data.get(name) for name in SERIES)


def merge(into: dict[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """``other`` added to ``into`` (counts summed, samples appended); ``into``."""
    counts = into.setdefault("counts", {})
    for name, n in (other.get("counts") or {}).items():
        counts[name] = counts.get(name, 0) + n
    for name in SERIES:
        into.setdefault(name, []).extend(other.get(name) or ())
    return into


def summary(data: Mapping[str, Any]) -> dict[str, int | float]:
    """What vLLM's log line shows of an interval: every count, then per side the requests
    timed, their mean and 90th-percentile time (ms) and the MiB they moved."""
    out: dict[str, int | float] = dict(sorted((data.get("counts") or {}).items()))
    for side in ("load", "send"):
        times = sorted(data.get(f"{side}_s") or ())
        if not times:
            continue
        out[f"{side}s_timed"] = len(times)
        out[f"{side}_avg_ms"] = round(sum(times) / len(times) * 1e3, 3)
        out[f"{side}_p90_ms"] = round(_percentile(times, 0.9) * 1e3, 3)
        out[f"{side}_mib"] = round(sum(data.get(f"{side}_bytes") or ()) / 2**20, 3)
    return out


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), of sorted values."""
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
