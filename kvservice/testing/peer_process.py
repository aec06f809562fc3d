"""The parent's side of a peer: start ``python -m kvservice.testing.peer``, send it
commands, wait for its events, signal it, stop it.

A peer is a real kvservice service with its own NIXL agent in a child process, so a
test can SIGKILL, SIGSTOP and restart it as a host would; its commands and events
are listed in ``kvservice.testing.peer``.  The child side lives there, apart, so that
``python -m`` runs it without this package having imported it first.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import IO, Any

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..memory._layout import KVLayout
from .forkserver import PRELOAD, ForkedProcess, ForkServer, forkable

#: what the parent runs with ``python -m``: the child side
PEER_MODULE = "kvservice.testing.peer"

#: whether peers are forked from a server that imported them (``use_fork_server``)
_forking = False


def use_fork_server(enabled: bool = True) -> bool:
    """Start this process's peers by forking them from a server that has imported the
    peer's modules once (``kvservice.testing.forkserver``): each start then costs a fork
    instead of ~2-3 s of imports.  For a test suite that starts hundreds of peers; a peer
    started with a launcher ``prefix``, a pipe for its stderr or another ``PYTHON*`` /
    ``LD_*`` environment still starts as ``python -m``.  Returns the previous setting."""
    global _forking
    before, _forking = _forking, enabled
    return before


def fork_server_in_use() -> bool:
    """Whether ``use_fork_server`` is on (a launcher of other children may follow it)."""
    return _forking


def peer_config(layout: KVLayout, **settings: Any) -> dict[str, Any]:
    """The configuration a peer reads: ``layout`` and ``ServiceConfig`` settings
    (``port=``, ``ucx_env=``, ``cluster_key=``, ...) as JSON-ready values."""
    return {"layout": {
        "layers": layout.layers, "page_tokens": layout.page_tokens, "kv_heads": layout.kv_heads,
        "head_dim": layout.head_dim, "dtype": layout.dtype, "num_pages": layout.num_pages,
    }, **settings}


@contextlib.asynccontextmanager
async def peer_processes(*configs: dict[str, Any], env: dict[str, str] | None = None,
                         ready_timeout: float = 30.0) -> AsyncIterator[list[PeerProcess]]:
    """Start one peer per config, each ready (within ``ready_timeout`` each: ``PeerProcess.start``);
    stop whatever is left on exit, even when the body fails or is cancelled (a peer that does
    not exit is SIGKILLed)."""
    async with anyio.create_task_group() as tg:
        started: list[PeerProcess] = []
        try:
            for cfg in configs:
                started.append(await PeerProcess.start(tg, cfg, env=env, ready_timeout=ready_timeout))
            yield started
        finally:
            with anyio.CancelScope(shield=True):
                for p in started:
                    await p.stop(timeout=5)
            tg.cancel_scope.cancel()


class PeerProcess:
    """The parent's handle on one peer: its ``address`` and NIXL ``agent`` name once
    ready, its commands, its events, its signals."""

    def __init__(self, proc: anyio.abc.Process, events: MemoryObjectReceiveStream[dict[str, Any]],
                 sink: MemoryObjectSendStream[dict[str, Any]]) -> None:
        self.proc = proc
        self._events = events
        self._sink = sink  # the pump's end: closed here too, in case the pump never ran
        self.backlog: list[dict[str, Any]] = []
        self.address = ""
        self.agent = ""
        self.pid = proc.pid

    @classmethod
    async def start(
        cls, tg: anyio.abc.TaskGroup, config: dict[str, Any] | None = None, *,
        env: dict[str, str] | None = None, ready_timeout: float = 30.0, prefix: Sequence[str] = (),
        stderr: int | IO[Any] | None = None,
    ) -> PeerProcess:
        """Start a child service.  ``prefix`` goes before the Python command line: a
        launcher that must ``exec`` it (so ``pid`` is the service's own), e.g.
        ``("ip", "netns", "exec", NAME)`` to run the child in a network namespace.
        ``stderr``: where the child's log goes (default: this process's stderr)."""
        args = [json.dumps(config or {})]
        full_env = {**os.environ, **(env or {})}
        proc: anyio.abc.Process
        if _forking and not prefix and stderr != subprocess.PIPE and forkable(full_env):
            proc = await _fork(args, full_env, stderr)
        else:
            proc = await anyio.open_process(
                [*prefix, sys.executable, "-m", PEER_MODULE, *args], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=stderr, env=full_env,
            )
        # Unbounded: a test that never reads some events (a traffic loop's "sent") must not
        # make the pump stop reading, or the child's writes would fill the pipe and stall it.
        send, recv = anyio.create_memory_object_stream[dict[str, Any]](math.inf)
        tg.start_soon(_pump, proc, send)
        peer = cls(proc, recv, send)
        try:
            ready = await peer.wait_for(lambda e: e["event"] == "ready", timeout=ready_timeout)
        except BaseException:
            # Not ready (it exited, timed out, or we were cancelled): nobody gets this
            # handle to stop, so stop the child and close its event streams here.
            with anyio.CancelScope(shield=True):
                await peer.stop(timeout=5)
            raise
        peer.address, peer.agent = ready["address"], ready["agent"]
        return peer

    @property
    def events(self) -> MemoryObjectReceiveStream[dict[str, Any]]:
        """Every event, in order, for one reader that routes them itself (not
        together with ``wait_for``/``event``, which keep a backlog of their own)."""
        return self._events

    async def command(self, **cmd: Any) -> None:
        """Send one command (``op=``, ``rid=``, ...); its events come later."""
        assert self.proc.stdin is not None
        await self.proc.stdin.send((json.dumps(cmd) + "\n").encode())

    async def wait_for(self, match: Callable[[dict[str, Any]], bool], timeout: float = 30.0) -> dict[str, Any]:
        """The first event ``match`` accepts, kept or to come; the others stay in
        ``backlog`` for later calls.  ``TimeoutError`` after ``timeout``; ``EOFError``
        when the peer exits first."""
        for i, ev in enumerate(self.backlog):
            if match(ev):
                return self.backlog.pop(i)
        with anyio.fail_after(timeout):
            async for ev in self._events:
                if match(ev):
                    return ev
                self.backlog.append(ev)
        raise EOFError(f"peer {self.pid} exited before the awaited event")

    async def event(self, name: str, rid: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
        """The first event called ``name`` (for request ``rid``, if given)."""
        return await self.wait_for(lambda e: e["event"] == name and (rid is None or e.get("rid") == rid), timeout)

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the peer unless it has exited (its pid may be another's by then)."""
        if self.proc.returncode is None:
            os.kill(self.pid, sig)

    async def stop(self, timeout: float = 10.0) -> int | None:
        """Ask the child to exit; SIGKILL it if it does not within ``timeout``.  Its event
        streams are closed however this ends (cancelled included)."""
        try:
            try:
                if self.proc.returncode is None:
                    await self.command(op="exit")
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
            with anyio.move_on_after(timeout):
                await self.proc.wait()
            if self.proc.returncode is None:
                self.signal(signal.SIGCONT)
                self.signal(signal.SIGKILL)
                await self.proc.wait()
        finally:
            self._events.close()
            self._sink.close()
            with anyio.CancelScope(shield=True):
                await self.proc.aclose()  # its stdin and stdout streams
        return self.proc.returncode


