"""How callers wait on the request plane: for a request to end, for an arrival, for a
failure to settle.  A wait that times out fails the request it waited for (``TIMEOUT``),
except ``await_settled``'s, which returns the result as it stands; a cancelled caller's
cancellation propagates and the transfer goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import anyio

from .._results import FailureReason, TransferResult, TransferStatus, UnknownRequestError
from .plane import RequestPlane
from .requests import RecvRequest, SendRequest, make_result


def await_done(plane: RequestPlane, req: SendRequest | RecvRequest, timeout: float | None,
               why: str) -> Awaitable[TransferResult]:
    """Wait for ``req`` to end; a ``timeout`` that passes first fails it ``TIMEOUT``
    (``why``).  A send's failure is returned once settled (its release: one tick).

    Without a timeout this is the request's own future, which the caller's coroutine
    awaits: a task waiting for one of thousands of requests in flight then holds no
    coroutine of this module (objects the cyclic GC would walk at each collection)."""
    if timeout is None:
        return req.done.until_done()
    return _await_done_within(plane, req, timeout, why)


def ended_future(found: SendRequest | RecvRequest | TransferResult) -> asyncio.Future[TransferResult]:
    """How ``found`` ends, as a future of the running loop (done already for a result):
    ``await_done`` without a timeout, for a caller that adds a done callback to it rather
    than keeping a task per request."""
    if isinstance(found, TransferResult):
        future: asyncio.Future[TransferResult] = asyncio.get_running_loop().create_future()
        future.set_result(found)
        return future
    return found.done.until_done()


async def _await_done_within(plane: RequestPlane, req: SendRequest | RecvRequest, timeout: float,
                             why: str) -> TransferResult:
    with anyio.move_on_after(timeout):
        await req.done.wait()
    if req.result is None:
        plane.fail(req, FailureReason.TIMEOUT, why, error=None)
        if isinstance(req, SendRequest):
            await req.done.wait()
    assert req.result is not None
    return req.result


def arrival(plane: RequestPlane, request_id: str) -> RecvRequest | TransferResult:
    """The live receiving request, or the result it ended with."""
    req = plane.recvs.get(request_id)
    if req is not None:
        return req
    done = plane.recvs_done.get(request_id)
    if done is None:
        raise UnknownRequestError(f"unknown request {request_id!r} (call expect() first)")
    return done


async def await_settled(plane: RequestPlane, request_id: str, timeout: float | None) -> TransferResult:
    """See ``TransferService.await_settled``: the result once nothing of ``request_id`` can
    be written any more (or as it stands when ``timeout`` passes)."""
    side = "recv" if request_id in plane.recvs or request_id in plane.recvs_done else "send"
    live: RecvRequest | SendRequest | None = plane.recvs.get(request_id) if side == "recv" else \
        plane.sends.get(request_id)
    deadline = None if timeout is None else anyio.current_time() + timeout
    if live is not None:
        with anyio.move_on_after(timeout):
            await live.done.wait()
        if live.result is None:
            return _settled_or_unknown(plane, side, request_id)
    result = _settled_or_unknown(plane, side, request_id)
    if not result.settled:
        left = None if deadline is None else max(0.0, deadline - anyio.current_time())
        await plane.settlement.wait(side, request_id, left)
    return _settled_or_unknown(plane, side, request_id)


def _settled_or_unknown(plane: RequestPlane, side: str, request_id: str) -> TransferResult:
    live = plane.recvs.get(request_id) if side == "recv" else plane.sends.get(request_id)
    result = (live.result if live is not None else None) or \
        (plane.recvs_done if side == "recv" else plane.sends_done).get(request_id)
    if result is None:
        if live is not None:  # still running: report where it stands
            return make_result(live, TransferStatus.FAILED, reason=FailureReason.TIMEOUT,
                               message="still in progress when await_settled's timeout passed")
        raise UnknownRequestError(f"unknown request {request_id!r}")
    return result
