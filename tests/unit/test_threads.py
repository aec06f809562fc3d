"""kvservice's threads carry their names to the OS (``/proc/PID/task/TID/comm``), where
``top -H``, ``perf`` and py-spy's native view read them."""

from __future__ import annotations

import sys
import threading

import pytest

from kvservice._nixl.door import DoorThread
from kvservice._threads import OS_NAME_BYTES, start_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl are Linux's")


def comm(thread: threading.Thread) -> str:
    with open(f"/proc/self/task/{thread.native_id}/comm") as f:
        return f.read().strip()


def test_a_started_thread_is_named_for_the_os_and_runs_its_target() -> None:
    ran, named = threading.Event(), threading.Event()
    seen: list[str] = []

    def target(a: int, b: int) -> None:
        seen.append(str(a + b))
        ran.set()
        named.wait(5)

    thread = start_thread(target, 1, 2, name="kvservice-test")
    assert ran.wait(5)
    assert comm(thread) == "kvservice-test" and thread.name == "kvservice-test" and thread.daemon
    named.set()
    thread.join(5)
    assert seen == ["3"]


def test_a_long_name_is_cut_to_the_kernels_limit() -> None:
    started, release = threading.Event(), threading.Event()

    def target() -> None:
        started.set()
        release.wait(5)

    thread = start_thread(target, name="kvservice-a-very-long-name")
    try:
        assert started.wait(5)
        assert comm(thread) == "kvservice-a-very-long-name"[:OS_NAME_BYTES]
    finally:
        release.set()
        thread.join(5)


def test_the_nixl_door_thread_is_named() -> None:
    door = DoorThread()
    try:
        assert door.call_sync(threading.get_native_id) == door._thread.native_id  # it has run
        assert comm(door._thread) == "kvservice-nixl"
    finally:
        door.shutdown()
