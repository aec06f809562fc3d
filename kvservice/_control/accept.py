"""Accepting connections so that no connection, and no failed ``accept()``, can
end the server.

anyio's ``Listener.serve()`` lets both escape into the caller's task group: an
``accept()`` that fails (``EMFILE`` when the process is out of file
descriptors, ``ENOBUFS``, ...) ends the loop, and a handler that raises
cancels every other connection with it.  ``accept_loop`` instead

* logs each failed ``accept()`` (``listener.accept_failed``), reports it to
  ``on_error("accept_error", exc)`` and tries again after a back-off that starts
  at ``BACKOFF_MIN_S`` and doubles up to ``BACKOFF_MAX_S`` (reset by the next
  successful accept), so a descriptor shortage neither spins the loop nor stops
  the service: connections wait in the kernel's backlog meanwhile;
* runs each connection's handler under a guard: whatever it raises is logged
  (``listener.handler_crashed``), reported to ``on_error("handler_error", exc)``
  and ends that connection only.  The accepted stream is closed when its handler
  returns or raises.

It returns when the listener is closed and ends when its task is cancelled.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar, cast

import anyio
import anyio.abc
from anyio.streams.stapled import MultiListener

from .._log import get_logger

log = get_logger("kvservice.accept")

BACKOFF_MIN_S = 0.01
BACKOFF_MAX_S = 1.0

S = TypeVar("S", bound=anyio.abc.AsyncResource)
S_co = TypeVar("S_co", bound=anyio.abc.AsyncResource, covariant=True)

#: ``on_error(kind, exc)``, kind "accept_error" or "handler_error": count it (the loop logs it)
ErrorHook = Callable[[str, BaseException], None]


class Acceptor(Protocol[S_co]):
    """What the loop needs of a listener (anyio's ``SocketListener`` and the like)."""

    async def accept(self) -> S_co: ...


async def accept_loop(
    listener: Acceptor[S] | MultiListener[S], handler: Callable[[S], Awaitable[object]],
    tg: anyio.abc.TaskGroup, on_error: ErrorHook, *, name: str = "listener",
) -> None:
    """Accept connections on ``listener`` and run ``handler(stream)`` for each in ``tg``.

    A ``MultiListener`` (``anyio.create_tcp_listener`` on several addresses) gets
    one loop per address, all in ``tg``; this call then returns at once.
    """
    if isinstance(listener, MultiListener):
        for sub in listener.listeners:
            if not isinstance(sub, anyio.abc.SocketListener):
                raise TypeError(f"cannot accept on {type(sub).__name__}")
            tg.start_soon(_loop, cast(Acceptor[S], sub), handler, tg, on_error, name)
        return
    await _loop(listener, handler, tg, on_error, name)


async def _loop(listener: Acceptor[S], handler: Callable[[S], Awaitable[object]],
                tg: anyio.abc.TaskGroup, on_error: ErrorHook, name: str) -> None:
    delay = BACKOFF_MIN_S
    while True:
        try:
            stream = await listener.accept()
        except anyio.ClosedResourceError:
            return
        except (OSError, anyio.BrokenResourceError) as exc:  # anyio's Unix listener wraps the OSError
            cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
            log.warning("listener.accept_failed", listener=name, error=repr(cause), retry_in_s=delay)
            on_error("accept_error", cause)
            await anyio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)
            continue
        delay = BACKOFF_MIN_S
        tg.start_soon(_guarded, handler, stream, on_error, name)


async def _guarded(handler: Callable[[S], Awaitable[object]], stream: S, on_error: ErrorHook, name: str) -> None:
    try:
        await handler(stream)
    except Exception as exc:  # one connection's failure is that connection's
        log.exception("listener.handler_crashed", listener=name)
        on_error("handler_error", exc)
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await stream.aclose()
            except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
