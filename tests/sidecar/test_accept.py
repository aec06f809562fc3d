"""``accept_loop``: a failed ``accept()`` is counted and retried after a doubling
back-off, a handler that raises ends only its own connection, and the loop
serves the next connection either way.  Real Unix sockets; the failures are
``OSError(EMFILE)`` raised where anyio's listener would raise them."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import AsyncIterator

import anyio
import anyio.abc
import pytest
from anyio.streams.stapled import MultiListener
from structlog.testing import capture_logs

from kvservice._control.accept import BACKOFF_MAX_S, BACKOFF_MIN_S, accept_loop
from kvservice.sidecar.local import short_tmpdir


class Failing:
    """A real listener whose ``accept()`` fails ``fail`` times first (as anyio's Unix listener
    does when the process is out of descriptors), noting when each attempt came."""

    def __init__(self, inner: anyio.abc.SocketListener, fail: int) -> None:
        self.inner = inner
        self.fail = fail
        self.attempts: list[float] = []

    async def accept(self) -> anyio.abc.SocketStream:
        self.attempts.append(time.monotonic())
        if self.fail > 0:
            self.fail -= 1
            try:
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            except OSError as exc:
                raise anyio.BrokenResourceError from exc
        return await self.inner.accept()


async def echo(stream: anyio.abc.SocketStream) -> None:
    await stream.send(b"hi:" + await stream.receive())


async def ask(path: str) -> bytes:
    with anyio.fail_after(10):
        async with await anyio.connect_unix(path) as s:
            await s.send(b"x")
            try:
                return await s.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):  # closed (reset: our byte unread)
                return b""


async def unix_listener(name: str) -> tuple[anyio.abc.SocketListener, str]:
    path = os.path.join(short_tmpdir(), name)
    return await anyio.create_unix_listener(path), path


@pytest.fixture
async def listener() -> AsyncIterator[tuple[anyio.abc.SocketListener, str]]:
    lis, path = await unix_listener("a.sock")
    yield lis, path
    await lis.aclose()
    os.unlink(path)
    os.rmdir(os.path.dirname(path))


async def test_accept_errors_back_off_doubling_then_connections_pass(
        listener: tuple[anyio.abc.SocketListener, str]) -> None:
    inner, path = listener
    failing = Failing(inner, fail=5)
    errors: list[tuple[str, BaseException]] = []
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            tg.start_soon(accept_loop, failing, echo, tg, lambda k, e: errors.append((k, e)))
            assert await ask(path) == b"hi:x"  # waited in the backlog through the failures
            failing.fail = 2  # the accept after the next one fails twice: the back-off starts over
            assert await ask(path) == b"hi:x"
            assert await ask(path) == b"hi:x"
            tg.cancel_scope.cancel()
    assert [k for k, _ in errors] == ["accept_error"] * 7
    assert all(isinstance(e, OSError) and e.errno == errno.EMFILE for _, e in errors)
    gaps = [b - a for a, b in zip(failing.attempts, failing.attempts[1:], strict=False)]
    expected = [BACKOFF_MIN_S * 2**i for i in range(5)]
    assert all(g >= e * 0.9 for g, e in zip(gaps[:5], expected, strict=True)), gaps
    assert sum(gaps[:5]) < 5.0, gaps  # bounded: 0.31 s of back-off, not a hang
    # attempts 5 and 6 succeeded, 7 and 8 failed: 10 ms, then 20 ms again, not the 320 ms due next before
    assert gaps[7] >= BACKOFF_MIN_S * 0.9 and gaps[8] >= BACKOFF_MIN_S * 2 * 0.9, gaps
    waits = [e["retry_in_s"] for e in logs if e["event"] == "listener.accept_failed"]
    assert waits == [0.01, 0.02, 0.04, 0.08, 0.16, 0.01, 0.02]


async def test_back_off_is_capped(listener: tuple[anyio.abc.SocketListener, str]) -> None:
    inner, path = listener
    failing = Failing(inner, fail=9)  # 10 ms doubling: 8 waits reach the 1 s cap
    errors: list[str] = []
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            tg.start_soon(accept_loop, failing, echo, tg, lambda k, e: errors.append(k))
            assert await ask(path) == b"hi:x"
            tg.cancel_scope.cancel()
    waits = [e["retry_in_s"] for e in logs if e["event"] == "listener.accept_failed"]
    assert waits == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, BACKOFF_MAX_S, BACKOFF_MAX_S]
    assert errors == ["accept_error"] * 9


async def test_a_handler_that_raises_ends_its_connection_only(listener: tuple[anyio.abc.SocketListener, str]) -> None:
    inner, path = listener
    calls = 0

    async def flaky(stream: anyio.abc.SocketStream) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in the handler")
        await echo(stream)

    errors: list[tuple[str, BaseException]] = []
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            tg.start_soon(accept_loop, inner, flaky, tg, lambda k, e: errors.append((k, e)))
            assert await ask(path) == b""  # closed by the guard, not left hanging
            assert await ask(path) == b"hi:x"  # and the next connection is served
            tg.cancel_scope.cancel()
    assert [(k, str(e)) for k, e in errors] == [("handler_error", "a bug in the handler")]
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["listener.handler_crashed"]


async def test_every_listener_of_a_multilistener_is_served_and_a_closed_one_ends_its_loop() -> None:
    (a, pa), (b, pb) = await unix_listener("a.sock"), await unix_listener("b.sock")
    try:
        async with anyio.create_task_group() as tg:
            await accept_loop(MultiListener([a, b]), echo, tg, lambda k, e: None)  # returns at once
            assert await ask(pa) == b"hi:x" and await ask(pb) == b"hi:x"
            await a.aclose()
            with anyio.fail_after(10):
                await accept_loop(a, echo, tg, lambda k, e: None)  # closed: returns
            assert await ask(pb) == b"hi:x"
            tg.cancel_scope.cancel()
    finally:
        await b.aclose()
        for p in (pa, pb):
            os.unlink(p)
            os.rmdir(os.path.dirname(p))
