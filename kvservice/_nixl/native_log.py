"""UCX's and NIXL's own log lines, as kvservice's events.

NIXL's UCX backend prints lines of its own (``UCX  ERROR connect(fd=16, ...) failed:
Connection refused``, ``try to increase "net.core.somaxconn"``) when a peer's process
goes away: the very event kvservice reports itself, in its words and at its level
(``peer.lost``, ``transfer.failed``).  Printed raw on stderr they read as a broken
install.  So, unless the operator chose where UCX logs (``UCX_LOG_FILE`` in ``ucx_env``
or in the environment), the door's first agent in a process starts with UCX's log
pointed at a pipe this module reads (``ucx_log_file``), and each line becomes an event
of the ``kvservice.ucx`` logger (``relog``):

* a peer that cannot be reached any more (connection refused or reset, endpoint
  timeout, ...): ``ucx.peer_unreachable`` at debug; kvservice's own events say which
  peer and what failed;
* any other ``ERROR``: ``ucx.error`` at warning, ``WARN``: ``ucx.warning``, ``FATAL``:
  ``ucx.fatal`` at error, each with UCX's raw ``line``; lower levels (an operator's
  ``UCX_LOG_LEVEL=info``) at info or debug; a line not in UCX's format: ``ucx.output``.

UCX reads ``UCX_LOG_FILE`` once per process, when its library loads with the first
agent; that agent's setting holds for every later one.  UCX flushes its log at once
for ``ERROR`` and ``FATAL`` lines only; lower levels arrive when its buffer fills or
with its next error.  What UCX writes as it aborts goes straight to stderr, never
here.  The reader is one daemon thread per process, started with the first capture:
it outlives any one service because UCX's log does.  UCX's end of the pipe is made
non-blocking once its library has opened it, so a reader that falls behind (or has
stopped, as the interpreter exits) costs UCX lines, never a stalled transfer.

NIXL's own C++ lines (``E1201 ... genNotif: backend 'UCX' returned error status
NIXL_ERR_REMOTE_DISCONNECT``) go to the process's stderr directly, where nothing can
re-log them; each restates a status the call also returns, which the door raises and
kvservice reports with a failure reason.  ``NIXL_LOG_LEVEL`` is therefore ``FATAL``
unless the environment sets it (``trial.nixl_log_level``): NIXL's library and each of its
backend plugins read it as they load (at import and at an agent's creation).

This module never imports ``nixl``: ``agent`` calls it around NIXL's import and its
agents' creation.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import threading
from collections.abc import Mapping

from .._log import Throttle, get_logger
from .._threads import start_thread

__all__ = ["after_agent_created", "relog", "ucx_log_file"]

log = get_logger("kvservice.ucx")

#: a UCX log line: ``[time] [host:pid:thread] file.c:123  UCX  LEVEL message``
_LINE = re.compile(r"^\[(?P<time>[\d.]+)\]\s+\[(?P<host>[^\]:]*):(?P<pid>\d+)\s*:[^\]]*\]\s+"
                   r"(?P<source>\S+:\d+)\s+(?P<component>\S+)\s+(?P<level>[A-Z]+)\s+(?P<message>.*)$")
#: what UCX says when a peer's process or host is gone (its connection refused, reset,
#: timed out): kvservice learns the same from NIXL's statuses and its own links
_PEER_GONE = re.compile(
    r"Connection refused|Connection reset|Broken pipe|Connection timed out|Endpoint timeout|"
    r"Destination is unreachable|No route to host|net\.core\.somaxconn|UCX_TCP_MAX_CONN_RETRIES|"
    r"Transport retry count exceeded|"
    # a connection packet the dying peer's half-closed socket delivered (tcp_cm.c: the
    # endpoint's connection event it cannot name)
    r"^tcp_ep 0x[0-9a-f]+: UNKNOWN \(\d+\)", re.IGNORECASE)
#: UCX's levels, as kvservice logs them
_EVENTS: dict[str, tuple[str, str]] = {
    "FATAL": ("error", "ucx.fatal"), "ERROR": ("warning", "ucx.error"), "WARN": ("warning", "ucx.warning"),
    "DIAG": ("info", "ucx.info"), "INFO": ("info", "ucx.info"), "PRINT": ("info", "ucx.info"),
}
#: the value ``ucx_log_file`` gives UCX: this process's end of the pipe
_CAPTURE = re.compile(r"^/proc/(?P<pid>\d+)/fd/\d+$")
#: longest line read as one (UCX's own buffer is 1 KiB by default); a longer one is split
MAX_LINE_BYTES = 8192
#: the pipe's size asked for (the kernel may give less): UCX's lines queued for the reader
PIPE_BYTES = 1 << 20

_lock = threading.Lock()
_pipe: tuple[int, int] | None = None  # (read, write) once this process captures UCX's log
_unblocked = False  # UCX's end of the pipe is non-blocking
_throttle = Throttle(burst=10, window_s=10.0)  # warnings per (level, source); only the reader uses it


def _operator_chose(ucx_env: Mapping[str, str]) -> bool:
    if "UCX_LOG_FILE" in ucx_env:
        return True
    value = os.environ.get("UCX_LOG_FILE")
    if value is None:
        return False
    # another kvservice process's pipe, inherited by a child spawned while that process
    # started its agent (its environment held the value for that moment): not a choice
    leaked = _CAPTURE.match(value)
    return leaked is None or int(leaked["pid"]) == os.getpid()


def _ucx_loaded() -> bool:
    """Whether UCX's library is in this process already (another NIXL user came first):
    then UCX has chosen its log file, and a pipe would never be written."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any("/libucs" in line for line in maps)
    except OSError:
        return False


