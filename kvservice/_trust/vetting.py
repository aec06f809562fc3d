"""Proving a peer's NIXL metadata harmless before the service loads it.

UCX unpacks a peer's worker address and remote keys with assertions, not
errors: bytes it does not expect end the whole process (SIGABRT), and with it
every request of every peer.  No ``try`` can catch that, so before the door's
``add_peer`` a peer's metadata passes two gates:

1. ``metadata.check_metadata``: NIXL's serialised agent read field by field,
   the UCX address's version and every remote key's walk (microseconds);
2. a trial load in the *vetting child* (``vetchild``), a long-lived process of
   this service holding its own bare NIXL agent with the same UCX settings: it
   loads the metadata and unloads it at once.  If the child dies, the metadata
   is refused (``metadata_unsafe``), remembered, and the next peer's is tried on
   a fresh child.  A load that hangs past ``load_timeout_s`` kills the child too (its
   own deadline, not the asking handshake's) but is not remembered: a stopped or
   starved child hangs on honest metadata as well.

Metadata that passed is remembered by its SHA-256 (a peer that reconnects with
the same agent is not loaded twice); so is metadata that killed a child.

One source cannot keep the child down (``strikes``): metadata that kills or
taints a child is charged to the source it came from (its IP address; agent names
cost nothing), whose metadata is from then on vetted on a second child, started
for such sources only when one needs it; the first child, which every other
peer's first link is vetted on, is not lost to that source again.  Each further
charge refuses the source's Joins for a doubling backoff (``vetting_backoff``),
except where the network may be to blame (NIXL refused the load, whose connect to
the peer failed; or it hung): those escalate only when they follow the source's last
charge within a minute, so a peer whose handshakes a cut breaks now and then is
vetted apart, never refused (``Strikes.charge(escalate=False)``).

The child starts as the service starts.  It imports NIXL and nothing of the
service (``vetchild``): ~0.3 s of CPU and ~55 MB resident here, which a service
that never peers pays too (~2.3 s and ~590 MB in SGLang's environment when it
imported the whole package and torch).  It boots while the service makes its
pool and agent, and the port opens without waiting for it.  A handshake here
waits for a child that is (re)starting before its own deadline begins, but the
peer at the other end waits inside its ``connect_timeout_s``: a child still
booting cost first links their deadline under load, which is why it is kept
light.  A child that died after serving is replaced at once, in the background.
The child is spawned without ``fork()`` (see ``_supervise``), talks over a
socket pair, and is stopped and reaped when the service's task group ends,
cancelled or not.

If the child cannot be started at all, nothing is loaded: every peer is refused
(``vetting_unavailable``) rather than risk the service.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from .._log import get_logger
from .._nixl.trial import nixl_build
from .metadata import check_metadata
from .strikes import Strikes
from .vetchild import BROKEN, LOADED, READY, REPLY, REQUEST

log = get_logger("kvservice.vetting")

METADATA_UNSAFE = "metadata_unsafe"
VETTING_UNAVAILABLE = "vetting_unavailable"
#: a source whose metadata cost a child recently (``strikes``)
VETTING_BACKOFF = "vetting_backoff"
#: the source of metadata whose connection has no IP address
NO_SOURCE = "-"
#: importing NIXL and creating an agent: ~0.5 s on an idle 2-core machine, seconds on a loaded one
START_TIMEOUT_S = 60.0
#: a trial load is a few milliseconds; one that hangs is refused and its child replaced
LOAD_TIMEOUT_S = 10.0
#: SHA-256 digests remembered, each way
REMEMBERED = 4096
#: children a single metadata may be tried on when others' metadata killed them first
ATTEMPTS = 3
#: what the child runs (``python -P``: by path, see ``vetchild``)
CHILD = str(Path(__file__).with_name("vetchild.py"))


@dataclass(frozen=True, slots=True)
class Refusal:
    kind: str  # METADATA_UNSAFE or VETTING_UNAVAILABLE, for Stats.refuse and the Reject
    message: str


@dataclass(eq=False)
class _Pending:
    digest: bytes
    source: str = NO_SOURCE  # where it came from: charged if it costs the child
    done: anyio.Event = field(default_factory=anyio.Event)
    status: int | None = None  # LOADED / REFUSED; None: the child died (see ``killed``)
    killed: str | None = None  # the child died while loading this one: how
    #: the child was killed because this load hung past ``load_timeout_s``: the metadata, the
    #: child (stopped, starved) or the machine may be to blame, so it is not remembered unsafe
    hung: bool = False
    retry: bool = False  # the child died loading an earlier request: try again
    asked: float = 0.0  # when it was sent to the child (monotonic seconds; its turn: nothing before it)


@dataclass(eq=False)
class _Child:
    apart: bool = False  # the second lane's: only sources that cost a child before are vetted on it
    ready: anyio.Event = field(default_factory=anyio.Event)  # set when ready, broken or ended
    ended: anyio.Event = field(default_factory=anyio.Event)
    proc: subprocess.Popen[bytes] | None = None
    stream: anyio.abc.SocketStream | None = None  # requests out, replies in
    broken: str | None = None  # why it could not serve
    #: NIXL refused something here: a failed load can leave state behind in NIXL (a UCX
    #: endpoint for that agent name), so the answers after it are not trusted; it is replaced
    tainted: bool = False
    pending: dict[int, _Pending] = field(default_factory=dict)  # in the order sent: the first is loading
    #: one load at a time: a load's timeout is its own, never the queue's in front of it (a
    #: burst of new peers on a busy machine queued past the timeout, and the one loading was
    #: then blamed, killed and remembered as unsafe)
    turn: anyio.Lock = field(default_factory=anyio.Lock)


class MetadataVetter:
    """Vets peers' metadata for one service; its child lives in that service's task group."""

    def __init__(self, tg: anyio.abc.TaskGroup, ucx_env: Mapping[str, str], *, agent_prefix: str = "kvservice",
                 start_timeout_s: float = START_TIMEOUT_S, load_timeout_s: float = LOAD_TIMEOUT_S,
                 strikes: Strikes | None = None) -> None:
        self._tg = tg
        self._ucx_env = dict(ucx_env)
        self._agent_prefix = agent_prefix
        self._start_timeout = start_timeout_s
        #: a trial load not answered within this kills its child (``_load_deadline``)
        self.load_timeout_s = load_timeout_s
        self._child: _Child | None = None
        self._apart: _Child | None = None  # the second lane's child, while one runs
        self.strikes = strikes if strikes is not None else Strikes()  # (an empty table is falsy)
        self._ids = itertools.count(1)
        self._safe: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._unsafe: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.children_started = 0  # both lanes'
        #: why the last child that could not serve could not (``None`` until one could not)
        self.last_broken: str | None = None

    @property
    def pid(self) -> int | None:
        """The vetting child's pid while one runs."""
        child = self._child
        if child is None or child.proc is None or child.ended.is_set():
            return None
        return child.proc.pid

    @property
    def serving(self) -> bool:
        """Whether a child has said it is ready and serves now."""
        child = self._child
        return (child is not None and child.ready.is_set() and child.broken is None
                and not child.ended.is_set())

    def start(self) -> None:
        """Start the child in the background (if none runs)."""
        self._current()

    async def ready(self) -> None:
        """Wait until a child that is starting serves (or could not start); at once when none
        is starting: ``vet`` starts one then (a child that could not start is not started
        again twice for one peer)."""
        if self._child is not None:
            await self._ready()

    async def _ready(self, apart: bool = False) -> _Child:
        child = self._current(apart)
        with anyio.move_on_after(self._start_timeout):
            await child.ready.wait()
        if not child.ready.is_set():
            child.broken = self.last_broken = f"the vetting process did not start within {self._start_timeout:g} s"
            self._kill(child)
        return child

    async def vet(self, metadata: bytes, source: str = NO_SOURCE) -> Refusal | None:
        """``None`` when ``metadata`` (from ``source``, an IP address) may be loaded into NIXL;
        else why not."""
        why = check_metadata(metadata)
        if why is not None:
            return Refusal(METADATA_UNSAFE, why)
        digest = hashlib.sha256(metadata).digest()
        if digest in self._safe:
            self._safe.move_to_end(digest)
            return None
        if (known := self._unsafe.get(digest)) is not None:
            return Refusal(METADATA_UNSAFE, known)
        now = time.monotonic()
        if (backoff := self.strikes.refused(source, now)) is not None:
            strikes, left = backoff
            return Refusal(VETTING_BACKOFF, f"metadata from {source} cost the vetting process {strikes} time(s); "
                                            f"its peers are refused for {left:.1f} s more")
        apart = self.strikes.struck(source, now)
        for _ in range(ATTEMPTS):
            child = await self._ready(apart)
            if child.broken is not None:
                return Refusal(VETTING_UNAVAILABLE, f"cannot vet NIXL metadata: {child.broken}")
            if child.ended.is_set() or child.tainted:  # replaced meanwhile
                continue
            pending = await self._ask(child, metadata, digest, source)
            if pending.retry:
                continue
            if pending.killed is not None and pending.hung:
                return Refusal(VETTING_UNAVAILABLE, f"cannot vet NIXL metadata: the vetting process {pending.killed} "
                                                    "(it was replaced; this metadata is vetted again next time)")
            if pending.killed is not None:
                return Refusal(METADATA_UNSAFE, self._unsafe.get(digest, pending.killed))
            if pending.status == LOADED:
                _remember(self._safe, digest, None)
            # LOADED; or NIXL refused it with an error (UCX unpacked what it read without
            # aborting), which the door's own load then reports as today (``nixl_refused``)
            return None
        return Refusal(VETTING_UNAVAILABLE, f"the vetting process died {ATTEMPTS} times under other peers' metadata")

    # -- the child --------------------------------------------------------------------
    def _current(self, apart: bool = False) -> _Child:
        child = self._apart if apart else self._child
        if child is None or child.ended.is_set() or child.tainted:
            child = _Child(apart)
            if apart:
                self._apart = child
            else:
                self._child = child
            self._tg.start_soon(self._supervise, child)
        return child

    def _charge(self, pending: _Pending, how: str, *, escalate: bool = True) -> None:
        """``pending``'s metadata cost its child (``how``): its source backs off (``strikes``);
        not ``escalate``: the network may be to blame (``Strikes.charge``)."""
        strikes, backoff = self.strikes.charge(pending.source, time.monotonic(), escalate=escalate)
        log.warning("vetting.source_charged", source=pending.source, how=how, strikes=strikes, backoff_s=backoff,
                    network=not escalate)

    async def _ask(self, child: _Child, metadata: bytes, digest: bytes, source: str) -> _Pending:
        async with child.turn:
            if child.ended.is_set() or child.tainted:  # replaced while this one waited its turn
                pending = _Pending(digest, retry=True)
                pending.done.set()
                return pending
            rid = next(self._ids)
            pending = child.pending[rid] = _Pending(digest, source, asked=time.monotonic())
            assert child.stream is not None
            try:
                await child.stream.send(REQUEST.pack(rid, len(metadata)) + metadata)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass  # it died: its supervisor resolves every pending request
            # the deadline is the vetter's, not this caller's: a caller given up (its
            # handshake's connect_timeout_s is shorter) still gets a hung child replaced
            self._tg.start_soon(self._load_deadline, child, pending)
            with anyio.move_on_after(2 * self.load_timeout_s):
                await pending.done.wait()
            if not pending.done.is_set():  # killed by the deadline and not reaped yet
                pending.retry = True
        return pending

    async def _load_deadline(self, child: _Child, pending: _Pending) -> None:
        """Kill ``child`` if ``pending`` is not answered within ``load_timeout_s`` (hung in
        NIXL or UCX, or the child stopped): the supervisor then resolves what it held and
        a replacement starts."""
        with anyio.move_on_after(self.load_timeout_s):
            await pending.done.wait()
        if not pending.done.is_set():
            self._kill(child, f"did not load within {self.load_timeout_s:g} s", hung=True)

    def _kill(self, child: _Child, why: str | None = None, *, hung: bool = False) -> None:
        """Kill ``child``; ``why``: charge the load it is on (its first pending) with that."""
        if why is not None and child.pending:
            first = next(iter(child.pending.values()))
            first.killed, first.hung = why, hung
        if child.proc is not None and child.proc.poll() is None:
            child.proc.kill()

    async def _supervise(self, child: _Child) -> None:
        """Run one child: start it, route its replies, and reap it however it ends."""
        self.children_started += 1
        # A ':' no peer's agent name may hold (``checks.AGENT_NAME``): no metadata can name the
        # child's own agent, which NIXL would refuse without unpacking anything.
        agent = f"{self._agent_prefix}:vet-{uuid.uuid4().hex[:12]}"
        ours, theirs = socket.socketpair()
        try:
            # subprocess.Popen, not the event loop's spawn: it starts the child without a
            # plain fork() (vfork where it can), which uvloop's spawn uses and which left every
            # page of this process's memory, the KV pool too, write-protected for copy-on-write:
            # transfers ran slower afterwards (the demo's steady phase at 0.4-0.5 GB/s instead of
            # 1.2-1.5; 10-15 % between two in-process services), and with RDMA-registered memory
            # a fork is worse than slow.
            def spawn() -> subprocess.Popen[bytes]:
                # the NIXL build this process loaded (at once in a service: its door has), so
                # that the child runs the same UCX
                config = json.dumps({"agent": agent, "ucx_env": self._ucx_env, "nixl": nixl_build()})
                return subprocess.Popen([sys.executable, "-P", CHILD, config, str(theirs.fileno())],
                                        stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))

            with anyio.CancelScope(shield=True):  # a child spawned is a child reaped
                proc = await anyio.to_thread.run_sync(spawn)
                child.proc = proc
        except OSError as exc:
            ours.close()
            child.broken = self.last_broken = f"cannot start the vetting process: {exc}"
            child.ready.set()
            child.ended.set()
            return
        finally:
            theirs.close()
        closing = False
        try:
            ours.setblocking(False)
            child.stream = await anyio.abc.SocketStream.from_socket(ours)
            replies = BufferedByteReceiveStream(child.stream)
            while True:
                rid, status, n = REPLY.unpack(await replies.receive_exactly(REPLY.size))
                message = (await replies.receive_exactly(n)).decode(errors="replace")
                if status == READY:
                    child.ready.set()
                    log.debug("vetting.started", pid=proc.pid)
                elif status == BROKEN:
                    child.broken = f"the vetting process could not create a NIXL agent: {message}"
                    break
                elif (pending := child.pending.pop(rid, None)) is not None:
                    if child.tainted:
                        pending.retry = True
                    else:
                        pending.status = status
                        if status != LOADED:
                            child.tainted = True
                            self._kill(child)
                            # NIXL refuses a peer it cannot connect to as well as bytes it
                            # will not take (a connect cut off failed after 3.07 s here)
                            took = time.monotonic() - pending.asked
                            self._charge(pending, f"tainted it after {took:.2f} s: {message}", escalate=False)
                    pending.done.set()
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError,
                OSError):
            pass
        except anyio.get_cancelled_exc_class():
            closing = True  # the service ends: whatever was loading is not to blame
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._reap(proc, child.stream or ours)
            self._ended(child, _death(proc.returncode), closing)

    def _ended(self, child: _Child, death: str, closing: bool) -> None:
        if child.broken is None and not child.ready.is_set():
            child.broken = f"the vetting process {death} before it was ready"
        for i, pending in enumerate(child.pending.values()):
            if i == 0 and not closing and not child.tainted:
                how = pending.killed or f"{death} loading it"
                pending.killed = how
                if not pending.hung:  # a crash is the metadata's doing; a hang may not be
                    _remember(self._unsafe, pending.digest,
                              f"NIXL metadata that UCX cannot unpack: the vetting process {how}")
                log.warning("vetting.child_died", pid=child.proc.pid if child.proc else None, how=how,
                            source=pending.source, apart=child.apart, hung=pending.hung)
                self._charge(pending, how, escalate=not pending.hung)
            else:
                pending.retry = True
            pending.done.set()
        child.pending.clear()
        served = child.broken is None and child.ready.is_set()
        if child.broken is not None:
            self.last_broken = child.broken
        child.ready.set()
        child.ended.set()
        if self._child is child:
            self._child = None
        if self._apart is child:
            self._apart = None
        if served and not child.apart and not closing and not self._tg.cancel_scope.cancel_called:
            self.start()  # its replacement boots now, not in the next peer's handshake
            # (the second lane's is started only when a source that needs it comes back)

    @staticmethod
    async def _reap(proc: subprocess.Popen[bytes], stream: anyio.abc.SocketStream | socket.socket) -> None:
        """Close the child's socket (it exits when that closes), give it a second, then kill
        it; and wait for it, so that no zombie is left."""
        if isinstance(stream, socket.socket):
            stream.close()
        else:
            await stream.aclose()
        for _ in range(100):
            if proc.poll() is not None:
                return
            await anyio.sleep(0.01)
        proc.kill()
        await anyio.to_thread.run_sync(proc.wait)


def _death(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


V = TypeVar("V")


def _remember(table: collections.OrderedDict[bytes, V], digest: bytes, value: V) -> None:
    table[digest] = value
    table.move_to_end(digest)
    while len(table) > REMEMBERED:
        table.popitem(last=False)
