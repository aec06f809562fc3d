"""A small router for disaggregated vLLM over kvservice: each request is prefilled on one
server (one token, its KV handed off), then decoded on another with the hand-off.

    python -m kvservice.integrations.vllm.proxy --prefill http://10.0.0.5:8100 \\
        --decode http://10.0.0.6:8200 --port 8000

OpenAI-compatible: ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed or
not), ``GET /health``.  Several ``--prefill`` / ``--decode`` are taken in turn.  When the
prefill fails, or answers without a hand-off, the decode prefills the request itself:
the client gets its answer either way, and the proxy counts which way it went
(``GET /stats``).  It runs where vLLM is installed (it uses vLLM's ``aiohttp``).

Hand-offs come from the prefill only: whatever ``kv_transfer_params`` a client puts in its
body (at the top, or in ``vllm_xargs``, which vLLM reads the same way) is removed before the
request goes anywhere (counted ``client_params_dropped``), and the decode gets the prefill's
answer or no hand-off at all.  The decode still checks what it gets (the hand-off's MAC,
docs/vllm.md "Trust"): the proxy is not what makes a hand-off trustworthy.

It logs (to stderr, ``--log-level``) one ``proxy.listening`` line once it accepts
connections (its address, the prefills and the decodes), one ``proxy.local_prefill`` line
each time a request falls back to the decode's own prefill, saying why (at most 10 a
10 s window per reason, with ``unlogged=`` the lines held back), ``proxy.decode_unreachable``
likewise, and ``proxy.stopped`` on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
from collections import Counter
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import web

from ..._log import Throttle, configure_logging, get_logger

log = get_logger("kvservice.vllm.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)


class Router:
    def __init__(self, prefills: Sequence[str], decodes: Sequence[str]) -> None:
        if not prefills or not decodes:
            raise ValueError("at least one --prefill and one --decode")
        self._prefills = itertools.cycle([p.rstrip("/") for p in prefills])
        self._decodes = itertools.cycle([d.rstrip("/") for d in decodes])
        self.counts: Counter[str] = Counter()
        self._session: aiohttp.ClientSession | None = None
        self._throttle = Throttle()

    async def start(self, _app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=_TIMEOUT)

    async def stop(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": "the body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the body must be a JSON object"}, status=400)
        body = self._without_client_params(body)
        params = await self._prefill(request.path, body)
        decode = dict(body)
        if params is not None:
            decode["kv_transfer_params"] = params
        return await self._forward(request, f"{next(self._decodes)}{request.path}", decode)

    def _without_client_params(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` without the ``kv_transfer_params`` a client may have put in it: a
        hand-off (or a request for one) is the proxy's and the prefill's to make."""
        xargs = body.get("vllm_xargs")
        smuggled = isinstance(xargs, dict) and "kv_transfer_params" in xargs
        if "kv_transfer_params" not in body and not smuggled:
            return body
        self.counts["client_params_dropped"] += 1
        clean = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if isinstance(xargs, dict) and smuggled:
            clean["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_transfer_params"}
        return clean

    async def _prefill(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The prefill's hand-off, or None (the decode then prefills by itself)."""
        assert self._session is not None
        first = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        first.pop("stream_options", None)
        prefill = next(self._prefills)
        try:
            async with self._session.post(f"{prefill}{path}", json=first) as resp:
                status, raw = resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._local("prefill_unreachable", prefill, repr(exc))
            return None
        try:
            answer = json.loads(raw)
        except ValueError:  # not JSON (nor UTF-8): an answer without a hand-off
            answer = raw.decode(errors="replace")
        if status != 200:
            self._local("prefill_failed", prefill, f"HTTP {status}: {_brief(answer)}")
            return None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            self._local("no_handoff", prefill, "the answer has no kv_transfer_params object (is the prefill "
                        "a kv_producer with the KVServiceConnector?)")
            return None
        self.counts["handed_off"] += 1
        return params

    def _local(self, kind: str, prefill: str, why: str) -> None:
        """Count (and log, rate-limited) a request the decode prefills itself."""
        self.counts[kind] += 1
        if (unlogged := self._throttle.allow(kind)) is not None:
            log.warning("proxy.local_prefill", kind=kind, prefill=prefill, why=why, unlogged=unlogged)

    async def _forward(self, request: web.Request, url: str, body: dict[str, Any]) -> web.StreamResponse:
        assert self._session is not None
        try:
            async with self._session.post(url, json=body) as resp:
                if not body.get("stream"):
                    return web.Response(body=await resp.read(), status=resp.status,
                                        content_type=resp.content_type)
                out = web.StreamResponse(status=resp.status, headers={"Content-Type": resp.content_type})
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.counts["decode_unreachable"] += 1
            if (unlogged := self._throttle.allow("decode_unreachable")) is not None:
                log.warning("proxy.decode_unreachable", decode=url, why=repr(exc), unlogged=unlogged)
            return web.json_response({"error": f"decode unreachable: {exc!r}"}, status=502)

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response(dict(self.counts))


def app(prefills: Sequence[str], decodes: Sequence[str]) -> web.Application:
    router = Router(prefills, decodes)
    application = web.Application(client_max_size=64 * 1024 * 1024)
    application.on_startup.append(router.start)
    application.on_cleanup.append(router.stop)
    for route in ROUTES:
        application.router.add_post(route, router.handle)
    application.router.add_get("/health", router.health)
    application.router.add_get("/stats", router.stats)
    return application


async def serve(prefills: Sequence[str], decodes: Sequence[str], host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT; ``proxy.listening`` once connections are accepted."""
    runner = web.AppRunner(app(prefills, decodes), handle_signals=False, access_log=None)  # no line per request
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, host, port).start()
        bound = [f"http://{_hostport(a)}" for a in runner.addresses]
        log.info("proxy.listening", address=bound[0] if len(bound) == 1 else bound, prefill=list(prefills),
                 decode=list(decodes))
        await stop.wait()
        log.info("proxy.stopped")
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", action="append", required=True, help="a prefill server's URL (repeatable)")
    parser.add_argument("--decode", action="append", required=True, help="a decode server's URL (repeatable)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    asyncio.run(serve(args.prefill, args.decode, args.host, args.port))


def _hostport(address: Any) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _brief(answer: Any, limit: int = 200) -> str:
    """A failed answer as a log line carries it: vLLM's error message, or the answer cut short."""
    error = answer.get("error") if isinstance(answer, dict) else None
    text = error.get("message") if isinstance(error, dict) else None
    text = str(text if text is not None else answer)
    return text if len(text) <= limit else text[:limit] + "..."


if __name__ == "__main__":
    main()
