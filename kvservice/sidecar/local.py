"""``kvservice serve`` daemons started as child processes on this host.

The examples, the tests and the benchmark all run daemons next to each other
and next to other runs, so each daemon here gets names of its own: a socket in
a short private directory (``sun_path`` holds 107 bytes), a shared-segment
name with a random suffix, and ephemeral HTTP and control ports
(``KVSERVICE_*_PORT=0``) that it reports on its ready line.  Only the process
started here is ever signalled, by its pid, and only its own names are removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from typing import IO, Any, Protocol

from .._results import KVServiceError
from .settings import ENV_PREFIX
from .shm import segment_path


class DaemonError(KVServiceError, RuntimeError):
    """The daemon exited, or said nothing, before it was ready; the message says which
    (and where its log is).

    Raised by ``LocalDaemon.start`` / ``await_ready``: ``stop()`` it (a silent one may
    still run) and read its log."""


def short_tmpdir(prefix: str = "kvs-") -> str:
    """A new private directory short enough for socket paths."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def daemon_env(socket_path: str, shm_name: str, *, role: str | None = None,
               layout: Mapping[str, Any] | None = None, base: Mapping[str, str] | None = None,
               **overrides: str) -> dict[str, str]:
    """The environment of a daemon with its own names and ephemeral ports.

    ``base`` (default: this process's environment) loses every ``KVSERVICE_*``
    variable first, so settings meant for this process never leak into the
    daemon; ``role`` sets ``sidecar.roles``, ``layout`` the ``[layout]`` keys,
    and ``overrides`` (``KVSERVICE_*`` or anything else) win over all of it.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(ENV_PREFIX)}
    env.update({
        f"{ENV_PREFIX}SIDECAR_SOCKET_PATH": socket_path,
        f"{ENV_PREFIX}SIDECAR_SHM_NAME": shm_name,
        f"{ENV_PREFIX}HTTP_PORT": "0",
        f"{ENV_PREFIX}SERVICE_PORT": "0",
    })
    if role is not None:
        env[f"{ENV_PREFIX}SIDECAR_ROLES"] = role
    for key, value in (layout or {}).items():
        env[f"{ENV_PREFIX}LAYOUT_{key.upper()}"] = str(value)
    env.update(overrides)
    return env


class DaemonProcess(Protocol):
    """What ``LocalDaemon`` uses of its process: ``subprocess.Popen``'s surface (a test
    suite may start the daemon another way, e.g. forked from a process that imported it)."""

    pid: int
    stdout: IO[bytes] | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...


class LocalDaemon:
    """One ``kvservice serve`` child process serving ``role``.

    ``config``: a TOML file (``None``: the built-in defaults, then the
    environment).  The daemon's stderr is appended to ``log_path`` when given,
    else goes to ``stderr`` (an open file; ``None`` inherits this process's).
    """

    def __init__(self, role: str, workdir: str, *, name: str | None = None, shm: str | None = None,
                 config: str | os.PathLike[str] | None = None, layout: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, log_path: str | None = None, stderr: IO[Any] | None = None,
                 cwd: str | os.PathLike[str] | None = None) -> None:
        self.role = role
        self.name = name or role
        self.workdir = workdir
        self.socket = os.path.join(workdir, f"{self.name}.sock")
        self.shm = shm or f"kvs-{self.name}-{uuid.uuid4().hex[:10]}"
        self.config = None if config is None else str(config)
        self.env = daemon_env(self.socket, self.shm, role=role, layout=layout)
        self.env.update(env or {})
        self.log_path = log_path
        self.stderr = stderr
        self.cwd = cwd
        self.proc: DaemonProcess | None = None
        self.ready: dict[str, Any] = {}
        self._drain: threading.Thread | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def address(self) -> str:
        """The control address peers dial (``host:port``), from the ready line."""
        return str(self.ready["address"])

    @property
    def http(self) -> str:
        """The operations endpoint (``host:port``), from the ready line."""
        return str(self.ready["http"])

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "kvservice.cli", "serve"]
        return [*cmd, "--config", self.config] if self.config else cmd

    # -- starting ---------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> LocalDaemon:
        self.spawn()
        return self.await_ready(timeout)

    def spawn(self) -> None:
        """Start the process; ``await_ready`` then waits for its ready line."""
        log = open(self.log_path, "ab") if self.log_path else None  # the child keeps its own copy
        try:
            self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=log or self.stderr,
                                         env=self.env, cwd=self.cwd)
        finally:
            if log is not None:
                log.close()

    def await_ready(self, timeout: float = 60.0) -> LocalDaemon:
        """Read the ready line (JSON) the daemon prints on stdout once it serves."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DaemonError(f"{self.name} (pid {self.pid}): no ready line within {timeout:g} s"
                                      f"{self._log_hint()}")
                if not sel.select(timeout=min(left, 1.0)):
                    continue
                chunk = os.read(fd, 4096)
                if not chunk:  # end of file: it is exiting
                    code = self.wait(max(1.0, left))
                    raise DaemonError(f"{self.name} exited {code} before it was ready{self._log_hint()}")
                buf += chunk
        line, rest = buf.split(b"\n", 1)
        self.ready = json.loads(line)
        self._drain = threading.Thread(target=self._drain_stdout, args=(fd, rest), daemon=True,
                                       name=f"{self.name}-stdout")
        self._drain.start()
        return self

    def _drain_stdout(self, fd: int, first: bytes) -> None:
        """The daemon has nothing more for stdout, but native libraries may print
        there (UCX logs to stdout): read it until the daemon exits, so that a full
        pipe never blocks the daemon, and pass it on to where its stderr goes."""
        out: IO[bytes] | None = None
        try:
            if self.log_path:
                out = open(self.log_path, "ab")
            sink = out.fileno() if out is not None else (self.stderr or sys.stderr).fileno()
            if first:
                os.write(sink, first)
            while chunk := os.read(fd, 65536):  # until end of file: the daemon exited
                os.write(sink, chunk)
        except (OSError, ValueError):
            pass  # the log went away: nothing left to keep
        finally:
            if out is not None:
                out.close()

    def _log_hint(self) -> str:
        """The end of the daemon's log, for an error message."""
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, errors="replace") as f:
                return f"; its log {self.log_path} ends:\n{f.read()[-4000:]}"
        except OSError:
            return ""

    # -- stopping ---------------------------------------------------------------------------
    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process started here, if it still runs: one that exits
        between the check and the signal is not an error (``send_signal`` knows that race)."""
        if self.proc is not None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        """Its exit code (``subprocess.TimeoutExpired`` after ``timeout``)."""
        assert self.proc is not None
        code = self.proc.wait(timeout=timeout)
        if self._drain is not None:
            self._drain.join(timeout=5.0)  # end of file came with the exit
            if self._drain.is_alive():
                return code  # something else holds the pipe open: leave the reader its fd
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the daemon drains and removes its names), SIGKILL after ``timeout``."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            return self.wait(timeout)

    def kill(self) -> int:
        self.signal(signal.SIGKILL)
        return self.wait()

    def cleanup_names(self) -> None:
        """Remove what this daemon may have left (after a SIGKILL): its own names only."""
        for path in (self.socket, segment_path(self.shm)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def names_gone(self) -> bool:
        """Neither the socket nor the shared segment is left."""
        return not os.path.exists(self.socket) and not os.path.exists(segment_path(self.shm))

    def names_present(self) -> bool:
        return os.path.exists(self.socket) and os.path.exists(segment_path(self.shm))

