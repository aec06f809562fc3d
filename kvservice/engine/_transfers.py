"""``KVSender`` and ``KVReceiver``: one request's transfer as a synchronous scheduler sees it.

Two threads touch these objects.  The scheduler's thread calls ``init``, ``send``,
``poll``, ``abort`` and ``clear``; the engine's loop thread runs the service calls
those queue and publishes how the request ended.  The rules that keep that safe:

* ``poll()`` never waits on the loop.  The end of a request (``result``) is
  published by the loop thread in one attribute store, under the engine's
  ``_transfer_lock`` (one for all its transfers: each holds it for a few stores), first end
  wins: once ``poll()`` has said ``Success`` or ``Failed`` it never says anything
  else, and ``result`` is there to read.  Before that, the progress states
  (``Bootstrapping`` .. ``Transferring``) are read from the service's own
  non-blocking ``poll`` (attribute reads the GIL keeps whole) and never go back.
* Calls that need the service (``send``, ``init``, ``abort``) only queue an
  operation: one runner task per request on the loop thread performs them in the
  order they were made, so chunk *k* is always sent before chunk *k+1*.
* Nothing the service raises leaves the loop thread: an error of a queued call
  ends the request ``Failed`` (see ``_call_failure``), and ``failure_exception()``
  raises ``TransferFailed`` naming the reason and the peer, the service's own
  exception as its ``__cause__``.  Only misuse of the facade object itself
  (``send`` after ``last``, after ``clear``; ``init`` twice) raises at the call.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NoReturn, Protocol

import numpy as np
import numpy.typing as npt

from .._results import (
    FailureReason,
    KVPoll,
    KVServiceError,
    Overloaded,
    TransferResult,
    TransferStatus,
)

if TYPE_CHECKING:
    from .._service import TransferService


class Host(Protocol):
    """What a transfer needs of the engine that made it (``KVTransferEngine``): the
    engine knows its transfers, they do not know the engine's type."""

    _transfer_lock: threading.Lock

    def _spawn(self, fn: Callable[[TransferService], Awaitable[None]]) -> bool: ...
    def _watch(self, future: asyncio.Future[TransferResult], transfer: _Transfer) -> None: ...
    def _unwatch(self) -> None: ...
    def _poll_arrival(self, request_id: str) -> KVPoll | None: ...
    def _forget(self, transfer: _Transfer) -> None: ...
    def _ended(self) -> None: ...

Pages = Sequence[int] | npt.NDArray[Any]
Op = Callable[["TransferService"], Awaitable[None]]

_TERMINAL = (KVPoll.Success, KVPoll.Failed)


def _call_failure(exc: BaseException) -> tuple[FailureReason, str]:
    """The reason a request fails with when the service refused a call made for it.

    ``KVServiceError`` itself (not a subclass) is what a service that is shutting down
    or stopped raises; ``Overloaded`` is a bound; anything else (``ValueError`` for
    pages out of range, more pages than the receiver expects, a duplicate expect)
    is the service refusing the call as made.  The exception is kept as the
    result's ``error``: ``failure_exception()``'s ``TransferFailed`` has it as ``__cause__``."""
    if type(exc) is KVServiceError:
        return FailureReason.SHUTDOWN, f"the service is not running: {exc}"
    if isinstance(exc, Overloaded):
        return FailureReason.REFUSED, f"the service is at a limit: {exc}"
    return FailureReason.REFUSED, f"the service refused the call: {type(exc).__name__}: {exc}"


def failed(request_id: str, reason: FailureReason, message: str, *, created_at: float = 0.0,
           error: BaseException | None = None, settled: bool = False, peer: str | None = None) -> TransferResult:
    now = time.monotonic()
    return TransferResult(request_id=request_id, status=TransferStatus.FAILED, reason=reason, error=error,
                          message=message, peer=peer, created_at=created_at or now, finished_at=now,
                          settled=settled)


def _copy(pages: Pages) -> Pages:
    """The scheduler may reuse its list once the call returns: keep our own."""
    return pages.copy() if isinstance(pages, np.ndarray) else list(pages)


