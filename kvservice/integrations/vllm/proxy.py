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

With ``--layerwise`` (off by default) a completion goes decode-first: the proxy tokenizes the
prompt (the prefill's ``/tokenize``), signs a ticket under the cluster's key (``--key-file``,
the services' ``auth_key_file``) naming the prefill's kvservice (``--prefill-kvservice``), and
sends the request to the decode with the ticket (it reserves the prompt's blocks and expects
them) and, at once, to the prefill (one token), which writes each layer's KV as its forward
computes it (``layerwise``; docs/vllm.md "Layer-wise push").  Both get the prompt as the
token ids the ticket signs.  A chat completion, or a prompt the prefill cannot tokenize, goes
the whole-request way.  When the prefill refuses the ticket (it answers with a hand-off of
its own) or fails, nothing will come under the ticket: while the decode has sent the client
nothing (its first token needs the KV), the proxy ends the decode's request (it closes the
connection; vLLM aborts the request, and kvservice its load) and sends it again, with the
prefill's hand-off or, without one, to be prefilled there.

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
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from ..._control.addresses import split_address
from ..._log import Throttle, configure_logging, get_logger
from ..._trust.handoff import handoff_key
from ..._trust.keys import load_key
from .params import MAX_RANKS, Handoff, HandoffError

log = get_logger("kvservice.vllm.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)
#: prefill requests of decode-first completions still being answered, at most (past it, a
#: completion goes the whole-request way: counted ``layerwise_busy``)
MAX_LAYERWISE_PREFILLS = 4096


@dataclass(frozen=True)
class Layerwise:
    """Decode-first, layer-wise completions (``--layerwise``)."""

    #: the hand-off key (``_trust.handoff.handoff_key`` of the cluster's key)
    key: bytes
    #: per ``--prefill``, in order: its kvservice addresses, one per TP rank
    senders: tuple[tuple[str, ...], ...]
    block_size: int
    #: how long a ticket is valid (the prefill's ``bootstrap_timeout_s``)
    lifetime_s: float = 30.0

    @classmethod
    def configured(cls, key_file: str, senders: Sequence[str], block_size: int, lifetime_s: float,
                   prefills: int) -> Layerwise:
        """From the command line; ``ValueError`` naming the option that is wrong."""
        if len(senders) != prefills:
            raise ValueError(f"--prefill-kvservice: one per --prefill ({prefills}), got {len(senders)}")
        parsed = tuple(tuple(a.strip() for a in s.split(",")) for s in senders)
        for ranks in parsed:
            if not 1 <= len(ranks) <= MAX_RANKS:
                raise ValueError(f"--prefill-kvservice: 1..{MAX_RANKS} addresses, got {len(ranks)}")
            for address in ranks:
                try:
                    split_address(address)
                except ValueError as exc:
                    raise ValueError(f"--prefill-kvservice: {exc}") from None
        if not 1 <= block_size <= 1 << 20:
            raise ValueError(f"--block-size: 1..{1 << 20}, got {block_size}")
        if not 0 < lifetime_s <= 3600:
            raise ValueError(f"--ticket-lifetime-s: (0, 3600], got {lifetime_s}")
        key = handoff_key(load_key(key_file, what="--key-file"))
        assert key is not None
        return cls(key, parsed, block_size, lifetime_s)


class _Relay:
    """The client's side of one request: a streamed answer is passed on chunk by chunk."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        #: the client's response, once the decode sent a first chunk (its headers went then)
        self.out: web.StreamResponse | None = None
        #: decode-first: the decode's request to send instead, once the first was ended
        self.again: dict[str, Any] | None = None

    async def write(self, chunk: bytes, resp: aiohttp.ClientResponse) -> None:
        out = await self._prepared(resp)
        await out.write(chunk)

    async def end(self, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        out = await self._prepared(resp)
        await out.write_eof()
        return out

    async def _prepared(self, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        if self.out is None:  # set before its first await: from here on, nothing ends the decode's request
            self.out = web.StreamResponse(status=resp.status, headers={"Content-Type": resp.content_type})
        await self.out.prepare(self.request)  # its headers, once
        return self.out


class Router:
    def __init__(self, prefills: Sequence[str], decodes: Sequence[str], layerwise: Layerwise | None = None) -> None:
        if not prefills or not decodes:
            raise ValueError("at least one --prefill and one --decode")
        urls = [p.rstrip("/") for p in prefills]
        self._prefills = itertools.cycle(urls)
        self._decodes = itertools.cycle([d.rstrip("/") for d in decodes])
        self._layerwise = layerwise
        self._with_senders = itertools.cycle(zip(urls, layerwise.senders, strict=True)) if layerwise else None
        self._tasks: set[asyncio.Task[None]] = set()  # decode-first prefills being answered
        self.counts: Counter[str] = Counter()
        self._session: aiohttp.ClientSession | None = None
        self._throttle = Throttle()

    async def start(self, _app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=_TIMEOUT)

    async def stop(self, _app: web.Application) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
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
        if self._layerwise is not None and request.path == "/v1/completions":
            answer = await self._decode_first(request, body)
            if answer is not None:
                return answer
        params = await self._prefill(request.path, body)
        decode = dict(body)
        if params is not None:
            decode["kv_transfer_params"] = params
        return await self._forward(_Relay(request), f"{next(self._decodes)}{request.path}", decode)

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

    # -- decode-first, layer-wise ---------------------------------------------------------
    async def _decode_first(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse | None:
        """The completion with a ticket to the decode and the prefill at once; None when it
        goes the whole-request way instead (counted)."""
        assert self._layerwise is not None and self._with_senders is not None
        prefill, senders = next(self._with_senders)
        if len(self._tasks) >= MAX_LAYERWISE_PREFILLS:
            self.counts["layerwise_busy"] += 1
            return None
        tokens = await self._tokens(prefill, body)
        if tokens is None:
            return None
        lw = self._layerwise
        try:
            ticket = Handoff.issue(f"kvs-{uuid.uuid4().hex}", senders, tokens, len(tokens), lw.block_size,
                                   key=lw.key, lifetime_s=lw.lifetime_s, now=time.time(), ticket=True)
        except HandoffError as exc:  # an empty prompt, one past MAX_TOKENS
            self._local("layerwise_unusable", prefill, str(exc), event="proxy.whole_request")
            return None
        body = dict(body, prompt=tokens)  # both engines compute exactly the tokens signed
        decode = dict(body, kv_transfer_params=ticket.to_params())
        first = dict(body, max_tokens=1, stream=False, kv_transfer_params=ticket.to_prefill_params())
        first.pop("stream_options", None)
        url, relay = f"{next(self._decodes)}{request.path}", _Relay(request)
        forward = asyncio.ensure_future(self._forward(relay, url, decode))
        await asyncio.sleep(0)  # the decode's request goes out first: its expect may precede the KV
        task = asyncio.ensure_future(self._ticket_prefill(prefill, request.path, first, forward, relay, body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            await asyncio.wait({forward})
        finally:
            forward.cancel()  # this handler was cancelled: so is the decode's request
        if forward.cancelled() and relay.again is not None:  # _ticket_prefill ended it
            return await self._forward(relay, url, relay.again)
        return forward.result()

    async def _tokens(self, prefill: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids: as given, or the prefill's ``/tokenize`` of its text."""
        assert self._session is not None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            return list(prompt)
        if not isinstance(prompt, str):
            self._local("layerwise_unusable", prefill, "the prompt is not one text or one list of token ids",
                        event="proxy.whole_request")
            return None
        try:
            async with self._session.post(f"{prefill}/tokenize", json={"model": body.get("model"),
                                                                       "prompt": prompt}) as resp:
                status, answer = resp.status, await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self._local("layerwise_unusable", prefill, f"/tokenize: {exc!r}", event="proxy.whole_request")
            return None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if status != 200 or not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            self._local("layerwise_unusable", prefill, f"/tokenize: HTTP {status}: {_brief(answer)}",
                        event="proxy.whole_request")
            return None
        return tokens

    async def _ticket_prefill(self, prefill: str, path: str, body: dict[str, Any], forward: asyncio.Future[Any],
                              relay: _Relay, plain: dict[str, Any]) -> None:
        """The prefill's side of a decode-first completion (the decode answers the client).
        When the prefill refuses the ticket or fails the request, nothing will be written
        under the ticket's id and the decode's load would wait out its ``arrival_timeout_s``:
        if the decode has sent nothing yet, its request is ended here (``forward`` cancelled:
        its connection closed, vLLM aborts the request, its load is aborted and the prefill's
        kvservice drops the expect) and sent again, as ``relay.again``: with the prefill's own
        hand-off when it refused (it computed the request whole), else without one (the decode
        prefills it)."""
        assert self._session is not None
        handoff = None
        try:
            async with self._session.post(f"{prefill}{path}", json=body) as resp:
                status, raw = resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            kind, why = "layerwise_prefill_failed", repr(exc)
        else:
            try:
                answer = json.loads(raw)
            except ValueError:
                answer = raw.decode(errors="replace")
            if status != 200:
                kind, why = "layerwise_prefill_failed", f"HTTP {status}: {_brief(answer)}"
            elif isinstance(answer, dict) and isinstance(answer.get("kv_transfer_params"), dict):
                # the prefill did not take the ticket (its log says why) and handed off whole
                kind, why, handoff = "layerwise_refused", "the prefill answered with a hand-off", \
                    answer["kv_transfer_params"]
            else:
                self.counts["layerwise"] += 1
                return
        if forward.done() or relay.out is not None:
            then = "left to the decode: it had answered, or begun to, without the ticket's KV"
        else:
            relay.again = plain if handoff is None else dict(plain, kv_transfer_params=handoff)
            forward.cancel()
            then = ("the decode's request ended and sent again with the prefill's hand-off" if handoff is not None
                    else "the decode's request ended and sent again without a hand-off: the decode prefills it")
        self._local(kind, prefill, why, event="proxy.layerwise_failed", then=then)

    def _local(self, kind: str, prefill: str, why: str, event: str = "proxy.local_prefill", **fields: str) -> None:
        """Count (and log, rate-limited) a request the decode prefills itself."""
        self.counts[kind] += 1
        if (unlogged := self._throttle.allow(kind)) is not None:
            log.warning(event, kind=kind, prefill=prefill, why=why, unlogged=unlogged, **fields)

    async def _forward(self, relay: _Relay, url: str, body: dict[str, Any]) -> web.StreamResponse:
        """The decode's answer to ``body``, passed on to the client.  A stream's headers go
        to the client with its first chunk (``relay.out``): until then a decode-first
        request may be ended (cancelled) and sent again into the same ``relay``."""
        assert self._session is not None
        try:
            async with self._session.post(url, json=body) as resp:
                try:
                    if not body.get("stream"):
                        return web.Response(body=await resp.read(), status=resp.status,
                                            content_type=resp.content_type)
                    async for chunk in resp.content.iter_any():
                        await relay.write(chunk, resp)
                    return await relay.end(resp)
                except asyncio.CancelledError:
                    resp.close()  # not back to the pool: the decode sees its client gone and aborts
                    raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.counts["decode_unreachable"] += 1
            if (unlogged := self._throttle.allow("decode_unreachable")) is not None:
                log.warning("proxy.decode_unreachable", decode=url, why=repr(exc), unlogged=unlogged)
            if relay.out is not None:  # the client has part of a stream: it ends there
                return relay.out
            return web.json_response({"error": f"decode unreachable: {exc!r}"}, status=502)

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response(dict(self.counts))


def app(prefills: Sequence[str], decodes: Sequence[str], layerwise: Layerwise | None = None) -> web.Application:
    router = Router(prefills, decodes, layerwise)
    application = web.Application(client_max_size=64 * 1024 * 1024)
    application.on_startup.append(router.start)
    application.on_cleanup.append(router.stop)
    for route in ROUTES:
        application.router.add_post(route, router.handle)
    application.router.add_get("/health", router.health)
    application.router.add_get("/stats", router.stats)
    return application


async def serve(prefills: Sequence[str], decodes: Sequence[str], host: str, port: int,
                layerwise: Layerwise | None = None) -> None:
    """Serve until SIGTERM or SIGINT; ``proxy.listening`` once connections are accepted."""
    runner = web.AppRunner(app(prefills, decodes, layerwise), handle_signals=False,
                           access_log=None)  # no line per request
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, host, port).start()
        bound = [f"http://{_hostport(a)}" for a in runner.addresses]
        log.info("proxy.listening", address=bound[0] if len(bound) == 1 else bound, prefill=list(prefills),
                 decode=list(decodes), layerwise=layerwise is not None)
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
    parser.add_argument("--layerwise", action="store_true",
                        help="decode-first: the decode reserves the blocks, the prefill writes each layer as it "
                             "computes it (needs --key-file, --prefill-kvservice, --block-size)")
    parser.add_argument("--key-file", help="the cluster's key (the services' auth_key_file): tickets are signed "
                                           "under it")
    parser.add_argument("--prefill-kvservice", action="append", default=[],
                        help="a prefill's kvservice address(es), host:port[,host:port per TP rank], one per "
                             "--prefill, in order")
    parser.add_argument("--block-size", type=int, help="the engines' --block-size")
    parser.add_argument("--ticket-lifetime-s", type=float, default=30.0,
                        help="how long a ticket is valid (the prefill's bootstrap_timeout_s)")
    args = parser.parse_args(argv)
    layerwise = None
    if args.layerwise:
        if not args.key_file or args.block_size is None:
            parser.error("--layerwise needs --key-file, --prefill-kvservice and --block-size")
        try:
            layerwise = Layerwise.configured(args.key_file, args.prefill_kvservice, args.block_size,
                                             args.ticket_lifetime_s, len(args.prefill))
        except ValueError as exc:  # a ConfigError too (the key file)
            parser.error(str(exc))
    configure_logging(args.log_level)
    asyncio.run(serve(args.prefill, args.decode, args.host, args.port, layerwise))


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
