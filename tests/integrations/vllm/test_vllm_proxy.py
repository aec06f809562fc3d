"""The proxy never forwards a client's own ``kv_transfer_params``: not to the prefill, and
not to the decode when the prefill failed or answered without a hand-off.  The proxy runs
as ``app()`` builds it, on a port; the prefill and the decode are two small HTTP servers
that answer as told and record every body they were sent (what reaches the engines is
the point here; the engines' own checks are test_vllm_engines.py's)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/engine-env.sh vllm builds its environment")

import aiohttp
from aiohttp import web

from kvservice.integrations.vllm.proxy import app

from .engines import free_port

#: a hand-off a client wrote itself: a decode that took it would dial this address
CLIENT_HANDOFF = {"do_remote_prefill": True, "kvservice": {
    "request": "victim", "senders": ["10.6.6.6:7100"], "num_tokens": 64, "block_size": 32,
    "expires": 4_000_000_000, "prompt": "0" * 64, "mac": "0" * 64}}
PREFILL_HANDOFF = {"do_remote_prefill": True, "do_remote_decode": False, "kvservice": {"request": "from-prefill"}}


class Upstream:
    """An engine's HTTP front that records what it is sent and answers ``answer(body)``."""

    def __init__(self, answer: Callable[[dict[str, Any]], web.Response]) -> None:
        self.bodies: list[dict[str, Any]] = []
        self._answer = answer

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        return self._answer(body)


async def serve(application: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(application)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def upstream_app(upstream: Upstream) -> web.Application:
    application = web.Application()
    application.router.add_post("/v1/completions", upstream.handle)
    return application


def through_proxy(prefill: Upstream | None, body: dict[str, Any]) -> tuple[Upstream, dict[str, Any], Any]:
    """``body`` posted to a proxy in front of ``prefill`` (None: a port nobody listens on) and a
    decode that answers 200: (the decode, its answer as the client got it, the proxy's stats)."""
    decode = Upstream(lambda _: web.json_response({"choices": [{"text": "ok"}]}))

    async def main() -> tuple[dict[str, Any], Any]:
        p_port, d_port, x_port = free_port(), free_port(), free_port()
        runners = [await serve(upstream_app(decode), d_port)]
        if prefill is not None:
            runners.append(await serve(upstream_app(prefill), p_port))
        runners.append(await serve(app([f"http://127.0.0.1:{p_port}"], [f"http://127.0.0.1:{d_port}"]), x_port))
        try:
            async with aiohttp.ClientSession() as client:
                async with client.post(f"http://127.0.0.1:{x_port}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    answer = await resp.json()
                async with client.get(f"http://127.0.0.1:{x_port}/stats") as resp:
                    stats = await resp.json()
            return answer, stats
        finally:
            for runner in reversed(runners):
                await runner.cleanup()

    answer, stats = asyncio.run(main())
    return decode, answer, stats


def answers(status: int, params: Any) -> Callable[[dict[str, Any]], web.Response]:
    return lambda _: web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params}, status=status)


BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "kv_transfer_params": CLIENT_HANDOFF,
        "vllm_xargs": {"kv_transfer_params": json.dumps(CLIENT_HANDOFF), "other": 1}}



@pytest.mark.parametrize(("prefill", "went"), [
    (Upstream(answers(500, CLIENT_HANDOFF)), "prefill_failed"),  # echoes the client's hand-off, and fails
    (Upstream(answers(200, None)), "no_handoff"),
    (Upstream(answers(200, "not an object")), "no_handoff"),
    (None, "prefill_unreachable"),
])
def test_a_clients_handoff_never_reaches_the_decode(prefill: Upstream | None, went: str) -> None:
    decode, answer, stats = through_proxy(prefill, BODY)
    (sent,) = decode.bodies
    assert "kv_transfer_params" not in sent and sent["vllm_xargs"] == {"other": 1}
    assert {k: v for k, v in sent.items() if k not in ("kv_transfer_params", "vllm_xargs")} == \
        {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8}
    assert answer == {"choices": [{"text": "ok"}]}
    assert stats == {went: 1, "client_params_dropped": 1}
    if prefill is not None:  # the prefill was asked for a hand-off, and nothing of the client's
        (asked,) = prefill.bodies
        assert asked["kv_transfer_params"] == {"do_remote_decode": True} and asked["vllm_xargs"] == {"other": 1}


def test_the_decode_gets_the_prefills_handoff_not_the_clients() -> None:
    prefill = Upstream(answers(200, PREFILL_HANDOFF))
    decode, _, stats = through_proxy(prefill, BODY)
    (sent,) = decode.bodies
    assert sent["kv_transfer_params"] == PREFILL_HANDOFF and sent["vllm_xargs"] == {"other": 1}
    assert stats == {"handed_off": 1, "client_params_dropped": 1}
    # a client that sent none: nothing dropped, the body otherwise as sent
    decode, _, stats = through_proxy(Upstream(answers(200, PREFILL_HANDOFF)), {"model": "m", "prompt": [1]})
    assert decode.bodies == [{"model": "m", "prompt": [1], "kv_transfer_params": PREFILL_HANDOFF}]
    assert stats == {"handed_off": 1}