class _Transfer:
    """What ``KVSender`` and ``KVReceiver`` share: the published end, the op queue, abort, clear."""

    def __init__(self, engine: Host, request_id: str) -> None:
        self._engine = engine
        self.request_id = request_id
        self._created = time.monotonic()
        self._lock = engine._transfer_lock
        self._result: TransferResult | None = None  # how it ended: first end wins
        self._settled = False  # nothing of it can be written any more
        self._progress_seen = KVPoll.Bootstrapping  # the furthest progress state reported
        self._ops: deque[Op] | None = None  # queued for the loop thread (None when none are)
        self._running = False  # a runner task drains _ops on the loop thread
        self._owned = False  # the service holds a request this object created
        self._queued_any = False  # some op was queued for the loop
        self._cleared = False

    # -- read by the scheduler: never waits -----------------------------------------------------
    @property
    def result(self) -> TransferResult | None:
        """How the request ended (published by the loop thread), or ``None`` while it runs."""
        return self._result

    @property
    def settled(self) -> bool:
        """Nothing of this request can be written any more.  On a receiver this is when a
        failed request's pages may be reused (docs/settle.md); a success is settled."""
        return self._settled

    def poll(self) -> KVPoll:
        """``Bootstrapping``, ``WaitingForInput``, ``Transferring``, then ``Success`` or ``Failed``.

        Never blocks and never raises.  The progress states only move forward; once
        this says ``Success`` or ``Failed`` it says so for good and ``result`` is set."""
        result = self._result
        if result is not None:
            return result.poll
        try:
            state = self._service_poll()
        except Exception:  # noqa: BLE001 - an advisory read; the end is published separately
            state = None
        if state in _TERMINAL:  # ended in the service, not published here yet
            state = KVPoll.Transferring
        if state is not None and state > self._progress_seen:
            self._progress_seen = state
        return self._progress_seen

    def _service_poll(self) -> KVPoll | None:
        raise NotImplementedError

    def failure_exception(self) -> NoReturn:
        """Raise why the request failed: ``TransferFailed``, whose message names the
        request, the reason and the peer, with the original error (NIXL's exception, the
        lost connection's, the service's ``ValueError``...) as ``__cause__``.
        ``RuntimeError`` if it has not failed (yet)."""
        result = self._result
        if result is None or result.ok:
            raise RuntimeError(f"request {self.request_id!r} has not failed (poll={self.poll().name})")
        result.raise_for_failure()
        raise AssertionError("unreachable: a failed result always raises")

    # -- either side's controls -----------------------------------------------------------------
    def abort(self) -> None:
        """Stop the request: ``poll()`` says ``Failed`` (``ABORTED``) from now on, and the
        service aborts it (the peer hears of it).  Never blocks; a no-op once it ended.
        A receiver's pages are free only once ``settled``."""
        idle = not self._queued_any  # nothing was ever handed to the service
        if not self._publish(failed(self.request_id, FailureReason.ABORTED, "aborted by the scheduler",
                                    created_at=self._created, settled=idle and not self._may_abort(),
                                    peer=self.peer)):
            return
        if not idle or self._may_abort():
            self._queue(self._abort_op)

    def clear(self) -> None:
        """Forget this request in the engine (SGLang's ``clear``): call it once the
        scheduler is done with it.  A request still running is aborted first, so
        clearing never leaves a transfer behind.  Idempotent."""
        if self._cleared:
            return
        if self._result is None:
            self.abort()
        self._cleared = True
        self._engine._forget(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.request_id!r}, {self.poll().name})"

    @property
    def peer(self) -> str | None:
        """The peer's address as the scheduler named it (a sender's ``receiver``, a
        receiver's ``sender``), for failures this object ends itself."""
        return None

    # -- plumbing ------------------------------------------------------------------------------
    def _check_usable(self, call: str) -> None:
        if self._cleared:
            raise RuntimeError(f"{call}() after clear() for request {self.request_id!r}")

    def _publish(self, result: TransferResult, *, settled: bool | None = None) -> bool:
        """Record how the request ended, if nothing did before.  Any thread."""
        with self._lock:
            if settled if settled is not None else result.settled:
                self._settled = True
            if self._result is not None:
                first = False
            else:
                self._result = result
                first = True
        self._engine._ended()
        return first

    def _mark_settled(self) -> None:
        with self._lock:
            self._settled = True
        self._engine._ended()

    def _fail_call(self, exc: BaseException) -> None:
        reason, message = _call_failure(exc)
        self._publish(failed(self.request_id, reason, message, created_at=self._created, error=exc,
                             settled=not self._owned, peer=self.peer))

    def _shutdown(self, message: str = "the engine is not running") -> None:
        """The engine stopped (or never ran): nothing more can happen to this request,
        and its agent (with its registered memory) is gone, so it is settled too."""
        self._publish(failed(self.request_id, FailureReason.SHUTDOWN, message, created_at=self._created,
                             settled=True, peer=self.peer), settled=True)

    def _queue(self, op: Op) -> None:
        """Run ``op`` on the loop thread after every op queued before it.  Any thread."""
        with self._lock:
            self._queued_any = True
            if self._ops is None:
                self._ops = deque()
            self._ops.append(op)
            if self._running:
                return
            self._running = True
        if not self._spawn(self._drain):
            with self._lock:
                self._ops = None
                self._running = False
            self._shutdown()

    def _spawn(self, fn: Op) -> bool:
        """Run ``fn`` as a task of the engine; whatever it raises ends this request, never
        the engine's loop."""
        async def guarded(svc: TransferService) -> None:
            try:
                await fn(svc)
            except Exception as exc:  # noqa: BLE001 - a request's failure, not the engine's
                self._fail_call(exc)

        return self._engine._spawn(guarded)

    async def _drain(self, svc: TransferService) -> None:
        """The runner (loop thread): perform the queued ops in order."""
        while True:
            with self._lock:
                if not self._ops:
                    self._ops = None  # a waiting transfer holds no queue for the GC to walk
                    self._running = False
                    return
                op = self._ops.popleft()
            try:
                await op(svc)
            except Exception as exc:  # noqa: BLE001 - every service error becomes this request's result
                self._fail_call(exc)
                if self._owned:  # the service's request goes on otherwise: stop it too
                    await self._abort_op(svc)

    async def _abort_op(self, svc: TransferService) -> None:
        if self._may_abort():
            try:
                await svc.abort(self.request_id)
            except (KVServiceError, ValueError):  # unknown id (nothing sent yet), or shutting down
                pass
        if not self._owned:
            self._mark_settled()  # nothing was handed to the service: nothing can land

    def _may_abort(self) -> bool:
        return self._owned

    def _ended_with(self, result: TransferResult) -> None:
        """The service's result for this request (on the loop thread, from ``_watch``)."""
        raise NotImplementedError

    def _future_done(self, future: asyncio.Future[TransferResult]) -> None:
        """The done callback ``Host._watch`` adds to the service's future for this request."""
        try:
            if not future.cancelled():  # nothing of ours cancels it; if it is, the engine's end ends this
                self._ended_with(future.result())
        finally:
            self._engine._unwatch()


