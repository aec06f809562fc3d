"""The proxy's decode-first, layer-wise path (``--layerwise``) in front of recording stand-ins:
the ticket it signs reaches the decode and the prefill, both with the token ids it signs, and
verifies under the cluster's key as a hand-off does; each way it can go is counted."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/engine-env.sh vllm builds its environment")

import aiohttp
from aiohttp import web
from structlog.testing import capture_logs

from kvservice._trust.handoff import handoff_key
from kvservice._trust.keys import generate_key, load_key
from kvservice.integrations.vllm.params import handoff_from, ticket_from
from kvservice.integrations.vllm.proxy import Layerwise, app

from .engines import free_port
from .test_vllm_proxy import PREFILL_HANDOFF, Upstream, answers, documented_stats_keys, serve

TOKENS = [5, 6, 7, 8]
SENDERS = "127.0.0.1:7100"


def prefill_app(completions: Upstream, tokenize: Upstream | None = None) -> web.Application:
    tokenize = tokenize or Upstream(lambda _: web.json_response({"tokens": TOKENS, "count": len(TOKENS)}))
    application = web.Application()
    application.router.add_post("/v1/completions", completions.handle)
    application.router.add_post("/tokenize", tokenize.handle)
    return application


def decode_app(decode: Any) -> web.Application:
    application = web.Application()
    application.router.add_post("/v1/completions", decode.handle)
    return application


def run(key_file: Path, prefill: Upstream, bodies: list[dict[str, Any]], *, tokenize: Upstream | None = None,
        want: int = 1, decode: Any = None, texts: list[bytes] | None = None) -> tuple[Any, list[int], dict[str, int]]:
    """Each of ``bodies`` through a ``--layerwise`` proxy: (the decode, the statuses, the stats
    once ``want`` counts are in, within 10 s).  ``decode``: the decode's front (an object with
    ``handle``; default: an ``Upstream`` answering at once); ``texts``: the answers' bodies."""
    decode = decode or Upstream(lambda _: web.json_response({"choices": [{"text": "ok"}]}))
    layerwise = Layerwise.configured(str(key_file), [SENDERS], 32, 30.0, prefills=1)

    async def main() -> tuple[list[int], dict[str, int]]:
        p_port, d_port, x_port = free_port(), free_port(), free_port()
        runners = [await serve(decode_app(decode), d_port), await serve(prefill_app(prefill, tokenize), p_port),
                   await serve(app([f"http://127.0.0.1:{p_port}"], [f"http://127.0.0.1:{d_port}"], layerwise),
                               x_port)]
        try:
            statuses = []
            async with aiohttp.ClientSession() as client:
                for body in bodies:
                    async with client.post(f"http://127.0.0.1:{x_port}/v1/completions", json=body) as resp:
                        statuses.append(resp.status)
                        text = await resp.read()
                        if texts is not None:
                            texts.append(text)
                stats: dict[str, int] = {}
                deadline = time.monotonic() + 10
                while sum(stats.values()) < want and time.monotonic() < deadline:  # the prefill's answer
                    async with client.get(f"http://127.0.0.1:{x_port}/stats") as resp:
                        stats = await resp.json()
                    await asyncio.sleep(0.05)
            return statuses, stats
        finally:
            for runner in reversed(runners):
                await runner.cleanup()

    statuses, stats = asyncio.run(main())
    return decode, statuses, stats


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "key"
    generate_key(path)
    return path


def test_the_ticket_reaches_both_engines_with_the_tokens_it_signs(key_file: Path) -> None:
    prefill = Upstream(answers(200, None))
    decode, statuses, stats = run(key_file, prefill, [{"model": "m", "prompt": "four tokens here", "max_tokens": 8}])
    assert statuses == [200] and stats == {"layerwise": 1}
    (to_decode,) = decode.bodies
    (to_prefill,) = prefill.bodies
    assert to_decode["prompt"] == to_prefill["prompt"] == TOKENS
    assert to_decode["max_tokens"] == 8 and to_prefill["max_tokens"] == 1 and to_prefill["stream"] is False
    ticket = handoff_from(to_decode["kv_transfer_params"])
    assert ticket is not None and ticket.ticket and ticket.senders == (SENDERS,) and ticket.num_tokens == 4
    assert ticket_from(to_prefill["kv_transfer_params"]) == ticket
    ticket.check(handoff_key(load_key(key_file)), now=time.time(), skew_s=0, tokens=TOKENS)  # proved


def test_every_layerwise_stats_key_happens_and_is_documented(key_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, int] = {}
    cases: list[tuple[Upstream, dict[str, Any], Upstream | None]] = [
        (Upstream(answers(200, None)), {"prompt": TOKENS}, None),  # layerwise (token ids: no /tokenize)
        (Upstream(answers(200, PREFILL_HANDOFF)), {"prompt": "x"}, None),  # layerwise_refused
        (Upstream(answers(500, None)), {"prompt": "x"}, None),  # layerwise_prefill_failed
        (Upstream(answers(200, PREFILL_HANDOFF)), {"prompt": ["a", "b"]}, None),  # unusable, then handed_off
        (Upstream(answers(200, PREFILL_HANDOFF)), {"prompt": "x"},  # unusable (no /tokenize), then handed_off
         Upstream(lambda _: web.json_response({"error": "no"}, status=404))),
    ]
    for prefill, body, tokenize in cases:
        _, statuses, stats = run(key_file, prefill, [body], tokenize=tokenize,
                                 want=2 if body["prompt"] in (["a", "b"],) or tokenize else 1)
        assert statuses == [200]
        for key, n in stats.items():
            seen[key] = seen.get(key, 0) + n
    import kvservice.integrations.vllm.proxy as proxy

    monkeypatch.setattr(proxy, "MAX_LAYERWISE_PREFILLS", 0)
    _, statuses, stats = run(key_file, Upstream(answers(200, PREFILL_HANDOFF)), [{"prompt": TOKENS}], want=2)
    for key, n in stats.items():
        seen[key] = seen.get(key, 0) + n
    assert seen == {"layerwise": 1, "layerwise_refused": 1, "layerwise_prefill_failed": 1, "layerwise_unusable": 2,
                    "layerwise_busy": 1, "handed_off": 3}
    assert {k for k in seen if k.startswith("layerwise")} == {k for k in documented_stats_keys()
                                                              if k.startswith("layerwise")}


