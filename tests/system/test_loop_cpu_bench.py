"""``benchmarks.loop_cpu`` measures a real run: every request sent and arrived, and the
loop's CPU, the watchdog's ticks and the loop's wake-ups counted over it.

The run goes in a process of its own, as its users run it: the benchmark configures
structlog for the whole process (errors only), which would silence the events later tests
of this worker capture."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks import loop_cpu
from tests.helpers import scaled

pytestmark = pytest.mark.nixl

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"(?P<n>\d+) requests: loop CPU (?P<cpu>\d+) us per request, wall (?P<wall>\d+) us per request, "
                  r"(?P<ticks>[\d.]+) ticks and (?P<wakes>[\d.]+) loop wake-ups per request")


def test_a_thread_woken_from_a_sleep_counts_a_wake_up() -> None:
    before = loop_cpu.wakeups()
    woken = threading.Event()
    threading.Timer(0.05, woken.set).start()
    assert woken.wait(5.0)
    time.sleep(0.01)
    assert loop_cpu.wakeups() >= before + 2


def test_a_run_counts_its_requests_ticks_and_wake_ups() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.loop_cpu", "--case", "w3/c1", "--rounds", "1",
                           "--concurrency", "2"], cwd=ROOT, capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 0, done.stderr[-4000:]
    found = LINE.search(done.stdout)
    assert found is not None, done.stdout
    assert int(found["n"]) == 256  # the case's requests, each sent and (on the way out) arrived
    assert int(found["cpu"]) > 0 and int(found["wall"]) > 0
    # a request's post goes to the NIXL thread in a tick, or in one lingering already: some ticks
    # for 256 requests, and the loop slept and was woken while the copies ran
    assert 0 < float(found["ticks"]) <= 4
    assert float(found["wakes"]) > 0
