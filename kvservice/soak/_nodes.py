"""One kvservice child process as the soak sees it: its events routed to whoever
waits for them, its free pages, its canaries, and whether the soak killed it.

A sidecar node is two processes: a ``kvservice serve`` daemon (it owns the NIXL
agent, so SIGSTOP goes to it) and the ``kvservice.testing.peer`` worker that drives it through
``SidecarClient``; SIGKILL and restart take both, as a host crash would."""

from __future__ import annotations

import itertools
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import anyio
import anyio.abc

from ..sidecar.local import LocalDaemon
from ..testing import PeerProcess

Key = str | tuple[str, str]  # a command's id, or (event, request id) for events without one
_ids = itertools.count()

#: how long a node may take to be ready: a child imports torch and kvservice and starts its
#: vetting child, seconds of CPU that a loaded machine (a test run beside the soak) stretches
#: past ``PeerProcess.start``'s 30 s default; a node that never starts still fails the soak
START_S = 120.0


class PrefixedDaemon(LocalDaemon):
    """A sidecar daemon started through a launcher ``prefix`` (``ip netns exec NS``: a
    network namespace); ``ip`` execs the daemon, so its pid is the daemon's own."""

    def __init__(self, *args: Any, prefix: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefix = tuple(prefix)

    def command(self) -> list[str]:
        return [*self.prefix, *super().command()]


@dataclass
class _Slot:
    ready: anyio.Event = field(default_factory=anyio.Event)
    event: dict[str, Any] | None = None


class Node:
    """A ``kvservice.testing.peer`` child.  Events are kept only for keys someone registered
    (``expect``) before the event could come, so nothing piles up over a long soak."""

    def __init__(self, name: str, proc: PeerProcess, num_pages: int, daemon: LocalDaemon | None = None) -> None:
        self.name = name
        self.proc = proc
        self.daemon = daemon
        self.address = proc.address
        self.free: list[int] = list(range(num_pages))
        self.canaries: dict[str, list[int]] = {}  # tag -> pages holding that tag's pattern
        self.killed = False  # by the soak: its exit is not a crash
        self.stopping = False  # asked to exit at the end
        self.stopped = False  # SIGSTOPped now
        self.faults_seen = 0  # SIGSTOP and SIGCONT so far: requests that saw one may end on both sides differently
        self.cut = False  # its network is cut now
        self.cuts_seen = 0  # cuts and restores so far: as faults_seen, for the network
        self.restored_at = float("-inf")  # when its last cut was restored
        self.unhealed = 0  # cuts restored since the last request begun after one succeeded
        self.dead = anyio.Event()
        self.returncode: int | None = None
        self.stray_errors: list[dict[str, Any]] = []
        self._slots: dict[Key, _Slot] = {}

    @classmethod
    async def start(cls, tg: anyio.abc.TaskGroup, name: str, config: dict[str, Any], num_pages: int,
                    env: dict[str, str], log: IO[Any], daemon: LocalDaemon | None = None,
                    prefix: Sequence[str] = ()) -> Node:
        """With ``daemon`` (not started yet): start it, then a worker driving it.  ``prefix``:
        the worker's launcher (``PeerProcess.start``), the daemon's own goes on the daemon."""
        if daemon is not None:
            await anyio.to_thread.run_sync(daemon.start)
            config = {"layout": config["layout"], "sidecar": daemon.socket}
        try:
            proc = await PeerProcess.start(tg, config, env=env, stderr=log, ready_timeout=START_S, prefix=prefix)
        except BaseException:
            if daemon is not None:
                await anyio.to_thread.run_sync(daemon.kill)
            raise
        node = cls(name, proc, num_pages, daemon)
        tg.start_soon(node._route)
        return node

    @property
    def alive(self) -> bool:
        return not self.dead.is_set() and not self.killed

    @property
    def crashed(self) -> bool:
        """Exited without the soak killing it, or failed its own clean exit (its daemon too)."""
        if self.killed:
            return False
        if self.daemon is not None and self.daemon.proc is not None:
            code = self.daemon.proc.poll()
            if code is not None and (not self.stopping or code != 0):
                return True
        if not self.dead.is_set():
            return False
        return not self.stopping or self.returncode not in (0, None)

    async def _route(self) -> None:
        try:
            async for ev in self.proc.events:
                key: Key = ev["id"] if ev.get("id") is not None else (ev["event"], str(ev.get("rid")))
                slot = self._slots.get(key)
                if slot is not None and not slot.ready.is_set():
                    slot.event = ev
                    slot.ready.set()
                elif ev["event"] == "error":
                    self.stray_errors.append(ev)
        except anyio.ClosedResourceError:  # stop() closed the stream
            pass
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                self.returncode = await self.proc.proc.wait()
            self.dead.set()
            for slot in self._slots.values():
                slot.ready.set()

    def expect(self, key: Key) -> None:
        """Keep the event for ``key`` when it comes."""
        if not self.dead.is_set():
            self._slots[key] = _Slot()

    async def wait(self, key: Key, timeout: float) -> dict[str, Any] | None:
        """The event for ``key``; None if it did not come within ``timeout`` or the process died."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        try:
            with anyio.move_on_after(timeout):
                await slot.ready.wait()
            return slot.event
        finally:
            self._slots.pop(key, None)

    def forget(self, key: Key) -> None:
        self._slots.pop(key, None)

    async def send(self, **cmd: Any) -> bool:
        """Write a command; False if the process is gone."""
        if self.dead.is_set():
            return False
        try:
            await self.proc.command(**cmd)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return False
        return True

    async def call(self, wait_s: float, /, **cmd: Any) -> dict[str, Any] | None:
        """Run a command that answers with its id; its answer within ``wait_s``, or None."""
        cid = f"{self.name}-{next(_ids)}"
        self.expect(cid)
        if not await self.send(id=cid, **cmd):
            self.forget(cid)
            return None
        return await self.wait(cid, wait_s)

    def signal(self, sig: signal.Signals) -> None:
        """To the process owning the NIXL agent (a sidecar node's daemon)."""
        try:
            if self.daemon is not None:
                self.daemon.signal(sig)
            else:
                self.proc.signal(sig)
        except ProcessLookupError:
            pass

    async def reap(self) -> None:
        """After a kill: wait for a sidecar node's daemon and remove the names it left."""
        if self.daemon is not None and self.daemon.proc is not None:
            daemon = self.daemon
            with anyio.move_on_after(10):
                await anyio.to_thread.run_sync(daemon.wait)
            daemon.cleanup_names()

    def kill(self) -> None:
        self.killed = True
        self.signal(signal.SIGKILL)
        if self.daemon is not None:
            try:
                self.proc.signal(signal.SIGKILL)  # the worker goes with its host
            except ProcessLookupError:
                pass

    async def stop(self) -> None:
        """Ask it to exit cleanly (SIGKILL after a while); its exit status tells whether it did."""
        self.stopping = True
        self.signal(signal.SIGCONT)
        with anyio.CancelScope(shield=True):
            await self.proc.stop(timeout=10)
            with anyio.move_on_after(5):
                await self.dead.wait()
            if self.daemon is not None:
                await anyio.to_thread.run_sync(self.daemon.stop)
