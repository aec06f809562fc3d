"""The proxy never forwards a client's own ``kv_transfer_params``: not to the prefill, and
not to the decode when the prefill failed or answered without a hand-off.  The proxy runs
as ``app()`` builds it, on a port; the prefill and the decode are two small HTTP servers
that answer as told and record every body they were sent (what reaches the engines is
the point here; the engines' own checks are test_vllm_engines.py's)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/engine-env.sh vllm builds its environment")

import aiohttp
from aiohttp import web
from structlog.testing import capture_logs

from kvservice._log import Throttle
from kvservice.integrations.vllm.proxy import app

from .engines import ROOT, engine_env, free_port

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


# -- what the proxy tells an operator: its log lines and GET /stats ----------------------------

def run_proxy(prefill: Upstream | None, decode: Upstream | None, bodies: list[dict[str, Any]]) -> tuple[list[int], Any]:
    """Each of ``bodies`` posted to a proxy in front of ``prefill`` and ``decode`` (None: a port
    nobody listens on): (the statuses the client got, the proxy's stats)."""
    async def main() -> tuple[list[int], Any]:
        p_port, d_port, x_port = free_port(), free_port(), free_port()
        runners = [await serve(upstream_app(up), port) for up, port in ((prefill, p_port), (decode, d_port))
                   if up is not None]
        runners.append(await serve(app([f"http://127.0.0.1:{p_port}"], [f"http://127.0.0.1:{d_port}"]), x_port))
        statuses = []
        try:
            async with aiohttp.ClientSession() as client:
                for body in bodies:
                    async with client.post(f"http://127.0.0.1:{x_port}/v1/completions", json=body) as resp:
                        await resp.read()
                        statuses.append(resp.status)
                async with client.get(f"http://127.0.0.1:{x_port}/stats") as resp:
                    return statuses, await resp.json()
        finally:
            for runner in reversed(runners):
                await runner.cleanup()

    return asyncio.run(main())


def decode_ok() -> Upstream:
    return Upstream(lambda _: web.json_response({"choices": [{"text": "ok"}]}))


@pytest.mark.parametrize(("prefill", "kind", "why"), [
    (Upstream(lambda _: web.Response(status=500, text="<html>boom</html>")), "prefill_failed", "HTTP 500: <html>boom"),
    (Upstream(lambda _: web.json_response({"error": {"message": "no such model"}}, status=404)), "prefill_failed",
     "HTTP 404: no such model"),
    (Upstream(answers(200, None)), "no_handoff", "no kv_transfer_params"),
    (None, "prefill_unreachable", "ClientConnectorError"),
])
def test_each_local_prefill_is_logged_with_why(prefill: Upstream | None, kind: str, why: str) -> None:
    with capture_logs() as logs:
        statuses, stats = run_proxy(prefill, decode_ok(), [{"model": "m", "prompt": [1]}])
    assert statuses == [200] and stats == {kind: 1}
    (line,) = [entry for entry in logs if entry["event"] == "proxy.local_prefill"]
    assert line["kind"] == kind and why in line["why"] and line["unlogged"] == 0, line
    assert line["prefill"].startswith("http://127.0.0.1:") and line["log_level"] == "warning"


def test_local_prefill_lines_are_rate_limited_per_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvservice.integrations.vllm.proxy as proxy

    monkeypatch.setattr(proxy, "Throttle", lambda: Throttle(burst=2, window_s=10.0, clock=lambda: 0.0))  # one window
    with capture_logs() as logs:
        statuses, stats = run_proxy(None, decode_ok(), [{"model": "m", "prompt": [1]}] * 5)
    assert statuses == [200] * 5 and stats == {"prefill_unreachable": 5}  # every one counted, and answered
    assert [e["unlogged"] for e in logs if e["event"] == "proxy.local_prefill"] == [0, 0]


def test_every_stats_key_happens_and_is_documented() -> None:
    """Every path the proxy counts, made to happen; the keys are the ones docs/vllm.md lists."""
    seen: dict[str, int] = {}
    with capture_logs() as logs:
        for prefill, decode, body in [
                (Upstream(answers(200, PREFILL_HANDOFF)), decode_ok(), BODY),  # handed_off, client_params_dropped
                (Upstream(answers(503, None)), decode_ok(), {"prompt": [1]}),  # prefill_failed
                (None, decode_ok(), {"prompt": [1]}),  # prefill_unreachable
                (Upstream(answers(200, None)), decode_ok(), {"prompt": [1]}),  # no_handoff
                (Upstream(answers(200, PREFILL_HANDOFF)), None, {"prompt": [1]})]:  # decode_unreachable
            statuses, stats = run_proxy(prefill, decode, [body])
            assert statuses == [502 if decode is None else 200]
            for key, n in stats.items():
                seen[key] = seen.get(key, 0) + n
    assert seen == {"handed_off": 2, "client_params_dropped": 1, "prefill_failed": 1, "prefill_unreachable": 1,
                    "no_handoff": 1, "decode_unreachable": 1}
    assert [e["decode"] for e in logs if e["event"] == "proxy.decode_unreachable"] != []
    # the decode-first keys: test_vllm_proxy_layerwise.py
    assert set(seen) == {k for k in documented_stats_keys() if not k.startswith("layerwise")}


def documented_stats_keys() -> set[str]:
    """The keys of the proxy's ``GET /stats`` table in docs/vllm.md."""
    text = (ROOT / "docs" / "vllm.md").read_text()
    table = text.split("<!-- proxy-stats -->")[1].split("<!-- /proxy-stats -->")[0]
    return {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}


def test_the_proxy_says_where_it_listens_and_stops_on_sigterm() -> None:
    """As an operator starts it: ``python -m kvservice.integrations.vllm.proxy``, its lines on
    stderr (JSON when not a terminal)."""
    port = free_port()
    prefill, decode = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "kvservice.integrations.vllm.proxy", "--prefill", prefill,
                             "--decode", decode, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=engine_env(0), cwd=ROOT)
    try:
        assert proc.stderr is not None
        first = json.loads(proc.stderr.readline())  # blocks until it listens (or exits: then b"" fails)
        assert first["event"] == "proxy.listening" and first["level"] == "info", first
        assert first["address"] == f"http://127.0.0.1:{port}"
        assert first["prefill"] == [prefill] and first["decode"] == [decode]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as resp:
            assert json.loads(resp.read()) == {"ok": True}
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert [json.loads(line)["event"] for line in err.decode().splitlines()] == ["proxy.stopped"]
    assert out == b""
