"""Per-request state on each side, and the public ``TransferHandle``."""

from __future__ import annotations

import abc
import asyncio
import collections
import time
from collections.abc import Iterator, ValuesView
from dataclasses import dataclass
from typing import Generic, NoReturn, Protocol, TypeVar

from .._nixl.door import XferId
from .._results import (
    FailureReason,
    KVPoll,
    TransferResult,
    TransferStatus,
)
from ..memory._layout import PageIndex
from ..memory._pairing import PeerKV
from .landing import Landing


class DoneEvent(Protocol):
    """Set once a request has a result (the request itself in-process, an ``anyio.Event``
    in the sidecar client)."""

    def is_set(self) -> bool: ...

    async def wait(self) -> object: ...


class _Waiter(asyncio.Future[TransferResult]):
    """The future one task waits on for a request's result, and its own iterator for
    ``await``: what a plain future's ``await`` makes besides it (a ``FutureIter``, one
    more object the cyclic GC walks per waiting request) does not exist.  Awaiting it
    behaves as awaiting a plain future: it yields itself to the task until done, then
    returns its result (or raises what it holds, ``CancelledError`` once cancelled)."""

    __slots__ = ()

    def __await__(self) -> _Waiter:  # type: ignore[override]
        return self

    __iter__ = __await__  # type: ignore[assignment]

    def __next__(self) -> _Waiter:
        if not self.done():
            self._asyncio_future_blocking = True
            return self
        raise StopIteration(self.result())


@dataclass(eq=False, slots=True)
class _Request:
    """A request is its own done event (``req.done.set()``, ``await req.done.wait()``,
    a ``DoneEvent``): no event object per request, and a future only while a task
    waits for it (one per waiter; cancelling one waiter disturbs no other).  The
    cyclic GC walks every object each live request holds, thousands of requests
    at a time: what is not allocated costs nothing there (``kvservice bench``'s gc
    column, ``python -m benchmarks.gc_probe``)."""

    request_id: str
    created: float
    deadline: float
    result: TransferResult | None = None
    started_at: float | None = None
    done_set: bool = False
    #: futures of the tasks waiting for it; one cancelled while awaited straight from
    #: ``until_done`` stays until the next waiter comes or the request is done (no
    #: cleanup callback or frame per wait)
    waiters: asyncio.Future[TransferResult] | list[asyncio.Future[TransferResult]] | None = None

    @property
    def done(self) -> _Request:
        """This request, as its done event."""
        return self

    def is_set(self) -> bool:
        return self.done_set

    def set(self) -> None:
        if self.done_set:
            return
        self.done_set = True
        waiters, self.waiters = self.waiters, None
        if waiters is None:
            return
        result = self.result
        assert result is not None, "a request is done only once it has a result"
        for future in waiters if isinstance(waiters, list) else (waiters,):
            if not future.done():
                future.set_result(result)

    def until_done(self) -> asyncio.Future[TransferResult]:
        """A future that ends with the result once the request is done: awaited directly
        by the caller's coroutine, so a waiting task holds no coroutine of ours (the
        object per waiting request is that future, its own iterator: ``_Waiter``)."""
        future: asyncio.Future[TransferResult] = _Waiter(loop=asyncio.get_running_loop())
        if self.done_set:
            assert self.result is not None
            future.set_result(self.result)
            return future
        waiters = self.waiters
        if waiters is None or (not isinstance(waiters, list) and waiters.done()):
            self.waiters = future
        elif isinstance(waiters, list):
            waiters[:] = [f for f in waiters if not f.done()]  # a cancelled waiter's future goes now
            waiters.append(future)
        else:
            self.waiters = [waiters, future]
        return future

    async def wait(self) -> None:
        if self.done_set:
            return
        future = self.until_done()
        try:
            await future
        finally:
            if future.cancelled():  # this coroutine cleans up after itself at once
                self._drop_waiter(future)

    def _drop_waiter(self, future: asyncio.Future[TransferResult]) -> None:
        waiters = self.waiters
        if waiters is future:
            self.waiters = None
        elif isinstance(waiters, list) and future in waiters:
            waiters.remove(future)

    @property
    def finished(self) -> bool:
        return self.result is not None


#: pages ``src`` of layers ``lo:hi``, going to the request's destination pages from
#: position ``pos`` on: ``(src, pos, lo, hi)``.  A plain tuple of an array and ints,
#: which the cyclic GC stops tracking after its first collection (a class instance, even
#: slotted, or a named tuple, it would walk for as long as the chunk is queued).
Chunk = tuple[PageIndex, int, int, int]


