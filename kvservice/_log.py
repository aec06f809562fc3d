"""Logging: library code logs through ``get_logger``; only entry points configure output.

A library is quiet unless the application asks (httpx, httpcore and anyio behave so):

* **Nothing configured** (an engine that embeds kvservice and sets up no logging):
  structlog is not configured, so each event goes to the standard library's
  ``logging.getLogger(name)`` as one line, ``peer.lost peer='10.0.0.7:7200' ...``.
  Python's defaults then apply: nothing on stdout, and warnings and above on
  stderr through ``logging.lastResort``.  A debug or info event costs a level check.
* **The application configures** ``logging`` (``basicConfig``, handlers on the
  ``kvservice`` logger): the events arrive there, under the module's logger name.
* **structlog is configured** (by the application, by ``configure_logging`` below,
  by a test's ``structlog.testing.capture_logs``): the events follow that
  configuration, as plain ``structlog.get_logger`` events would.

Entry points (``kvservice serve``, ``demo``, ``bench``, ``soak`` and the child
processes whose stdout is a protocol) call ``configure_logging``: structlog through
``logging``, rendered by structlog's ``ProcessorFormatter`` on one stderr handler.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import structlog
from structlog.typing import EventDict, WrappedLogger

__all__ = ["Throttle", "configure_logging", "get_logger"]

#: the handler ``configure_logging`` installs on the root logger (replaced by a second call)
HANDLER_NAME = "kvservice"


def _as_log_line(logger: WrappedLogger, method: str, event_dict: EventDict) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The last processor while structlog is unconfigured: ``event key=value ...`` as the
    ``logging`` message; an exception travels as ``exc_info`` for the handler to format."""
    event = event_dict.pop("event", "")
    exc_info = event_dict.pop("exc_info", None)
    fields = " ".join(f"{key}={value!r}" for key, value in event_dict.items())
    kwargs: dict[str, Any] = {"exc_info": exc_info} if exc_info else {}
    return (f"{event} {fields}" if fields else str(event),), kwargs


_UNCONFIGURED_PROCESSORS: list[Any] = [structlog.contextvars.merge_contextvars, _as_log_line]


class _Logger:
    """What ``get_logger`` returns: structlog's configuration when there is one, the
    standard library's ``logging`` otherwise (decided per event, so configuring after
    import works)."""

    __slots__ = ("_configured", "_stdlib", "_unconfigured")

    def __init__(self, name: str) -> None:
        self._stdlib = logging.getLogger(name)
        self._configured: Any = structlog.get_logger(name)
        self._unconfigured: Any = structlog.wrap_logger(
            self._stdlib, processors=_UNCONFIGURED_PROCESSORS, wrapper_class=structlog.stdlib.BoundLogger,
            cache_logger_on_first_use=True)

    # one method per level, spelled out: debug() runs per transfer, so no shared helper
    def debug(self, event: str, **kw: Any) -> Any:
        if structlog.is_configured():
            return self._configured.debug(event, **kw)
        if self._stdlib.isEnabledFor(logging.DEBUG):  # unconfigured debug and info: this check only
            return self._unconfigured.debug(event, **kw)
        return None

    def info(self, event: str, **kw: Any) -> Any:
        if structlog.is_configured():
            return self._configured.info(event, **kw)
        if self._stdlib.isEnabledFor(logging.INFO):  # unconfigured debug and info: this check only
            return self._unconfigured.info(event, **kw)
        return None

    def warning(self, event: str, **kw: Any) -> Any:
        if structlog.is_configured():
            return self._configured.warning(event, **kw)
        if self._stdlib.isEnabledFor(logging.WARNING):  # unconfigured debug and info: this check only
            return self._unconfigured.warning(event, **kw)
        return None

    def error(self, event: str, **kw: Any) -> Any:
        if structlog.is_configured():
            return self._configured.error(event, **kw)
        if self._stdlib.isEnabledFor(logging.ERROR):  # unconfigured debug and info: this check only
            return self._unconfigured.error(event, **kw)
        return None

    def exception(self, event: str, **kw: Any) -> Any:
        if structlog.is_configured():
            return self._configured.exception(event, **kw)
        if self._stdlib.isEnabledFor(logging.ERROR):  # unconfigured debug and info: this check only
            return self._unconfigured.exception(event, **kw)
        return None

    def critical(self, event: str, **kw: Any) -> Any:
        if structlog.is_configured():
            return self._configured.critical(event, **kw)
        if self._stdlib.isEnabledFor(logging.CRITICAL):  # unconfigured debug and info: this check only
            return self._unconfigured.critical(event, **kw)
        return None


class Throttle:
    """At most ``burst`` log lines per key in any ``window_s``: a flood of refusals (a
    hostile peer's garbage, a misconfigured worker) is counted in full but cannot flood
    the log or spend the loop on formatting lines.  ``allow`` answers ``None`` (do not
    log) or the number of lines of that key held back since the last one logged (log
    it, with that number)."""

    def __init__(self, burst: int = 10, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._burst = burst
        self._window = window_s
        self._clock = clock
        self._keys: dict[str, tuple[float, int, int]] = {}  # key -> (window start, logged in it, held back)

    def allow(self, key: str) -> int | None:
        now = self._clock()
        start, logged, held = self._keys.get(key, (now, 0, 0))
        if now - start >= self._window:
            start, logged = now, 0
        if logged >= self._burst:
            self._keys[key] = (start, logged, held + 1)
            return None
        self._keys[key] = (start, logged + 1, 0)
        return held


def get_logger(name: str) -> Any:
    """The logger library modules use: ``log = get_logger("kvservice.peers")``."""
    return _Logger(name)


def configure_logging(level: str = "info", json: bool | None = None, stream: Any = None) -> None:
    """For entry points only: structlog events and other libraries' ``logging`` records at
    ``level`` and above to ``stream`` (default stderr), as JSON lines, or key=value console
    output when ``json`` is None and the stream is a terminal.  Calling it again replaces
    the previous setup (``kvservice``'s dispatcher sets a default, a subcommand its own)."""
    stream = stream or sys.stderr
    if json is None:
        json = not stream.isatty()
    threshold = logging.getLevelNamesMapping()[level.upper()]
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        # disabled levels cost nothing: the bound logger's methods for them are no-ops
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(stream)
    handler.name = HANDLER_NAME
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,  # records of other libraries (nixl, asyncio) rendered alike
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            *([structlog.processors.format_exc_info] if json else []),
            renderer,
        ],
    ))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.name == HANDLER_NAME]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(threshold)
