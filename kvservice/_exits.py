"""Exit codes of every ``kvservice`` command (the CLI and each subcommand share them), and
how a command that starts processes of its own treats SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and an expectation failed
EXIT_USAGE = 2  # bad arguments or configuration
EXIT_INTERRUPTED = 130  # stopped by SIGINT (Ctrl-C), or SIGTERM where a command treats it so: 128 + SIGINT


def _as_sigint(signum: int, frame: object) -> None:
    os.kill(os.getpid(), signal.SIGINT)


@contextlib.contextmanager
def sigterm_as_sigint() -> Iterator[None]:
    """Within the block SIGTERM (a CI job's timeout, ``kill``) is Ctrl-C: the process sends
    itself SIGINT, so the command unwinds as it does on Ctrl-C (its ``finally`` blocks stop
    the processes it started; an event loop's own handler cancels its run) and ends with
    ``EXIT_INTERRUPTED``.  SIGTERM's default ends the process at once and leaves its children
    running, or stopped by a fault for good.  The previous handler is back after the block."""
    previous = signal.signal(signal.SIGTERM, _as_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
