"""A scripted, in-process fake of the ``Door`` protocol: kvservice without NIXL.

``TransferService(config, door_factory=fabric.factory)`` runs the whole service (its
request state machines, watchdog and real TCP control plane) with NIXL replaced by
this fake, so a test needs no GPU, no UCX and no second process, and can script the
failures NIXL would report.

Several ``FakeDoor``s share one ``FakeFabric``: a ``post`` from door A copies
the bytes named by the descriptor tables (A's own table from ``register``, or
the one ``add_peer`` gave for B; B's from ``add_peer``) out of A's registered
memory into B's (one address space: a ``memmove``),
then appends the notification to B's inbox, which B's ``notifs()`` drains.  So
a unit test sees real bytes land in the right pages, and a wrong descriptor
computed by the service shows up as wrong bytes or a recorded violation.

Scripting (from the test, on the event loop thread; the door thread reads it
under the fabric lock):

* ``fail_next_post`` / ``fail_next_check`` / ``fail_next_add_peer``: the next
  such call raises ``DoorError(reason, original)``; a failed check releases
  the handle, as the real door does.
* ``complete_immediately()`` (the default), ``complete_after(n)`` (DONE on the
  n-th check), ``hang()`` (PROC for ever, like a SIGSTOPped peer);
  ``finish_hung()`` lets hung transfers complete on their next check.
* ``post_delay``: each post sleeps that long on the door thread;
  ``post_probe`` is sampled before and after each post.

Bookkeeping: every release of every transfer id is counted.  The fake is
deliberately *not* forgiving the way the real door is: a ``check`` or
``release`` of an id never posted is recorded as a violation; a repeated
``release`` of a released id is allowed by the ``Door`` contract (idempotent,
answered ``False``) and counted in ``redundant_releases``; a ``check`` of a
released id is a violation, which proves the service never even tries it.
"""

from __future__ import annotations

import collections
import ctypes
import enum
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .._config import ServiceConfig
from .._nixl.door import DoorError, LocalTable, XferId, XferState
from .._results import FailureReason


class Mode(enum.Enum):
    IMMEDIATE = "immediate"  # post returns DONE: data and notif delivered at once
    AFTER_CHECKS = "after_checks"  # PROC until the n-th check
    HANG = "hang"  # PROC for ever (until finish_hung)


@dataclass(slots=True)
class PostRecord:
    """One call of ``post``, as the service made it."""

    xid: XferId | None  # None when the post raised
    peer: str
    local_idx: npt.NDArray[np.int32]
    remote_idx: npt.NDArray[np.int32]
    notif: bytes
    probe: tuple[int, int] | None = None  # post_probe() before and after the post
    round: int = 0  # which notifs() round (= watchdog tick) the post belongs to


@dataclass(slots=True)
class _Xfer:
    xid: XferId
    peer: str
    local_idx: npt.NDArray[np.int32]
    remote_idx: npt.NDArray[np.int32]
    notif: bytes
    checks_left: int | None  # None: hung
    tables: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]  # (local, remote) when posted
    landed: bool = False  # its bytes and notif are in (a later WRITE's flush took it): DONE when checked


@dataclass(slots=True)
class _Pool:
    """What ``register`` registered: the segments (address, bytes, device) and the table."""

    segments: list[tuple[int, int, int]]
    table: npt.NDArray[np.uint64]

    @property
    def data(self) -> list[npt.NDArray[np.uint8]]:
        """Each segment's bytes (sharing memory with the registered tensors)."""
        return [np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(a)) for a, n, _ in self.segments]


def copy(src: npt.NDArray[np.uint64], dst: npt.NDArray[np.uint64], local_idx: Iterable[int],
         remote_idx: Iterable[int]) -> None:
    """Copy each paired descriptor's bytes (one address space, as every fake door shares)."""
    for li, ri in zip(local_idx, remote_idx, strict=True):
        ctypes.memmove(int(dst[ri, 0]), int(src[li, 0]), int(src[li, 1]))


