"""Virtual time: an asyncio loop whose clock moves only when nothing is ready.

``VirtualLoop`` is asyncio's selector loop with a selector that never blocks:
when the loop would wait for ``timeout`` seconds (the next timer), the clock
jumps by that much instead (trio's ``MockClock(autojump_threshold=0)``).  So a
simulated minute of heartbeats and deadlines costs only the callbacks it runs,
and the order of everything depends only on the program, never on the host.

kvservice reads ``time.monotonic()`` directly; ``patched_clock`` points those
modules' ``time`` at a shim that answers the loop's virtual time.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import time
import types
from collections.abc import Iterator
from typing import Any

#: kvservice modules that read the clock
CLOCK_MODULES = (
    "kvservice._transfer.plane", "kvservice._transfer.inbound", "kvservice._transfer.ends",
    "kvservice._control.links", "kvservice._transfer.requests", "kvservice._transfer.watchdog",
    "kvservice._nixl.door", "kvservice._stats", "kvservice._transfer.heal",
)
START = 1000.0


class SimDeadlock(RuntimeError):
    """Nothing is ready and no timer is due: every task waits for ever."""


class Clock:
    def __init__(self) -> None:
        self.now = START


class _JumpingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    def __init__(self, clock: Clock, real_limit_s: float) -> None:
        super().__init__()
        self._clock = clock
        self._real_deadline = time.monotonic() + real_limit_s

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events: list[tuple[selectors.SelectorKey, int]] = super().select(0)
        if events:
            return events
        if timeout is None:
            raise SimDeadlock("no callback ready and no timer set")
        if time.monotonic() > self._real_deadline:
            raise SimDeadlock("the simulation ran past its real-time limit")
        if timeout > 0:
            self._clock.now += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, real_limit_s: float = 60.0) -> None:
        self.clock = Clock()
        super().__init__(_JumpingSelector(self.clock, real_limit_s))

    def time(self) -> float:
        return self.clock.now


class _Shim(types.SimpleNamespace):
    """Stands in for the ``time`` module inside kvservice."""


def _virtual_now() -> float:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualLoop), "kvservice read the clock outside the simulation"
    return loop.clock.now


def _no_sleep(_: float) -> None:
    raise AssertionError("time.sleep on the simulated loop")


@contextlib.contextmanager
def patched_clock() -> Iterator[None]:
    import importlib

    shim = _Shim(monotonic=_virtual_now, perf_counter=_virtual_now, sleep=_no_sleep, time=time.time)
    saved: list[tuple[Any, Any]] = []
    for name in CLOCK_MODULES:
        module = importlib.import_module(name)
        saved.append((module, module.time))
        module.time = shim  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module, original in saved:
            module.time = original