async def _fork(args: list[str], env: dict[str, str], stderr: int | IO[Any] | None) -> ForkedProcess:
    server = ForkServer.shared(PRELOAD)
    argv, entry = [PEER_MODULE, *args], f"{PEER_MODULE}:main"
    if stderr == subprocess.DEVNULL:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            return await ForkedProcess.start(server, entry, argv, env, devnull)
        finally:
            os.close(devnull)
    fd = stderr if isinstance(stderr, int) or stderr is None else stderr.fileno()
    return await ForkedProcess.start(server, entry, argv, env, fd)


_json = json.JSONDecoder()


def _events_in(line: str) -> list[dict[str, Any]]:
    """The JSON objects in one line of a child's stdout.  Something else in the child
    (a native library) may write to the same descriptor, so text that is not an event
    is skipped (and counted in ``stray_output``) rather than ending the parent."""
    events: list[dict[str, Any]] = []
    i = 0
    while i < len(line):
        start = line.find("{", i)
        if start < 0:
            break
        try:
            obj, i = _json.raw_decode(line, start)
        except json.JSONDecodeError:
            i = start + 1
            continue
        if isinstance(obj, dict) and "event" in obj:
            events.append(obj)
    if line.strip() and not events:
        stray_output.append(line[:200])
    return events


#: lines of children's stdout that held no event (the last few)
stray_output: collections.deque[str] = collections.deque(maxlen=20)


async def _pump(proc: anyio.abc.Process, send: anyio.abc.ObjectSendStream[dict[str, Any]]) -> None:
    assert proc.stdout is not None
    buf = b""
    async with send:
        try:
            async for chunk in proc.stdout:
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    for ev in _events_in(line.decode(errors="replace")):
                        ev["_t"] = time.monotonic()
                        await send.send(ev)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