def test_bad_layerwise_options_are_named(key_file: Path) -> None:
    with pytest.raises(ValueError, match="one per --prefill"):
        Layerwise.configured(str(key_file), [], 32, 30.0, prefills=1)
    with pytest.raises(ValueError, match="--prefill-kvservice"):
        Layerwise.configured(str(key_file), ["nohost"], 32, 30.0, prefills=1)
    with pytest.raises(ValueError, match="--block-size"):
        Layerwise.configured(str(key_file), [SENDERS], 0, 30.0, prefills=1)
    with pytest.raises(ValueError, match="--key-file"):
        Layerwise.configured(str(key_file.with_name("absent")), [SENDERS], 32, 30.0, prefills=1)


# -- the prefill refuses the ticket or fails: the decode's wait ends at once -----------------

class WaitingDecode:
    """A decode's front as vLLM's server behaves with a ticket: a stream's headers at once, then
    nothing until the KV is there (here: until its client goes, which it records, or 20 s);
    with ``early`` a stream's first chunk at once (a decode that went on without the KV) and
    the rest 0.5 s later.  Any other request is answered at once, streamed when asked."""

    def __init__(self, early: bool = False) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.gone: list[dict[str, Any]] = []  # ticket requests whose client went
        self.early = early

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        ticket = (body.get("kv_transfer_params") or {}).get("kvservice", {}).get("ticket")
        stream: web.StreamResponse | None = None
        if body.get("stream"):
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
        if ticket and not self.early:
            for _ in range(2000):  # its client's connection, every 10 ms for 20 s
                if request.transport is None or request.transport.is_closing():
                    break
                await asyncio.sleep(0.01)
            self.gone.append(body)
            return stream or web.json_response({"choices": [{"text": "late"}]})
        if stream is None:
            return web.json_response({"choices": [{"text": "ok"}]})
        await stream.write(b'data: {"choices": [{"text": "o"}]}\n\n')
        if self.early:
            await asyncio.sleep(0.5)
        await stream.write(b'data: {"choices": [{"text": "k"}]}\n\ndata: [DONE]\n\n')
        return stream


OK_STREAM = b'data: {"choices": [{"text": "o"}]}\n\ndata: {"choices": [{"text": "k"}]}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("prefill", "kind", "again"), [
    (Upstream(answers(500, None)), "layerwise_prefill_failed", None),  # the decode prefills it
    (Upstream(answers(200, PREFILL_HANDOFF)), "layerwise_refused", PREFILL_HANDOFF),  # loads the whole hand-off
])
def test_a_prefill_that_refuses_or_fails_ends_the_decodes_wait_at_once(
        key_file: Path, prefill: Upstream, kind: str, again: dict[str, Any] | None, stream: bool) -> None:
    decode, texts = WaitingDecode(), []
    started = time.monotonic()
    with capture_logs() as logs:
        _, statuses, stats = run(key_file, prefill, [{"model": "m", "prompt": TOKENS, "max_tokens": 8,
                                                      "stream": stream}], decode=decode, texts=texts)
    assert time.monotonic() - started < 10, "ended at once, not after the decode's wait (20 s here)"
    assert statuses == [200] and stats == {kind: 1}
    assert texts == [OK_STREAM if stream else b'{"choices": [{"text": "ok"}]}']  # the second answer, whole, once
    first, second = decode.bodies
    assert decode.gone == [first] and handoff_from(first["kv_transfer_params"]).ticket  # type: ignore[union-attr]
    assert second.get("kv_transfer_params") == again  # and nothing else changed
    assert {k: v for k, v in second.items() if k != "kv_transfer_params"} == \
        {k: v for k, v in first.items() if k != "kv_transfer_params"}
    assert second["prompt"] == TOKENS and second["stream"] is stream
    (line,) = [e for e in logs if e["event"] == "proxy.layerwise_failed"]
    assert line["kind"] == kind and line["then"].startswith("the decode's request ended and sent again"), line


def test_a_decode_that_began_to_answer_is_left_to_finish(key_file: Path) -> None:
    """The prefill fails once the decode has streamed a first chunk (it went on without the
    ticket's KV): the client gets that answer, whole and once."""
    decode, texts = WaitingDecode(early=True), []
    with capture_logs() as logs:
        _, statuses, stats = run(key_file, Upstream(answers(500, None)),
                                 [{"model": "m", "prompt": TOKENS, "stream": True}], decode=decode, texts=texts)
    assert statuses == [200] and stats == {"layerwise_prefill_failed": 1}
    assert texts == [OK_STREAM] and len(decode.bodies) == 1 and decode.gone == []
    (line,) = [e for e in logs if e["event"] == "proxy.layerwise_failed"]
    assert line["then"].startswith("left to the decode"), line