@dataclass(eq=False, slots=True)
class SendRequest(_Request):
    """Sender side.  Chunks queue in ``pending`` until the destination is known.

    Positions: each layer has a cursor, the number of the request's pages sent for
    it so far; a chunk of layers ``lo:hi`` goes to the positions from their (equal)
    cursor on, so every (page, layer) is sent exactly once.  While every layer's
    cursor is the same (the common case: whole pages), ``cursors`` is None and
    ``pages_queued`` is that cursor."""

    bootstrap_deadline: float = 0.0
    receiver: str | None = None  # canonical address the request is pinned to (send(receiver=))
    member: str | None = None  # the discovery member whose registered address ``receiver`` is (named so)
    peer: str | None = None  # destination agent, once the receiver's Expect arrived
    peer_address: str | None = None  # where that agent is (proven, else as it advertises itself): for messages
    kv: PeerKV | None = None  # the receiver's memory, paired with ours
    dest: PageIndex | None = None
    #: chunks not posted yet, oldest first (None when there are none); a tuple, not a
    #: deque: a request has a few chunks (one per layer at most), and a tuple of chunks
    #: is no object for the cyclic GC to walk once it has been through a collection
    pending: tuple[Chunk, ...] | None = None
    pages_queued: int = 0  # positions the engine has sent some layer of (the largest cursor)
    cursors: list[int] | None = None  # per layer, when they differ (layer-wise sends)
    payload: bytes | None = None  # delivered with the last chunk
    offset: int = 0  # destination pages already assigned to posted chunks
    chunks_posted: int = 0
    chunks_done: int = 0
    last: bool = False
    fit_tail: bool = False  # send(fit="tail"): its one chunk shrinks to the receiver's pages (``fit_tail``)
    inflight: set[XferId] | None = None  # handles in flight (None: none, no set held)
    posting: int = 0  # chunks on the door thread, outcome not back yet
    releasing: int = 0  # handles drained with its receiver's lost link, not ended or let go yet
    let_go: int = 0  # handles it ended with while in flight, checked until they end (``drain``)
    tell_after_let_go: bool = False  # its receiver is told it may settle once those ended
    timeout: float | None = None  # the caller's send(timeout=), counted from the bind
    fence_src: Chunk | None = None  # the first chunk posted: its first page of its first layer is the settle fence
    posted: bool = False  # some post of it returned a handle: a WRITE may exist
    fences: int = 0  # settle fences posted
    outcome_due: float | None = None  # told the receiver Failed: since when its Outcome is awaited
    link_generation: int | None = None  # of the link to ``peer`` when it was bound
    notif_key: bytes = b""  # that link's key for our notifications' MACs
    bytes_done: int = 0
    verify: bool = False  # its receiver asked for landing checks: each chunk's notification carries a sum

    @classmethod
    def ended(cls, result: TransferResult) -> SendRequest:
        """A stand-in for a request that ended before: only its result is kept."""
        req = cls(request_id=result.request_id, created=result.created_at, deadline=0.0, result=result)
        req.done.set()
        return req

    def due_at(self) -> float:
        return self.bootstrap_deadline if self.peer is None else self.deadline

    @property
    def complete(self) -> bool:
        return (
            self.last and not self.pending and self.posting == 0 and not self.inflight
            and self.chunks_done == self.chunks_posted
        )

    def poll(self) -> KVPoll:
        if self.result is not None:
            return self.result.poll
        if self.peer is None:
            return KVPoll.Bootstrapping
        if self.inflight or self.posting or self.pending:
            return KVPoll.Transferring
        return KVPoll.WaitingForInput


@dataclass(eq=False, slots=True)
class RecvRequest(_Request):
    """Receiver side: waits for every chunk's notification from ``sender``."""

    sender: str = ""  # the sender's control address
    peer: str | None = None  # the sender's agent, once linked
    pages: PageIndex | None = None
    chunks_seen: int = 0
    total_chunks: int | None = None
    #: the sender's settle fence arrived before its failure did (the control link is slower)
    fenced: bool = False
    payload: bytes | None = None  # the sender's, from the last chunk's notification
    verify: bool = False  # landing checks asked (``_transfer.landing``)
    landing: Landing | None = None  # their sums, as the chunks' notifications bring them
    #: held without polling NIXL for it: its sender (protocol 7) says when it posts (``Posted``)
    cold: bool = False
    #: its sender said ``Posted``: a repeated word polls nothing more finely (``Inbound._on_posted``)
    posted: bool = False

    def due_at(self) -> float:
        return self.deadline

    def poll(self) -> KVPoll:
        if self.result is not None:
            return self.result.poll
        if self.peer is None:
            return KVPoll.Bootstrapping
        return KVPoll.Transferring if self.chunks_seen else KVPoll.WaitingForInput