def ucx_log_file(ucx_env: Mapping[str, str]) -> str | None:
    """The ``UCX_LOG_FILE`` an agent about to start must have, over the environment's:
    this process's pipe, read and re-logged here (started on first use); ``None`` when
    the operator chose (``ucx_env`` or the environment) or UCX is loaded already;
    ``stderr`` where no pipe can be had (never UCX's own default, the application's
    stdout)."""
    global _pipe
    with _lock:
        if _pipe is None:
            if _operator_chose(ucx_env) or _ucx_loaded():
                return None
            if not os.path.isdir(f"/proc/{os.getpid()}/fd"):  # UCX would fail to open the pipe's name
                return "stderr"
            try:
                read_fd, write_fd = os.pipe()  # both close on exec: no child inherits them
            except OSError as exc:
                log.warning("ucx.log_not_captured", error=repr(exc), note="UCX logs to stderr")
                return "stderr"
            with contextlib.suppress(OSError, AttributeError):  # Linux only; a smaller pipe still works
                fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            _pipe = (read_fd, write_fd)
            start_thread(_read, read_fd, name="kvservice-ucxlog")
        elif _operator_chose(ucx_env):
            return None  # UCX already logs to the pipe; an explicit choice still keeps its environment
        return f"/proc/{os.getpid()}/fd/{_pipe[1]}"


def after_agent_created() -> None:
    """Once UCX has opened the pipe (its library loaded with the first agent), make its
    end non-blocking: a full pipe then drops UCX's lines rather than stalling UCX."""
    global _unblocked
    with _lock:
        if _pipe is None or _unblocked:
            return
        ours = os.fstat(_pipe[1])
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd in _pipe:
                continue
            try:
                st = os.fstat(fd)
            except OSError:
                continue
            if stat.S_ISFIFO(st.st_mode) and (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino):
                flags = fcntl.fcntl(fd, fcntl.F_GETFL)
                fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
                _unblocked = True


def _read(fd: int) -> None:
    # a daemon thread: UCX's log lasts as long as the process; a line longer than
    # MAX_LINE_BYTES comes out as two events
    with open(fd, "rb") as reader:
        while raw := reader.readline(MAX_LINE_BYTES):
            try:
                relog(raw.decode(errors="replace").rstrip("\r\n"))
            except Exception:  # noqa: BLE001 - a logging handler's failure must not end the reader
                continue


def relog(line: str) -> None:
    """Log one of UCX's lines as kvservice's event (see the module's docstring)."""
    if not line.strip():
        return
    match = _LINE.match(line)
    if match is None:
        if _throttle.allow("output") is not None:
            log.warning("ucx.output", line=line)
        return
    level, message, source = match["level"], match["message"], match["source"]
    fields = {"ucx_pid": int(match["pid"]), "source": source, "message": message}
    if level in ("ERROR", "WARN") and _PEER_GONE.search(message):
        log.debug("ucx.peer_unreachable", **fields)
        return
    method, event = _EVENTS.get(level, ("debug", "ucx.debug"))
    if method in ("warning", "error"):
        held = _throttle.allow(f"{level} {source}")
        if held is None:
            return
        if held:
            fields["held_back"] = held
    getattr(log, method)(event, line=line, **fields)
