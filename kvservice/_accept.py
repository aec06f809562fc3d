"""Accept loops that survive ``accept()`` errors.

anyio's ``Listener.serve()`` lets an ``accept()`` error such as ``EMFILE`` (out of
file descriptors) escape, which ends the task group serving it: one burst of
connections would end the service.  ``accept_loop`` reports the error, backs off
(``BACKOFF_MIN_S`` doubling to ``BACKOFF_MAX_S``, so a persistent error neither
spins nor floods the log) and goes on accepting.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, NoReturn

import anyio
import anyio.abc

BACKOFF_MIN_S = 0.01
BACKOFF_MAX_S = 1.0

Handler = Callable[[anyio.abc.SocketStream], Coroutine[Any, Any, None]]


async def accept_loop(
    listener: anyio.abc.SocketListener, handler: Handler, tg: anyio.abc.TaskGroup, *,
    on_error: Callable[[OSError], None],
) -> NoReturn:
    """Accept for ever, starting ``handler(stream)`` in ``tg`` for each connection.

    ``handler`` must not raise (guard it): its errors would reach ``tg``.  Ends
    only by cancellation or when the listener is closed (``ClosedResourceError``)."""
    backoff = BACKOFF_MIN_S
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            on_error(exc)
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)
            continue
        backoff = BACKOFF_MIN_S
        tg.start_soon(handler, stream)
