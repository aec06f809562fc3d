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

from kvservice._results import KVServiceError

#: environment every child gets: loopback only, quiet logs (two-host runs replace the UCX part)
CHILD_ENV: dict[str, str | None] = {"UCX_NET_DEVICES": "lo", "KVSERVICE_LOG_LEVEL": "error",
                                    "PYTHONUNBUFFERED": "1"}
#: where this package's modules lie: a child launched with ``path_first`` loads them from here
BENCH_DIR = Path(__file__).resolve().parent


def child_environ(extra: dict[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment with ``CHILD_ENV`` and ``extra`` applied; ``None`` removes a variable."""
    # imported here, in the driver: children import this module under another kvservice
    # version too (benchmarks/compare), which may not have it
    from kvservice._config import host_ucx_defaults

    env = dict(os.environ)
    for name, default in host_ucx_defaults().items():  # the raw baselines' agents too (not through ServiceConfig)
        env.setdefault(name, default)
    for key, value in {**CHILD_ENV, **(extra or {})}.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _shadow_launch(path_first: Path, module: str) -> str:
    """Python code that imports ``kvservice`` from ``path_first`` (another version of the
    package), then this version's bench modules as ``kvservice.bench`` over it, and runs
    ``module``: the benchmark code is this one, the service under test the other."""
    return (
        "import importlib.util, runpy, sys\n"
        f"sys.path.insert(0, {str(path_first)!r})\n"
        "import kvservice\n"
        f"spec = importlib.util.spec_from_file_location('kvservice.bench', {str(BENCH_DIR / '__init__.py')!r},"
        f" submodule_search_locations=[{str(BENCH_DIR)!r}])\n"
        "bench = importlib.util.module_from_spec(spec)\n"
        "sys.modules['kvservice.bench'] = bench\n"
        "spec.loader.exec_module(bench)\n"
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    )


#: where children's stderr goes (None: the driver's stderr); the driver may point it at a log file
child_stderr: Any = None


class ChildError(KVServiceError, RuntimeError):
    """A child process replied with an error, exited, or missed a deadline.

    Raised by ``Child`` and the methods driving children; ``kvservice bench`` stops the
    run and says where the children's stderr is."""


class Child:
    """One child process speaking JSON lines (``python -m MODULE ROLE CONFIG``)."""

    def __init__(self, module: str, role: str, config: dict[str, Any], *,
                 env: dict[str, str | None] | None = None, path_first: Path | None = None) -> None:
        """``env``: variables set (or, as ``None``, removed) on top of ``CHILD_ENV``.
        ``path_first``: a directory holding another ``kvservice`` package for the child to
        import, under this version's benchmark code (``benchmarks/compare.py``)."""
        cmd = [sys.executable, "-m", module, role, json.dumps(config)]
        if path_first is not None:
            cmd = [sys.executable, "-c", _shadow_launch(path_first, module), role, json.dumps(config)]
            # and the processes it starts (its service's vetting child) import that version too,
            # not the one in the working directory (``python -m`` puts it first on the path)
            env = {**(env or {}), "PYTHONPATH": str(path_first), "PYTHONSAFEPATH": "1"}
        self.name = f"{module.rsplit('.', 1)[-1]}:{role}"
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=child_stderr,
            env=child_environ(env),
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

    @property
    def fd(self) -> int:
        """The child's reply pipe, for a caller's own ``select``."""
        return self._fd

    def read_ready(self) -> list[dict[str, Any]]:
        """Every whole reply that has arrived, after ``select`` said the pipe is readable
        (one ``read``, no wait); raises ``ChildError`` when the child has closed it."""
        chunk = os.read(self._fd, 1 << 20)
        if not chunk:
            self.proc.wait(timeout=10)
            raise ChildError(f"{self.name} (pid {self.pid}) exited with {self.proc.returncode}")
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                print(f"{self.name}: not a reply: {line[:200]!r}", file=sys.stderr)
        return out

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
