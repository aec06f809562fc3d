"""Entry-point plumbing: event-loop choice and logging (``configure_logging``, from
``_log``).  Library code never configures logging; only ``cli`` and the helper
processes call these."""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from ._config import LOOPS, ConfigError
from ._log import configure_logging

__all__ = ["configure_logging", "freeze_startup_objects", "run", "uvloop_available"]

T = TypeVar("T")


def uvloop_available() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def run(main: Callable[..., Awaitable[T]], *args: Any, loop: str = "auto") -> T:
    """Run ``main`` on asyncio, with uvloop when ``loop`` is "uvloop" or "auto" and it is installed."""
    if loop not in LOOPS:
        raise ConfigError(f"loop: must be one of {', '.join(LOOPS)}, got {loop!r}")
    if loop == "uvloop" and not uvloop_available():
        raise ConfigError("loop: 'uvloop' requested but uvloop is not installed")
    use_uvloop = loop != "asyncio" and uvloop_available()
    return anyio.run(main, *args, backend="asyncio", backend_options={"use_uvloop": use_uvloop})


def freeze_startup_objects() -> None:
    """What a serving process does once it is up: move everything allocated so far
    (torch, NIXL and the rest of the imports: ~170k objects) out of the cyclic GC's
    reach.  Without it every full collection walks them all, 100-250 ms measured on
    a 2-core machine, and those pauses dominate the event loop's worst stalls
    (``kvservice bench --only w3``).  Call it from entry points, after start-up.

    No ``gc.collect()`` first: that one full pass would itself stall the running
    loop for as long as the pauses this avoids; freezing is a list splice.  The
    price is that garbage alive at this moment is kept for good (start-up leaves
    little)."""
    gc.freeze()
