"""Loaded by the bench's kvservice sender when ``benchmarks.door_ticks`` puts this directory
on its ``PYTHONPATH``: wraps the watchdog's ``run_tick`` to record every tick on the NIXL
thread (start, end, the thread's CPU, posts made, time inside the post calls, linger) and
writes them as JSON when the process exits.  Other processes import it and do nothing."""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from typing import Any

_OUT = os.environ.get("KVSERVICE_DOOR_TICKS_OUT", "")

if _OUT and "kvservice.bench.kv_side" in " ".join(sys.orig_argv) and "send" in sys.orig_argv:
    from kvservice._transfer import watchdog as _watchdog

    _ticks: list[tuple[float, float, float, int, float, float]] = []
    _run_tick = _watchdog.run_tick  # type: ignore[attr-defined]  # the name the watchdog calls

    def _recorded(door: Any, plan: Any) -> Any:
        t0, c0 = time.monotonic(), time.thread_time()
        out = _run_tick(door, plan)
        _ticks.append((t0, time.monotonic(), time.thread_time() - c0, len(out.post_times),
                       sum(s for _, s in out.post_times), plan.linger))
        return out

    _watchdog.run_tick = _recorded  # type: ignore[attr-defined]

    def _dump() -> None:
        with open(os.path.join(_OUT, f"send-{os.getpid()}.json"), "w") as f:
            json.dump(_ticks, f)

    atexit.register(_dump)
