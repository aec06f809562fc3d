"""The threads kvservice starts, named for the OS as well as for Python.

Python 3.11 names only its own ``threading.Thread`` object; ``top -H``, ``perf``, py-spy's
native view and ``/proc/PID/task/*/comm`` see every thread of the process as ``python``
(or as the engine's process title). A kvservice thread names itself at start, so an
operator can tell the NIXL door thread from an engine's own (15 bytes: the kernel's limit).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["start_thread"]

_PR_SET_NAME = 15  # prctl(2)
#: the longest name the kernel keeps (``TASK_COMM_LEN`` less its NUL)
OS_NAME_BYTES = 15


def _name_os_thread(name: str) -> None:
    """Best effort, Linux only: a thread that cannot be renamed runs on unnamed."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:OS_NAME_BYTES], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def start_thread(target: Callable[..., Any], *args: Any, name: str) -> threading.Thread:
    """Start a daemon thread running ``target(*args)``, called ``name`` by Python and the OS."""
    def main() -> None:
        _name_os_thread(name)
        target(*args)

    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    return thread
