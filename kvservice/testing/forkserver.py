"""Start peer processes by forking a process that has already imported them.

A peer child (``python -m kvservice.testing.peer``) spends ~2-3 s of CPU importing
kvservice and torch before it serves, and a test suite starts hundreds of them: on a
small machine most of the CPU a run uses, and the reason a child under load misses its
start-up guard.  A fork server imports those modules once and forks a child per start
(as ``multiprocessing``'s forkserver does), so a child begins at its ``main()`` with
everything imported: a real, separate process (its own PID, NIXL agent, memory;
SIGKILL and SIGSTOP act on it alone), minus the import.

The server (``serve(FD, MODULE...)`` in a fresh interpreter) talks to its parent over
one ``SOCK_SEQPACKET`` socket: a start request (JSON: the function to call, as
``module:function``, its ``sys.argv``, environment and directory) with the child's stdin, stdout
and stderr descriptors attached (``SCM_RIGHTS``); the reply, the child's PID; later,
for every child, ``{"exit": pid, "code": ...}`` once the server has reaped it (the
server is its parent).  The parent's side is ``ForkServer``; ``ForkedProcess`` is the
child's handle, an ``anyio.abc.Process``.

What a forked child cannot differ in from the server: the Python executable, its
``PYTHON*`` and ``LD_*`` variables (read before anything runs) and the modules already
imported.  ``forkable`` says whether an environment is one of those; callers start
anything else the ordinary way.  Nothing NIXL or UCX loads before the fork (kvservice
imports NIXL lazily, at an agent's creation), so their variables (``UCX_*``) act in
the child as in a fresh process.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from typing import IO, Any

import anyio
import anyio.abc

__all__ = ["PRELOAD", "ForkServer", "ForkedPopen", "ForkedProcess", "forkable"]

#: what a test suite's server imports before it forks: the peer's side and the CLI (the
#: sidecar daemon's ``kvservice serve``); together, kvservice and torch
PRELOAD = ("kvservice.testing.peer", "kvservice.cli")

#: variables the interpreter or the dynamic loader reads before any of our code runs
_FIXED_PREFIXES = ("PYTHON", "LD_")
#: the largest message either side sends (a request carries an environment)
_MAX_MESSAGE = 1 << 20
#: how long a start may wait for the server (its first start includes its imports)
_START_TIMEOUT_S = 120.0
#: how long a child's exit code may trail its exit (the server reaps it on SIGCHLD)
_REAP_TIMEOUT_S = 10.0


def forkable(env: Mapping[str, str]) -> bool:
    """Can a child with environment ``env`` be forked from a server started in this
    process's environment?  Not when a variable read before start-up differs."""
    def fixed(e: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in e.items() if k.startswith(_FIXED_PREFIXES)}
    return fixed(env) == fixed(os.environ)


