"""Test-wide configuration.

The two-process integration tests run the in-process service on both event
loops kvservice supports, asyncio's default loop and uvloop (child processes
use uvloop when installed, through ``kvservice._runtime.run``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop

BOTH_LOOPS = {"tests/integration/test_two_process.py", "tests/faults/test_bad_input.py"}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.nodeid.split("::")[0] in BOTH_LOOPS:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}