class FakeFabric:
    """The shared "network" of fake doors in one process."""

    #: what ``factory`` makes (a subclass of ``FakeDoor`` in the simulation)
    door_class: type[FakeDoor]

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._doors: dict[str, FakeDoor] = {}
        self.created: list[FakeDoor] = []

    def factory(self, agent_name: str, config: ServiceConfig) -> FakeDoor:
        """``TransferService(door_factory=fabric.factory)``; runs on the door thread."""
        door = self.door_class(self, agent_name)
        with self.lock:
            if agent_name in self._doors:
                raise ValueError(f"agent {agent_name!r} exists already")
            self._doors[agent_name] = door
            self.created.append(door)
        return door

    def door(self, agent_name: str) -> FakeDoor:
        with self.lock:
            for door in self.created:
                if door.agent_name == agent_name:
                    return door
        raise KeyError(agent_name)

    def lookup(self, agent_name: str) -> FakeDoor | None:
        """The live (not closed) door of that name."""
        with self.lock:
            return self._doors.get(agent_name)

    def unregister(self, door: FakeDoor) -> None:
        with self.lock:
            if self._doors.get(door.agent_name) is door:
                del self._doors[door.agent_name]

    def violations(self, kind: str = "") -> list[str]:
        """Every violation recorded by any door; ``kind`` ("check", "release", "post") filters."""
        with self.lock:
            return [v for door in self.created for v in door.violations if v.startswith(kind)]

    def assert_clean(self) -> None:
        """No violations, no live handle, and every posted id released exactly once
        (at the NIXL level; idempotent extra ``release()`` calls are allowed)."""
        with self.lock:
            problems = self.violations()
            for door in self.created:
                if door.live_xfers():
                    problems.append(f"{door.agent_name}: {door.live_xfers()} live handles")
                for xid in door.posted_ids():
                    n = door.release_counts[xid]
                    if n != 1:
                        problems.append(f"{door.agent_name}: xfer {xid} released {n} times")
        assert not problems, problems


