"""``benchmarks.loop_cpu`` measures a real run: every request sent and arrived, and the
loop's CPU, the watchdog's ticks and the loop's wake-ups counted over it."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from benchmarks import loop_cpu

pytestmark = pytest.mark.nixl


def test_a_thread_woken_from_a_sleep_counts_a_wake_up() -> None:
    before = loop_cpu.wakeups()
    woken = threading.Event()
    threading.Timer(0.05, woken.set).start()
    assert woken.wait(5.0)
    time.sleep(0.01)
    assert loop_cpu.wakeups() >= before + 2


def test_a_run_counts_its_requests_ticks_and_wake_ups() -> None:
    r = anyio.run(loop_cpu.run, "w3/c1", 1, 2, backend="asyncio", backend_options={"use_uvloop": True})
    assert r.requests == 256  # the case's requests, each sent and (on the way out) arrived
    assert r.cpu > 0 and r.wall > 0
    # a request's post goes to the NIXL thread in a tick, or in one lingering already: some ticks
    # for 256 requests, and the loop slept and was woken while the copies ran
    assert 0 < r.ticks <= 4 * r.requests
    assert 0 < r.wakeups
