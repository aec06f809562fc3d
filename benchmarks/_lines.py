"""JSON lines between the benchmark driver and its child processes.

The driver is synchronous: it writes one command per line to a child's stdin
and reads one reply per line from its stdout, each read bounded by a deadline.
Children write nothing else to stdout (logs go to stderr).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: the repository checkout holding ``benchmarks/``: children run from here
REPO_ROOT = Path(__file__).resolve().parent.parent
#: environment every child gets: loopback only, quiet logs
CHILD_ENV = {"UCX_NET_DEVICES": "lo", "KVSERVICE_LOG_LEVEL": "error", "PYTHONUNBUFFERED": "1"}


#: where children's stderr goes (None: the driver's stderr); the driver may point it at a log file
child_stderr: Any = None


class ChildError(RuntimeError):
    """A child process replied with an error, exited, or missed a deadline."""


class Child:
    """One child process speaking JSON lines (``python -m MODULE ROLE CONFIG``)."""

    def __init__(self, module: str, role: str, config: dict[str, Any], *, env: dict[str, str] | None = None,
                 path_first: Path | None = None) -> None:
        """``path_first``: a directory searched before the checkout for imports (to run
        another ``kvservice`` under this checkout's benchmark code)."""
        cmd = [sys.executable, "-m", module, role, json.dumps(config)]
        if path_first is not None:
            launch = (f"import runpy, sys; sys.path.insert(0, {str(path_first)!r}); "
                      f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
            cmd = [sys.executable, "-c", launch, role, json.dumps(config)]
        self.name = f"{module.rsplit('.', 1)[-1]}:{role}"
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=child_stderr,
            env={**os.environ, **CHILD_ENV, **(env or {})}, cwd=REPO_ROOT,
        )
        self.pid = self.proc.pid
        self._sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        self._sel.register(self._fd, selectors.EVENT_READ)
        self._buf = b""
        self.backlog: list[dict[str, Any]] = []

    def send(self, op: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError as exc:
            raise ChildError(f"{self.name} (pid {self.pid}) is gone") from exc

    def _read_line(self, deadline: float) -> dict[str, Any]:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildError(f"{self.name} (pid {self.pid}) did not answer in time")
            if not self._sel.select(timeout=min(left, 1.0)):
                if self.proc.poll() is not None:
                    raise ChildError(f"{self.name} (pid {self.pid}) exited with {self.proc.returncode}")
                continue
            chunk = os.read(self._fd, 1 << 20)
            if not chunk:
                self.proc.wait(timeout=10)
                raise ChildError(f"{self.name} (pid {self.pid}) exited with {self.proc.returncode}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            msg: dict[str, Any] = json.loads(line)
        except ValueError:
            print(f"{self.name}: not a reply: {line[:200]!r}", file=sys.stderr)
            return {"event": "noise"}
        return msg

    def wait(self, event: str, timeout: float = 60.0) -> dict[str, Any]:
        """The next reply named ``event`` (earlier unrelated replies are kept)."""
        for i, msg in enumerate(self.backlog):
            if msg.get("event") == event:
                return self.backlog.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            msg = self._read_line(deadline)
            if msg.get("event") == "error":
                raise ChildError(f"{self.name}: {msg.get('message')}")
            if msg.get("event") == event:
                return msg
            self.backlog.append(msg)

    def call(self, op: str, event: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.wait(event, timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self, timeout: float = 10.0) -> None:
        """Ask the child to exit; SIGKILL it if it has not within ``timeout``."""
        if self.proc.poll() is None:
            try:
                self.send("exit")
            except ChildError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._sel.close()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


_replies: Any = None


def take_stdout() -> None:
    """Child side, first thing: keep stdout for replies alone.

    Native libraries print to file descriptor 1 (UCX logs there), which would
    corrupt the JSON lines; so replies move to a private duplicate of it and
    fd 1 is pointed at stderr.
    """
    global _replies
    if _replies is None:
        sys.stdout.flush()
        _replies = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)


def emit(obj: dict[str, Any]) -> None:
    """Child side: one reply line."""
    out = _replies if _replies is not None else sys.stdout
    out.write(json.dumps(obj) + "\n")
    out.flush()