def place(pages_queued: int, cursors: list[int] | None, npages: int, lo: int, hi: int,
          layers: int) -> tuple[int, list[int] | None, int]:
    """Where a request's next ``npages`` pages of layers ``lo:hi`` go (``SendRequest``'s
    positions): their position, the cursors after them (None: all equal) and the largest
    cursor.  Raises ``ValueError`` when those layers have been sent up to different pages."""
    if cursors is None:
        if lo == 0 and hi == layers:
            return pages_queued, None, pages_queued + npages
        cursors = [pages_queued] * layers
    else:
        cursors = list(cursors)
    pos = cursors[lo]
    if any(c != pos for c in cursors[lo:hi]):
        raise ValueError(f"layers {lo}..{hi - 1} have been sent up to different pages "
                         f"({cursors[lo:hi]}); send them in separate calls")
    for layer in range(lo, hi):
        cursors[layer] += npages
    top = max(cursors)
    return pos, (None if min(cursors) == top else cursors), top


def peer_of(req: _Request) -> str | None:
    """Who a request is with, as its result names it: a receiver's sender address (always
    known); a sender's receiver address when ``send(receiver=)`` pinned it, else the address
    of the agent its receiver's expect came from once bound (its name when no address is
    known); ``None`` before that."""
    if isinstance(req, RecvRequest):
        return req.sender or req.peer
    if isinstance(req, SendRequest):
        return req.receiver or req.peer_address or req.peer
    return None


def fit_tail(req: SendRequest, n: int) -> None:
    """Keep the last ``n`` pages of ``req``'s one chunk (``send(fit="tail")``): its receiver
    reserved fewer pages than the sender holds, because it had the first ones already (a
    decode's prefix cache).  Only before anything of ``req`` is posted."""
    assert req.pending is not None and len(req.pending) == 1 and req.chunks_posted == 0 and 0 < n
    src, _, lo, hi = req.pending[0]
    req.pending = ((src[src.size - n:], 0, lo, hi),)
    req.pages_queued = n


def make_result(
    req: _Request, status: TransferStatus, *, reason: FailureReason | None = None,
    error: BaseException | None = None, message: str = "", nbytes: int = 0, pages: int = 0,
    payload: bytes | None = None,
) -> TransferResult:
    return TransferResult(
        request_id=req.request_id, status=status, reason=reason, error=error, message=message,
        peer=peer_of(req), bytes=nbytes, pages=pages, created_at=req.created, started_at=req.started_at,
        finished_at=time.monotonic(), settled=status is TransferStatus.SUCCESS, payload=payload,
    )


def check_request_id(request_id: str) -> None:
    if not isinstance(request_id, str) or not 0 < len(request_id) <= 256:
        raise ValueError(f"request_id must be a str of 1..256 characters, got {request_id!r}")


class HandleBase(abc.ABC):
    """The sending side's view of one request: ``TransferHandle`` in-process and
    the sidecar client's handle share this behaviour.

    ``poll()`` never blocks.  ``failure_exception()`` raises ``TransferFailed`` for a
    failed request, naming the request, the reason and the peer; the original error
    (the very NIXL exception instance when NIXL raised one) is its ``__cause__``.
    """

    __slots__ = ()

    @property
    @abc.abstractmethod
    def request_id(self) -> str: ...

    @property
    @abc.abstractmethod
    def result(self) -> TransferResult | None: ...

    @abc.abstractmethod
    def _pending_poll(self) -> KVPoll:
        """The state while no result exists yet."""

    @abc.abstractmethod
    def _done(self) -> DoneEvent:
        """Set when the result exists."""

    def poll(self) -> KVPoll:
        result = self.result
        return self._pending_poll() if result is None else result.poll

    def failure_exception(self) -> NoReturn:
        result = self.result
        if result is None or result.ok:
            raise RuntimeError(f"request {self.request_id!r} has not failed (poll={self.poll().name})")
        result.raise_for_failure()
        raise AssertionError("unreachable: a failed result always raises")

    async def wait(self) -> TransferResult:
        await self._done().wait()
        result = self.result
        assert result is not None
        return result

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.request_id!r}, {self.poll().name})"


class TransferHandle(HandleBase):
    """What ``TransferService.send()`` returns for a request (every chunk's call
    returns the same request's handle)."""

    __slots__ = ("_req",)

    def __init__(self, req: SendRequest) -> None:
        self._req = req

    @property
    def request_id(self) -> str:
        return self._req.request_id

    @property
    def result(self) -> TransferResult | None:
        return self._req.result

    def _pending_poll(self) -> KVPoll:
        return self._req.poll()

    def _done(self) -> DoneEvent:
        return self._req.done


K = TypeVar("K")
V = TypeVar("V")


class Recent(Generic[K, V]):
    """A bounded insertion-ordered map: the oldest entries fall out."""

    def __init__(self, capacity: int) -> None:
        self._cap = capacity
        self._d: collections.OrderedDict[K, V] = collections.OrderedDict()

    def put(self, key: K, value: V) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self._cap:
            self._d.popitem(last=False)

    def get(self, key: K) -> V | None:
        return self._d.get(key)

    def pop(self, key: K) -> V | None:
        return self._d.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def __iter__(self) -> Iterator[K]:
        """The keys, oldest first."""
        return iter(self._d)

    def values(self) -> ValuesView[V]:
        return self._d.values()