class ForkServer:
    """The parent's side: one server process, started on first use, stopped at exit."""

    _shared: ForkServer | None = None
    _shared_lock = threading.Lock()

    def __init__(self, preload: Sequence[str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        code = f"import {__name__} as s, sys; s.serve(int(sys.argv[1]), sys.argv[2:])"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno()), *preload],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._sock = ours
        self._start_lock = threading.Lock()
        self._state = threading.Condition()
        self._replies: list[dict[str, Any]] = []
        self._exits: dict[int, int] = {}
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    @classmethod
    def shared(cls, preload: Sequence[str]) -> ForkServer:
        """This process's server (one per process: started on first use with ``preload``;
        a server that died is replaced)."""
        with cls._shared_lock:
            if cls._shared is None or cls._shared._gone:
                cls._shared = cls(preload)
                atexit.register(cls._shared.close)
            return cls._shared

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            with self._state:
                if not data:
                    self._gone = True
                    self._state.notify_all()
                    return
                msg = json.loads(data)
                if "exit" in msg:
                    self._exits[msg["exit"]] = msg["code"]
                else:
                    self._replies.append(msg)
                self._state.notify_all()

    def start(self, entry: str, argv: Sequence[str], env: Mapping[str, str], fds: Sequence[int],
              cwd: str | os.PathLike[str] | None = None) -> int:
        """Fork a child that calls ``entry`` (``module:function``, no arguments; an int it
        returns is its exit code) with ``argv`` as ``sys.argv``, ``env`` as its environment,
        ``fds`` as its stdin, stdout and stderr and ``cwd`` (default: ours) as its directory;
        its PID.  Blocks (the first start waits for the server's imports): from an event
        loop, call it in a worker thread."""
        request = json.dumps({"entry": entry, "argv": list(argv), "env": dict(env),
                              "cwd": os.fspath(cwd) if cwd is not None else os.getcwd()})
        with self._start_lock:
            socket.send_fds(self._sock, [request.encode()], list(fds))
            with self._state:
                if not self._state.wait_for(lambda: self._replies or self._gone, timeout=_START_TIMEOUT_S):
                    raise TimeoutError(f"fork server {self._proc.pid}: no reply within {_START_TIMEOUT_S}s")
                if not self._replies:
                    raise RuntimeError(f"fork server {self._proc.pid} exited ({self._proc.poll()})")
                reply = self._replies.pop(0)
        if "error" in reply:
            raise RuntimeError(f"fork server {self._proc.pid}: {reply['error']}")
        return int(reply["pid"])

    def exit_code(self, pid: int) -> int | None:
        """``pid``'s exit code (negative: the signal that ended it), once reaped."""
        with self._state:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        """``exit_code``, waiting up to ``timeout`` for it (blocking: a worker thread's)."""
        with self._state:
            self._state.wait_for(lambda: pid in self._exits or self._gone, timeout=timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        """Stop the server (its children live on: each ends when its parent's streams do)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._sock.close()


class _Pidfd:
    """A forked child's pidfd.  Its server reaps the child at a moment of its own, so a
    signal goes through this: it reaches that child or nothing, never a process that
    reused its pid.  ``fd`` is -1 once closed (or if the child was reaped before it opened)."""

    __slots__ = ("fd",)

    def __init__(self, pid: int) -> None:
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:  # it has exited and been reaped already
            self.fd = -1

    def signal(self, sig: int) -> None:
        if self.fd >= 0:
            with contextlib.suppress(ProcessLookupError):  # exited, not yet reaped
                signal.pidfd_send_signal(self.fd, sig)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ForkedProcess(anyio.abc.Process):
    """A forked child, as ``anyio.open_process`` would return it: its stdin and stdout are
    one end of a socket pair each (a child reads and writes them as it would pipes)."""

    def __init__(self, server: ForkServer, pid: int, stdin: anyio.abc.ByteStream | None,
                 stdout: anyio.abc.ByteStream | None) -> None:
        self._server = server
        self._pid = pid
        self._stdin = stdin
        self._stdout = stdout
        self._pidfd = _Pidfd(pid)

    @classmethod
    async def start(cls, server: ForkServer, entry: str, argv: Sequence[str], env: Mapping[str, str],
                    stderr: int | None = None) -> ForkedProcess:
        """Fork a child calling ``entry`` (``ForkServer.start``); ``stderr`` a descriptor
        (default: ours)."""
        child_in, parent_in = socket.socketpair()
        parent_out, child_out = socket.socketpair()
        try:
            fds = [child_in.fileno(), child_out.fileno(), sys.stderr.fileno() if stderr is None else stderr]
            pid = await anyio.to_thread.run_sync(server.start, entry, argv, env, fds)
        except BaseException:
            for s in (parent_in, parent_out):
                s.close()
            raise
        finally:
            child_in.close()
            child_out.close()
        parent_in.shutdown(socket.SHUT_RD)
        parent_out.shutdown(socket.SHUT_WR)
        return cls(server, pid, await anyio.abc.UNIXSocketStream.from_socket(parent_in),
                   await anyio.abc.UNIXSocketStream.from_socket(parent_out))

    async def wait(self) -> int:
        code = self._server.exit_code(self._pid)
        if code is None:
            if self._pidfd.fd >= 0:
                await anyio.wait_readable(self._pidfd.fd)  # the child has exited: its server reaps it next
            code = await anyio.to_thread.run_sync(self._server.wait_exit, self._pid, _REAP_TIMEOUT_S)
            if code is None:
                raise RuntimeError(f"forked child {self._pid} exited but its server did not say how")
        self._pidfd.close()
        return code

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self._pidfd.signal(sig)

    async def aclose(self) -> None:
        for stream in (self._stdin, self._stdout):
            if stream is not None:
                await stream.aclose()
        with anyio.CancelScope(shield=True):
            await self.wait()

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._server.exit_code(self._pid)

    @property
    def stdin(self) -> anyio.abc.ByteSendStream | None:
        return self._stdin

    @property
    def stdout(self) -> anyio.abc.ByteReceiveStream | None:
        return self._stdout

    @property
    def stderr(self) -> anyio.abc.ByteReceiveStream | None:
        return None


class ForkedPopen:
    """A forked child with the ``subprocess.Popen`` surface a synchronous launcher uses
    (``pid``, ``stdout``, ``returncode``, ``poll``, ``wait``, signals): its stdin is
    ``/dev/null``, its stdout a pipe to ``stdout``."""

    def __init__(self, server: ForkServer, entry: str, argv: Sequence[str], env: Mapping[str, str], *,
                 stderr: int | None = None, cwd: str | os.PathLike[str] | None = None) -> None:
        read, write = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        try:
            fds = [devnull, write, sys.stderr.fileno() if stderr is None else stderr]
            self.pid = server.start(entry, argv, env, fds, cwd)
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(devnull)
            os.close(write)
        self._server = server
        self.stdout: IO[bytes] | None = os.fdopen(read, "rb")
        self.returncode: int | None = None
        self._pidfd = _Pidfd(self.pid)

    def poll(self) -> int | None:
        self.returncode = self._server.exit_code(self.pid)
        if self.returncode is not None:
            self._pidfd.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout or 0.0)
        self.returncode = code
        self._pidfd.close()
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self._pidfd.signal(sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# -- the server's side -------------------------------------------------------------------------


def serve(fd: int, preload: Sequence[str]) -> None:
    """The server: import ``preload``, then fork a child per request on socket ``fd``
    until its parent closes it."""
    sock = socket.socket(fileno=fd)
    for name in preload:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # children share these pages: no collection in a child writes to them
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        sel.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                if key.fileobj is sock:
                    msg, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 3)
                    if not msg:
                        return  # the parent is gone
                    pid = _fork(json.loads(msg), fds, (sock.fileno(), wake_r, wake_w, sel))
                    sock.send(json.dumps({"pid": pid}).encode())
                else:
                    os.read(wake_r, 4096)
                _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _fork(request: dict[str, Any], fds: list[int], ours: tuple[int, int, int, selectors.BaseSelector]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock_fd, wake_r, wake_w, sel = ours
        sel.close()
        for fd in (sock_fd, wake_r, wake_w):
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = request["argv"]
        module, function = request["entry"].split(":")
        returned = getattr(importlib.import_module(module), function)()
        code = returned if isinstance(returned, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    finally:  # however the child's work ends, it must never return into the server's loop
        unhandled = sys.exception()
        if unhandled is not None:
            traceback.print_exception(unhandled)
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