class KVSender(_Transfer):
    """The prefill side of one request (SGLang's ``BaseKVSender``).  Made by
    ``KVTransferEngine.sender()``."""

    def __init__(self, engine: Host, request_id: str, *, receiver: str | None = None) -> None:
        super().__init__(engine, request_id)
        self.receiver = receiver
        self._num_pages: int | None = None
        self._pages_sent = 0
        self._last_sent = False
        self._handle: Any = None  # TransferHandle, set on the loop thread by the first send

    @property
    def peer(self) -> str | None:
        return self.receiver

    def init(self, num_pages: int) -> None:
        """Say how many pages the request has in all (optional).  Then ``send()`` marks
        the chunk that reaches ``num_pages`` as the last one by itself."""
        self._check_usable("init")
        if self._num_pages is not None:
            raise RuntimeError(f"init() called twice for request {self.request_id!r}")
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        self._num_pages = num_pages

    def send(self, pages: Pages, *, last: bool | None = None, timeout: float | None = None,
             layers: range | None = None, payload: bytes | None = None,
             fit: Literal["tail"] | None = None) -> None:
        """Queue one chunk of pages (``TransferService.send``); never waits.

        ``last``: whether this chunk ends the request; ``None`` means "when it reaches
        ``init()``'s ``num_pages``" (``False`` without ``init``, and for layer-wise
        chunks, whose end only the caller knows).  ``timeout``, ``layers`` (send only
        those layers, as the forward pass produces them), ``payload`` (with the last
        chunk) and ``fit`` (``"tail"``: the receiver may take the last pages only) are
        ``TransferService.send``'s.  A request that already ended takes the
        chunk and posts nothing (``poll()`` says how it ended).  Every other keyword
        argument of ``TransferService.send`` that the facade passes on is listed here by
        name (``send_kwargs`` builds them)."""
        self._check_usable("send")
        if self._last_sent:
            raise RuntimeError(f"send() after the last chunk of request {self.request_id!r}")
        if layers is None:  # whole pages: they count towards init()'s num_pages
            sent = self._pages_sent + len(pages)
            if self._num_pages is not None and sent > self._num_pages:
                raise ValueError(f"request {self.request_id!r}: {sent} pages sent, init() said {self._num_pages}")
            if last is None:
                last = self._num_pages is not None and sent >= self._num_pages
            self._pages_sent = sent
        last = bool(last)
        self._last_sent = last
        if self._result is not None:
            return  # ended (failed or aborted): sticky, nothing more is posted
        kwargs = self.send_kwargs(last=last, timeout=timeout, layers=layers, payload=payload, fit=fit)
        pages = _copy(pages)
        self._queue(lambda svc: self._send_op(svc, pages, kwargs))

    def send_kwargs(self, **given: Any) -> dict[str, Any]:
        """The keyword arguments for ``TransferService.send``: those given (``None`` means
        "the service's default"), and ``receiver`` with the first chunk."""
        kwargs = {k: v for k, v in given.items() if v is not None}
        if self.receiver is not None and not self._owned:
            kwargs.setdefault("receiver", self.receiver)
        return kwargs

    async def _send_op(self, svc: TransferService, pages: Pages, kwargs: dict[str, Any]) -> None:
        if self._result is not None:
            return
        if self._owned:
            kwargs.pop("receiver", None)
        handle = await svc.send(self.request_id, pages, **kwargs)
        if self._handle is None:
            self._owned = True
            self._handle = handle
            # No timeout of its own: the service's deadlines (bootstrap, transfer) end every
            # request, and its completion is a failure only once it is settled.
            self._engine._watch(svc.completion_future(handle), self)

    def _ended_with(self, result: TransferResult) -> None:
        self._publish(result, settled=True)

    def _service_poll(self) -> KVPoll | None:
        handle = self._handle
        if handle is None:
            return None
        state: KVPoll = handle.poll()
        return state

    def _may_abort(self) -> bool:
        # Also before any send(): the receiver's expect may already wait here, and the
        # service's abort tells it at once instead of letting it wait out a deadline.
        return True


