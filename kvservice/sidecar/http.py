"""A minimal HTTP/1.1 server for the operations endpoints.

GET only, one request per connection (``Connection: close``), request head
capped at 8 KiB and 5 s, at most ``MAX_CONNECTIONS`` connections at once (more
are closed unanswered): enough for probes and Prometheus scrapes, and nothing a
client can use to hold the daemon up.  Bad requests, connections over the
bound, failed accepts and crashed handlers are counted in ``refused`` by kind.

* ``/healthz``: 200 while the process serves (liveness).
* ``/readyz``: 200 once the NIXL agent is up, the pool registered and both
  listeners open; 503 before that and while draining (readiness).
* ``/metrics``: Prometheus text (see ``metrics.py``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.stapled import MultiListener

from .._control.accept import accept_loop
from .._control.links import CONNECTION_ERRORS
from .._log import get_logger

log = get_logger("kvservice.sidecar.http")

MAX_HEAD_BYTES = 8192
HEAD_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64

#: path -> () -> (status code, content type, body)
Route = Callable[[], tuple[int, str, str]]
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


#: what each refused status counts as
_REFUSALS = {400: "bad_request", 408: "head_timeout", 431: "head_too_large"}


class OpsServer:
    def __init__(self, routes: dict[str, Route]) -> None:
        self.routes = routes
        self.requests = 0
        self.open = 0
        #: what HTTP clients tried and were refused, by kind
        self.refused: collections.Counter[str] = collections.Counter()

    async def serve(self, listener: MultiListener[anyio.abc.SocketStream] | anyio.abc.SocketListener, *,
                    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with listener, anyio.create_task_group() as tg:
            task_status.started()
            await accept_loop(listener, self._handle, tg, self._on_error, name="http")

    def _on_error(self, kind: str, exc: BaseException) -> None:
        self.refused[kind] += 1

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        if self.open >= MAX_CONNECTIONS:
            self.refused["too_many_connections"] += 1
            return  # accept_loop closes it
        self.open += 1
        try:
            await self._answer(stream)
        finally:
            self.open -= 1

    async def _answer(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                status, ctype, body = await self._respond(stream)
                if status in _REFUSALS:
                    self.refused[_REFUSALS[status]] += 1
                head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
                        f"Content-Type: {ctype}\r\nContent-Length: {len(body.encode())}\r\n"
                        "Connection: close\r\nCache-Control: no-store\r\n\r\n")
                with anyio.move_on_after(HEAD_TIMEOUT_S):
                    await stream.send(head.encode() + body.encode())
            except CONNECTION_ERRORS:
                pass

    async def _respond(self, stream: anyio.abc.SocketStream) -> tuple[int, str, str]:
        text = "text/plain; charset=utf-8"
        reader = BufferedByteReceiveStream(stream)
        try:
            with anyio.fail_after(HEAD_TIMEOUT_S):
                head = await reader.receive_until(b"\r\n\r\n", MAX_HEAD_BYTES)
        except anyio.DelimiterNotFound:
            return 431, text, "request head too large\n"
        except TimeoutError:
            return 408, text, "request head not received in time\n"
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return 400, text, "bad request line\n"
        method, target, _ = parts
        self.requests += 1
        route = self.routes.get(target.split("?", 1)[0])
        if route is None:
            return 404, text, f"no such endpoint; try {', '.join(sorted(self.routes))}\n"
        if method not in ("GET", "HEAD"):
            return 405, text, "only GET\n"
        try:
            status, ctype, body = route()
        except Exception:  # a broken endpoint must not take the daemon down
            log.exception("http.endpoint_failed", path=target)
            return 500, text, "internal error\n"
        return status, ctype, "" if method == "HEAD" else body
