"""``benchmarks.wakes`` measures what it says and leaves nothing behind: no door thread, no child."""

from __future__ import annotations

import os
import threading

import pytest

from benchmarks import wakes


def _children() -> set[int]:
    me = os.getpid()
    with open(f"/proc/{me}/task/{me}/children") as f:
        return {int(pid) for pid in f.read().split()}


def test_every_operation_is_timed_and_nothing_is_left_running() -> None:
    before = _children()
    got = wakes.measure(rounds=200, repeats=1)
    assert list(got) == list(wakes.OPERATIONS)
    for name, (cpu, wall) in got.items():
        assert 0 < cpu < 0.01, name  # per operation: microseconds, not a lost second
        assert 0 < wall < 0.01, name
    # a hop wakes another thread, a round trip another process: dearer than a loop turn
    assert got["thread hop"][1] > got["loop turn"][1]
    assert got["process round trip"][1] > got["loop turn"][1]
    assert not [t for t in threading.enumerate() if t.name == "wakes-door"]
    assert _children() == before  # the echoing child was reaped


def test_only_measures_the_operations_named() -> None:
    assert list(wakes.measure(rounds=50, repeats=1, only=["loop turn"])) == ["loop turn"]
    with pytest.raises(KeyError):
        wakes.measure(rounds=1, repeats=1, only=["no such operation"])