class KVReceiver(_Transfer):
    """The decode side of one request (SGLang's ``BaseKVReceiver``).  Made by
    ``KVTransferEngine.receiver()``."""

    def __init__(self, engine: Host, request_id: str, *, sender: str, member: str | None = None) -> None:
        super().__init__(engine, request_id)
        self.sender = sender
        self.member = member
        self._pages: Pages | None = None

    @property
    def peer(self) -> str | None:
        return self.sender

    @property
    def pages(self) -> Pages | None:
        """The pages ``init()`` named."""
        return self._pages

    def init(self, pages: Pages, *, timeout: float | None = None) -> None:
        """Announce where the request's KV goes (``TransferService.expect``; SGLang's
        ``send_metadata``); never waits.  ``timeout`` is ``expect``'s (default
        ``arrival_timeout_s``): the request fails ``TIMEOUT`` if it has not arrived by
        then, whatever the sender does."""
        self._check_usable("init")
        if self._pages is not None:
            raise RuntimeError(f"init() called twice for request {self.request_id!r}")
        self._pages = _copy(pages)
        if self._result is not None:
            return
        kwargs = self.expect_kwargs(timeout=timeout)
        dst = self._pages
        self._queue(lambda svc: self._expect_op(svc, dst, kwargs))

    def expect_kwargs(self, **given: Any) -> dict[str, Any]:
        """The keyword arguments for ``TransferService.expect`` (``None``: the default)."""
        kwargs = {k: v for k, v in given.items() if v is not None}
        kwargs["sender"] = self.sender
        if self.member is not None:
            kwargs["member"] = self.member
        return kwargs

    async def _expect_op(self, svc: TransferService, pages: Pages, kwargs: dict[str, Any]) -> None:
        if self._result is not None:
            self._mark_settled()  # aborted before its expect went out: nothing can land
            return
        await svc.expect(self.request_id, pages, **kwargs)
        self._owned = True
        # Bounded by the service: the arrival deadline, the peer's loss, shutdown.
        self._engine._watch(svc.arrival_future(self.request_id), self)

    def _ended_with(self, result: TransferResult) -> None:
        self._publish(result)
        if not result.settled:
            # A failed request's pages stay held while a WRITE may still land; this ends
            # when the sender confirms, dies, or this service stops (settle_all).
            self._spawn(self._await_settled)

    async def _await_settled(self, svc: TransferService) -> None:
        settled = await svc.await_settled(self.request_id)
        if settled.settled:
            self._mark_settled()

    def _service_poll(self) -> KVPoll | None:
        if not self._owned:
            return None
        return self._engine._poll_arrival(self.request_id)
