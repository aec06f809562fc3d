"""``KVTransferEngine``: a ``TransferService`` on an event loop of its own thread, for
schedulers that never await.

The loop thread runs ``anyio.run`` (uvloop when available, like ``kvservice serve``),
enters the service, and owns one task group in which every task the facade starts
runs (each request's op runner); nothing is created without an owner.  A request's end
reaches its ``KVSender`` / ``KVReceiver`` by a done callback on the service's future for it
(``_watch``), counted with the tasks.
The scheduler's thread reaches the loop only through ``loop.call_soon_threadsafe``,
which never waits: queuing a call costs a few microseconds whatever the loop is doing.

Shutdown (``close()``): the loop leaves the service's ``async with`` (drain for
``drain_grace_s``, the rest ``SHUTDOWN`` on both sides, handles released, the agent
closed), the done callbacks publish those results, and whatever the facade still holds
without a result (a receiver never ``init``-ed, a call queued too late) ends
``Failed(SHUTDOWN)``: after ``close()`` no request is pending.
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import functools
import threading
import weakref
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from .._config import ServiceConfig
from .._log import get_logger
from .._results import FailureReason, KVPoll, KVServiceError, TransferResult
from .._runtime import uvloop_available
from .._stats import ServiceStatus
from .._threads import start_thread
from ._transfers import KVReceiver, KVSender, _Transfer

if TYPE_CHECKING:
    from .. import KVPool
    from .._api import EarlyExpect
    from .._service import TransferService
    from ..memory import KVMemory

log = get_logger("kvservice")

ServiceFactory = Callable[[ServiceConfig], "TransferService"]

#: how long a stopping loop lets its facade tasks publish what the service's exit resolved
_FINISH_GRACE_S = 2.0


def _default_service(config: ServiceConfig, memory: KVMemory | None = None) -> TransferService:
    from .._service import TransferService

    return TransferService(config, memory=memory)


class KVTransferEngine:
    """Owns a ``TransferService`` running on its own thread, and makes the per-request
    ``KVSender`` / ``KVReceiver`` objects a synchronous scheduler polls.

    ``with KVTransferEngine(config) as engine:`` (or ``start()`` / ``close()``).
    ``service_factory`` builds the service on the loop thread (tests pass one with a
    fake NIXL door); ``loop`` is ``"auto" | "asyncio" | "uvloop"``.
    """

    def __init__(
        self, config: ServiceConfig | None = None, *, memory: KVMemory | None = None, loop: str = "auto",
        service_factory: ServiceFactory | None = None, start_timeout_s: float = 60.0,
        close_timeout_s: float | None = None,
    ) -> None:
        """``memory``: the engine's own KV tensors (``kvservice.memory``), registered as
        they are; without it the service allocates its own pool (``kv``)."""
        self.config = config or ServiceConfig()
        if memory is not None and service_factory is not None:
            raise ValueError("memory= goes to the default service; a service_factory builds its own")
        if loop not in ("auto", "asyncio", "uvloop"):
            raise ValueError(f"loop must be 'auto', 'asyncio' or 'uvloop', got {loop!r}")
        self._use_uvloop = loop != "asyncio" and uvloop_available()
        self._factory = service_factory or functools.partial(_default_service, memory=memory)
        self._start_timeout = start_timeout_s
        # drain, then up to a second of goodbyes, then the facade's own grace
        self._close_timeout = close_timeout_s or self.config.drain_grace_s + 1.0 + _FINISH_GRACE_S + 5.0
        self._svc: TransferService | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_context = contextvars.Context()
        self._tg: anyio.abc.TaskGroup | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._transfer_lock = threading.Lock()  # every transfer's end and op queue (few stores each)
        self._accepting = False  # calls reach the loop only while this holds
        self._live: dict[tuple[str, str], _Transfer] = {}  # (side, request id) -> not cleared
        self._tasks = 0  # facade tasks running (loop thread only)
        self._tasks_done: asyncio.Event | None = None
        self._changed = threading.Event()  # a transfer ended or settled since wait_for_end last looked

    # -- lifetime -------------------------------------------------------------------------------
    def start(self) -> KVTransferEngine:
        """Start the loop thread and the service; returns once the service is up (or raises
        its start error, e.g. ``NixlUnavailable``)."""
        if self._thread is not None:
            raise RuntimeError("KVTransferEngine.start() called twice")
        self._thread = start_thread(self._thread_main, name="kvservice-loop")
        if not self._ready.wait(self._start_timeout):
            self.close()
            raise KVServiceError(f"the transfer service did not start within {self._start_timeout}s")
        if self._error is not None:
            self._thread.join(self._start_timeout)
            raise self._error
        _open_engines.add(self)
        return self

    def close(self) -> None:
        """Stop the service (drain, then ``SHUTDOWN``) and the loop thread.  Every request
        of this engine has ended when it returns.  Idempotent; thread-safe."""
        with self._lock:
            self._accepting = False
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop has already ended
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self._close_timeout)
            if self._thread.is_alive():
                log.warning("engine.close_timeout", timeout_s=self._close_timeout)
        self._end_all("the engine was closed")
        _open_engines.discard(self)

    def __enter__(self) -> KVTransferEngine:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _thread_main(self) -> None:
        try:
            anyio.run(self._serve, backend="asyncio", backend_options={"use_uvloop": self._use_uvloop})
        except BaseException as exc:  # noqa: BLE001 - reported to start() or logged; the thread ends
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]  # the service's own start error, not our task group's wrapper
            if not self._ready.is_set():
                self._error = exc
            else:
                log.error("engine.loop_failed", error=repr(exc))
        finally:
            with self._lock:
                self._accepting = False
            self._ready.set()
            self._end_all("the engine's event loop ended")
            self._finished.set()

    async def _serve(self) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                async with self._factory(self.config) as svc:
                    self._svc = svc
                    self._stop = asyncio.Event()
                    self._loop = asyncio.get_running_loop()
                    # Tasks started from the scheduler's thread start in a callback of the loop,
                    # not in a task: run those callbacks in the loop's own context, in which
                    # anyio.run named the async library (sniffio, when installed, looks there;
                    # in the caller's thread's context it finds none and start_soon fails).
                    self._loop_context = contextvars.copy_context()
                    with self._lock:
                        self._accepting = True
                    self._ready.set()
                    await self._stop.wait()
                    with self._lock:
                        self._accepting = False
                # The service's exit resolved every request: let the done callbacks publish that.
                with anyio.move_on_after(_FINISH_GRACE_S):
                    while self._tasks:
                        self._tasks_done = asyncio.Event()
                        await self._tasks_done.wait()
            finally:
                tg.cancel_scope.cancel()

    # -- the facade's plumbing ------------------------------------------------------------------
    def _spawn(self, fn: Callable[[TransferService], Awaitable[None]]) -> bool:
        """Start ``fn(service)`` as a task of the engine's task group.  From the scheduler's
        thread (queued with ``call_soon_threadsafe``, never waits) or the loop thread.
        False when the engine does not take calls (not started, closing, closed)."""
        with self._lock:
            if not self._accepting:
                return False
            loop, tg, svc = self._loop, self._tg, self._svc
        assert loop is not None and tg is not None and svc is not None
        if self._thread is not None and threading.get_ident() == self._thread.ident:
            self._start_task(fn, svc)
            return True
        try:
            loop.call_soon_threadsafe(self._start_task, fn, svc, context=self._loop_context)
        except RuntimeError:  # the loop closed in between; _end_all ends the request
            return False
        return True

    def _start_task(self, fn: Callable[[TransferService], Awaitable[None]], svc: TransferService) -> None:
        """On the loop thread: ``fn`` as a counted task of the engine's group."""
        tg = self._tg
        if tg is None or tg.cancel_scope.cancel_called:
            return  # stopping: _end_all ends what this would have served

        async def counted() -> None:
            self._tasks += 1
            try:
                await fn(svc)
            finally:
                self._tasks -= 1
                if not self._tasks and self._tasks_done is not None:
                    self._tasks_done.set()

        tg.start_soon(counted)

    def _watch(self, future: asyncio.Future[TransferResult], transfer: _Transfer) -> None:
        """On the loop thread: ``transfer`` learns how it ended once ``future`` (the service's
        ``completion_future`` / ``arrival_future``) is done.  Counted as the facade's tasks
        are, so that ``close()`` lets it publish what the service's exit resolved; a done
        callback, not a task, because a scheduler keeps thousands of transfers waiting and
        the cyclic GC walks every object each one holds (``python -m benchmarks.gc_engine``).
        """
        self._tasks += 1
        future.add_done_callback(transfer._future_done, context=self._loop_context)

    def _unwatch(self) -> None:
        """A watched future's callback has run (``_Transfer._future_done``)."""
        self._tasks -= 1
        if not self._tasks and self._tasks_done is not None:
            self._tasks_done.set()

    def _poll_arrival(self, request_id: str) -> KVPoll | None:
        svc = self._svc
        if svc is None:
            return None
        return svc.poll_arrival(request_id)

    def _forget(self, transfer: _Transfer) -> None:
        key = ("send" if isinstance(transfer, KVSender) else "recv", transfer.request_id)
        with self._lock:
            if self._live.get(key) is transfer:
                del self._live[key]

    def _ended(self) -> None:
        self._changed.set()

    def _register(self, key: tuple[str, str], transfer: _Transfer) -> None:
        with self._lock:
            if self._thread is None:
                raise RuntimeError("KVTransferEngine is not started (use 'with' or start())")
            if key in self._live:
                raise ValueError(f"request {key[1]!r} already has a live {type(transfer).__name__} "
                                 "on this engine (clear() it first)")
            self._live[key] = transfer
            accepting = self._accepting
        if not accepting:
            transfer._shutdown()

    def _end_all(self, message: str) -> None:
        with self._lock:
            live = list(self._live.values())
        for transfer in live:
            transfer._shutdown(message)

    # -- the public API -------------------------------------------------------------------------
    def wait_for_end(self, timeout: float) -> bool:
        """Block the calling thread (the GIL and the core released) until one of this
        engine's transfers ends or settles, or ``timeout`` seconds pass; True if one did
        since the last call.  For a scheduler with nothing to do but wait on transfers: poll
        them after this returns (a change after it returned wakes the next call at once)."""
        changed = self._changed.wait(max(0.0, timeout))
        self._changed.clear()
        return changed

    def sender(self, request_id: str, *, receiver: str | None = None) -> KVSender:
        """The prefill side of ``request_id``.  ``receiver`` ("host:port") pins it to that
        decode (``TransferService.send(receiver=)``).  Raises ``ValueError`` while another
        sender of that id on this engine is not cleared.  Once the engine is closed (or its
        loop failed) the object is created ``Failed(SHUTDOWN)``."""
        transfer = KVSender(self, request_id, receiver=receiver)
        self._register(("send", request_id), transfer)
        return transfer

    def receiver(self, request_id: str, *, sender: str, member: str | None = None) -> KVReceiver:
        """The decode side of ``request_id``, fed by the prefill service at ``sender``
        ("host:port"); ``member``: the member that must prove itself there
        (``TransferService.expect(member=)``).  Nothing is sent before ``init(pages)``."""
        transfer = KVReceiver(self, request_id, sender=sender, member=member)
        self._register(("recv", request_id), transfer)
        return transfer

    def decline(self, request_id: str, *, sender: str, message: str = "") -> bool:
        """``TransferService.decline``: tell ``sender`` ("host:port") that this engine needs
        none of ``request_id`` (its send there fails ``ABORTED`` at once and frees what it
        held); never waits.  False when the engine does not take calls; a sender that
        cannot be reached, or a call refused, is logged (``transfer.decline_failed``,
        ``engine.decline_failed``): its send then ends at its bootstrap deadline, as for a
        receiver that never came."""
        async def decline(svc: TransferService) -> None:
            try:
                await svc.decline(request_id, sender=sender, message=message)
            except Exception as exc:  # noqa: BLE001 - a courtesy to the sender; its deadline stands
                log.warning("engine.decline_failed", request_id=request_id, sender=sender, error=repr(exc))

        return self._spawn(decline)

    def expected(self, request_id: str) -> bool:
        """Whether a receiver's expect for ``request_id`` has reached this engine and waits
        for the first ``send()`` (``TransferService.expected``); never waits on the loop."""
        early = self._early(request_id)
        return early is not None and early.expected

    def expected_pages(self, request_id: str) -> int | None:
        """``TransferService.expected_pages``: the pages a receiver's expect for
        ``request_id`` reserved, while it waits here for the first ``send()``; never waits."""
        early = self._early(request_id)
        return None if early is None else early.pages

    def expect_dropped(self, request_id: str) -> tuple[FailureReason, str] | None:
        """``TransferService.expect_dropped``: (why, whose) when an expect for ``request_id``
        came and was dropped before any ``send()``, which now fails at once; never waits."""
        early = self._early(request_id)
        return None if early is None else early.dropped

    def _early(self, request_id: str) -> EarlyExpect | None:
        svc = self._svc
        if svc is None:
            return None
        from .._service import early_expect  # loaded with the service (imported lazily here)

        return early_expect(svc, request_id)

    @property
    def running(self) -> bool:
        """The service is up and takes calls."""
        return self._accepting

    @property
    def address(self) -> str:
        """The service's control address ("host:port"), for peers."""
        return self._service().address

    @property
    def agent_name(self) -> str:
        return self._service().agent_name

    @property
    def kv(self) -> KVPool:
        """The registered KV pool.  The scheduler writes (prefill) and reads (decode) pages
        in it directly; a page is the service's only while a request names it."""
        return self._service().kv

    def live(self) -> list[_Transfer]:
        """Senders and receivers not cleared yet, ended or not."""
        with self._lock:
            return list(self._live.values())

    def pending(self) -> list[_Transfer]:
        """Senders and receivers that have not ended yet."""
        return [t for t in self.live() if t.result is None]

    def status(self, timeout: float = 5.0) -> ServiceStatus:
        """``TransferService.status()``, taken on the loop thread (waits up to ``timeout``)."""
        loop, svc = self._loop, self._svc
        if loop is None or svc is None or not self._accepting:
            raise KVServiceError("the engine is not running")

        async def snapshot() -> ServiceStatus:
            return svc.status()

        return asyncio.run_coroutine_threadsafe(snapshot(), loop).result(timeout)

    def _service(self) -> TransferService:
        if self._svc is None:
            raise KVServiceError("the engine is not started")
        return self._svc


#: engines not closed yet: closed at interpreter exit (their agents released in order)
_open_engines: weakref.WeakSet[KVTransferEngine] = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    for engine in list(_open_engines):
        engine.close()