class FakeDoor:
    """``Door`` over a ``FakeFabric``.  Every method is meant for the door thread."""

    def __init__(self, fabric: FakeFabric, agent_name: str) -> None:
        self.agent_name = agent_name
        self._fabric = fabric
        self._lock = fabric.lock
        self._pool: _Pool | None = None
        self._peers: dict[str, npt.NDArray[np.uint64]] = {}
        #: peers removed with ``keep_loaded`` and not loaded again or forgotten since: what the
        #: real door would keep (this one unloads them all the same)
        self._kept: set[str] = set()
        self._locals: dict[str, npt.NDArray[np.uint64]] = {}  # peers with a local table of their own
        self._live: dict[XferId, _Xfer] = {}
        self._inbox: dict[str, list[bytes]] = collections.defaultdict(list)
        self._next_id = 1
        self._round = 0
        self._closed = False
        # -- script --------------------------------------------------------------------
        self._post_errors: collections.deque[DoorError] = collections.deque()
        self._check_errors: collections.deque[DoorError] = collections.deque()
        self._add_peer_errors: collections.deque[DoorError] = collections.deque()
        self._mode = Mode.IMMEDIATE
        self._after = 1
        self.post_delay = 0.0
        #: op name -> event the door thread waits for before doing that op ("add_peer",
        #: "remove_peer"); ``arrived[op]`` is set when it starts waiting
        self.gates: dict[str, threading.Event] = {}
        self.arrived: dict[str, threading.Event] = collections.defaultdict(threading.Event)
        self.post_probe: Callable[[], int] | None = None
        # -- records ---------------------------------------------------------------------
        self.posts: list[PostRecord] = []
        self.release_counts: collections.Counter[XferId] = collections.Counter()
        self.redundant_releases: collections.Counter[XferId] = collections.Counter()
        self.check_counts: collections.Counter[XferId] = collections.Counter()
        self.violations: list[str] = []
        self.threads: set[int] = {threading.get_ident()}
        self.peers_added: list[str] = []
        self.peers_removed: list[str] = []

    # -- scripting (any thread) --------------------------------------------------------------
    def fail_next_post(self, reason: FailureReason, original: BaseException) -> DoorError:
        err = DoorError(reason, original, "make_prepped_xfer")
        with self._lock:
            self._post_errors.append(err)
        return err

    def fail_next_check(self, reason: FailureReason, original: BaseException) -> DoorError:
        err = DoorError(reason, original, "check_xfer_state")
        with self._lock:
            self._check_errors.append(err)
        return err

    def fail_next_add_peer(self, reason: FailureReason, original: BaseException) -> DoorError:
        err = DoorError(reason, original, "add_remote_agent")
        with self._lock:
            self._add_peer_errors.append(err)
        return err

    def complete_immediately(self) -> None:
        with self._lock:
            self._mode = Mode.IMMEDIATE

    def complete_after(self, checks: int) -> None:
        if checks < 1:
            raise ValueError("checks must be >= 1")
        with self._lock:
            self._mode, self._after = Mode.AFTER_CHECKS, checks

    def hang(self) -> None:
        with self._lock:
            self._mode = Mode.HANG

    def finish_hung(self) -> int:
        """Let every hung transfer complete on its next check; returns how many."""
        with self._lock:
            hung = [x for x in self._live.values() if x.checks_left is None]
            for x in hung:
                x.checks_left = 1
            return len(hung)

    # -- observations (any thread) -------------------------------------------------------------
    def loaded_peers(self) -> list[str]:
        with self._lock:
            return sorted(self._peers)

    def posted_ids(self) -> list[XferId]:
        with self._lock:
            return [p.xid for p in self.posts if p.xid is not None]

    def post_count(self) -> int:
        with self._lock:
            return len(self.posts)

    def live_ids(self) -> list[XferId]:
        with self._lock:
            return list(self._live)

    @property
    def rounds(self) -> int:
        """How many times ``notifs()`` ran: once per watchdog tick."""
        with self._lock:
            return self._round

    def max_posts_per_round(self) -> int:
        with self._lock:
            per = collections.Counter(p.round for p in self.posts)
            return max(per.values(), default=0)

    # -- Door -------------------------------------------------------------------------
    def _enter(self) -> None:
        self.threads.add(threading.get_ident())

    def metadata(self) -> bytes:
        self._enter()
        return b"fake-md:" + self.agent_name.encode()

    def metadata_agent(self, metadata: bytes) -> str | None:
        prefix = b"fake-md:"
        return metadata[len(prefix):].decode(errors="replace") if metadata.startswith(prefix) else None

    def register(self, segments: Sequence[tuple[int, int, int]], mem_type: str,
                 table: npt.NDArray[np.uint64]) -> None:
        self._enter()
        if mem_type != "DRAM":
            raise ValueError(f"the fake door moves CPU memory only, got {mem_type}")
        pool = _Pool(list(segments), table)
        self._check_table(table, pool, "register")
        with self._lock:
            self._pool = pool

    def _check_table(self, table: npt.NDArray[np.uint64], pool: _Pool, op: str) -> None:
        if table.ndim != 2 or table.shape[1] != 3 or table.dtype != np.uint64:
            raise ValueError(f"{op}: table must be N x 3 uint64, got {table.shape} {table.dtype}")
        inside = np.zeros(len(table), dtype=bool)
        for base, nbytes, _ in pool.segments:
            inside |= (table[:, 0] >= base) & (table[:, 0] + table[:, 1] <= base + nbytes)
        if not inside.all():
            bad = table[~inside][0]
            raise ValueError(f"{op}: descriptor {int(bad[0]):#x}+{int(bad[1])} lies outside the registered memory")

    def _gate(self, op: str) -> None:
        gate = self.gates.get(op)
        if gate is not None:
            self.arrived[op].set()
            if not gate.wait(10.0):
                self.violations.append(f"{op}: gate never opened")

    def add_peer(self, name: str, metadata: bytes, table: npt.NDArray[np.uint64],
                 local: LocalTable | None = None) -> None:
        self._enter()
        self._gate("add_peer")
        with self._lock:
            if self._add_peer_errors:
                raise self._add_peer_errors.popleft()
        if name in self._peers:
            self.remove_peer(name)
        if metadata != b"fake-md:" + name.encode():
            raise DoorError(FailureReason.INCOMPATIBLE, ValueError(f"metadata is not {name!r}'s"),
                            "add_remote_agent")
        target = self._fabric.lookup(name)
        if target is None or target._pool is None:
            raise DoorError(FailureReason.BACKEND, ConnectionRefusedError(f"no agent {name!r}"),
                            "add_remote_agent")
        self._check_table(table, target._pool, "add_peer")
        if local is not None:
            assert self._pool is not None
            self._check_table(local[1], self._pool, "add_peer (local)")
        with self._lock:
            self._peers[name] = table
            self._kept.discard(name)
            if local is not None:
                self._locals[name] = local[1]
            else:
                self._locals.pop(name, None)
            self.peers_added.append(name)

    def remove_peer(self, name: str, *, keep_loaded: bool = False) -> list[XferId]:
        """(The fake always unloads: loading it again replaces it, as the real door does
        when the metadata differs.  What the real door would keep is recorded: ``kept``.)"""
        self._enter()
        self._gate("remove_peer")
        with self._lock:
            released = [xid for xid, x in self._live.items() if x.peer == name]
            for xid in released:
                self._release_live(xid)
            if self._peers.pop(name, None) is not None:
                self.peers_removed.append(name)
                if keep_loaded:
                    self._kept.add(name)
                else:
                    self._kept.discard(name)
            return released

    def forget_peer(self, name: str) -> None:
        self._enter()
        with self._lock:
            self._kept.discard(name)

    def kept(self, name: str) -> bool:
        self._enter()
        with self._lock:
            return name in self._kept

    def post(
        self, peer: str, local_idx: npt.NDArray[np.int32], remote_idx: npt.NDArray[np.int32],
        notif: bytes,
    ) -> tuple[XferId, XferState]:
        self._enter()
        before = self.post_probe() if self.post_probe else None
        if self.post_delay:
            time.sleep(self.post_delay)  # the door thread is busy, as in a real blocking post
        after = self.post_probe() if self.post_probe else None
        probe = None if before is None or after is None else (before, after)
        with self._lock:
            record = PostRecord(None, peer, local_idx.copy(), remote_idx.copy(), notif, probe, self._round)
            self.posts.append(record)
            if self._post_errors:
                raise self._post_errors.popleft()
            if peer not in self._peers:
                raise DoorError(FailureReason.PEER_LOST, KeyError(f"peer {peer!r} not loaded"),
                                "make_prepped_xfer")
            self._validate(peer, local_idx, remote_idx)
            xid = self._next_id
            self._next_id += 1
            record.xid = xid
            checks = None if self._mode is Mode.HANG else self._after
            xfer = _Xfer(xid, peer, record.local_idx, record.remote_idx, notif, checks,
                         (self._local_table(peer), self._peers[peer]))
            self._live[xid] = xfer
            if self._mode is Mode.IMMEDIATE:
                self._complete(xfer)  # releases, as the real door does on DONE
                return xid, XferState.DONE
            return xid, XferState.PROC

    def _local_table(self, peer: str) -> npt.NDArray[np.uint64]:
        assert self._pool is not None
        return self._locals.get(peer, self._pool.table)

    def _validate(self, peer: str, local_idx: npt.NDArray[np.int32], remote_idx: npt.NDArray[np.int32]) -> None:
        assert self._pool is not None
        problem = None
        if local_idx.dtype != np.int32 or remote_idx.dtype != np.int32:
            problem = f"index dtypes {local_idx.dtype}/{remote_idx.dtype}, want int32"
        elif local_idx.ndim != 1 or local_idx.shape != remote_idx.shape or local_idx.size == 0:
            problem = f"index shapes {local_idx.shape}/{remote_idx.shape}"
        elif local_idx.min() < 0 or local_idx.max() >= len(self._local_table(peer)):
            problem = "local index out of the local table"
        elif remote_idx.min() < 0 or remote_idx.max() >= len(self._peers[peer]):
            problem = "remote index out of the peer's table"
        elif not np.array_equal(self._local_table(peer)[local_idx, 1], self._peers[peer][remote_idx, 1]):
            problem = "paired descriptors differ in length"
        if problem is not None:
            self.violations.append(f"post(to {peer}): {problem}")
            raise DoorError(FailureReason.BACKEND, ValueError(problem), "make_prepped_xfer")

    def _complete(self, xfer: _Xfer) -> None:
        """Copy the bytes into the peer's pool, deliver the notif, release.  Lock held."""
        assert self._pool is not None
        target = self._fabric.lookup(xfer.peer)
        if target is None or target._pool is None:
            self._release_live(xfer.xid)
            raise DoorError(FailureReason.REMOTE_DISCONNECT,
                            ConnectionResetError(f"{xfer.peer} is gone"), "check_xfer_state")
        if not xfer.landed:
            copy(*xfer.tables, xfer.local_idx.tolist(), xfer.remote_idx.tolist())
            target._inbox[self.agent_name].append(xfer.notif)
        self._release_live(xfer.xid)

    def _release_live(self, xid: XferId) -> None:
        del self._live[xid]
        self.release_counts[xid] += 1

    def check(self, xfer: XferId) -> XferState:
        self._enter()
        with self._lock:
            x = self._live.get(xfer)
            if x is None:
                what = "after release" if self.release_counts[xfer] else "of an id never posted"
                self.violations.append(f"check({xfer}) {what}")
                return XferState.GONE
            self.check_counts[xfer] += 1
            if self._check_errors and not x.landed:  # (one that landed has completed: DONE)
                err = self._check_errors.popleft()
                self._release_live(xfer)
                raise err
            if x.checks_left is None:
                return XferState.PROC
            x.checks_left -= 1
            if x.checks_left > 0:
                return XferState.PROC
            self._complete(x)
            return XferState.DONE

    def release(self, xfer: XferId) -> bool:
        self._gate("release")
        self._enter()
        with self._lock:
            if xfer in self._live:
                self._release_live(xfer)
                return True
            if self.release_counts[xfer]:
                # Allowed by the Door contract: release() is idempotent and answers
                # False for a gone id.  What must hold is that the *NIXL* release
                # (``_release_live``) ran once: ``release_counts`` counts only that.
                self.redundant_releases[xfer] += 1
            else:
                self.violations.append(f"release({xfer}): release of an id never posted")
            return False

    def notifs(self) -> Mapping[str, list[bytes]]:
        self._enter()
        with self._lock:
            self._round += 1
            got = {k: v for k, v in self._inbox.items() if v}
            self._inbox.clear()
            return got

    def send_notif(self, peer: str, message: bytes) -> None:
        self._enter()
        with self._lock:
            target = self._fabric.lookup(peer)
            if peer not in self._peers or target is None:
                raise DoorError(FailureReason.REMOTE_DISCONNECT, ConnectionResetError(peer), "send_notif")
            target._inbox[self.agent_name].append(message)

    def inject_notif(self, sender: str, message: bytes) -> None:
        """Deliver ``message`` to this door as if ``sender`` had sent it (any thread)."""
        with self._lock:
            self._inbox[sender].append(message)

    def live_xfers(self) -> int:
        with self._lock:
            return len(self._live)

    def close(self) -> None:
        self._enter()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for xid in list(self._live):
                self._release_live(xid)
            self._peers.clear()
        self._fabric.unregister(self)

    @property
    def closed(self) -> bool:
        return self._closed


FakeFabric.door_class = FakeDoor
