"""The proxy's decode-first, layer-wise path (``--layerwise``) in front of recording stand-ins:
the ticket it signs reaches the decode and the prefill, both with the token ids it signs, and
verifies under the cluster's key as a hand-off does; each way it can go is counted.  A
prefill that refuses the ticket or fails ends the decode's wait at once: in front of
stand-ins, then of two vLLM servers (the client's tokens one engine's, nothing held after)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/engine-env.sh vllm builds its environment")

import aiohttp
from aiohttp import web
from structlog.testing import capture_logs

from kvservice._trust.handoff import handoff_key
from kvservice._trust.keys import load_key
from kvservice.integrations.vllm.params import handoff_from, ticket_from
from kvservice.integrations.vllm.proxy import Layerwise, app
from tests.helpers import eventually_sync

from .engines import MAX_TOKENS, free_port, http, kill_group
from .test_vllm_proxy import PREFILL_HANDOFF, Upstream, answers, documented_stats_keys, serve
from .test_vllm_serve import counted

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


# -- the same, with two vLLM servers ---------------------------------------------------------

#: a request through the proxy fails past this: the decode's wait the proxy ends would have
#: lasted its arrival_timeout_s (120 s)
HANG_S = 60.0


def tokens_of(url: str, model: Path, prompt: list[int], *, stream: bool) -> list[int]:
    """A greedy completion's token ids through the proxy, at most ``HANG_S``; streamed: every
    chunk's, in order (a chunk twice, or one of an answer cut off, would show)."""
    body = {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "return_token_ids": True, "stream": stream}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=HANG_S) as resp:
        if not stream:
            return list(json.loads(resp.read())["choices"][0]["token_ids"])
        tokens, done = [], False
        for raw in resp:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                tokens += [t for choice in json.loads(line[6:])["choices"] for t in choice.get("token_ids") or ()]
        assert done, "the stream ended without [DONE]"
        return tokens


def kv_usage(url: str) -> float:
    """The server's ``vllm:kv_cache_usage_perc``: 0 once every block is free."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "vllm:kv_cache_usage_perc")


def timed(front: str, model: Path, prompts: list[list[int]], streamed: set[int]) -> tuple[list[list[int]], list[float]]:
    got, took = [], []
    for i, prompt in enumerate(prompts):
        started = time.monotonic()
        got.append(tokens_of(front, model, prompt, stream=i in streamed))
        took.append(round(time.monotonic() - started, 2))
    print(f"seconds per request: {took}")
    return got, took


def settled_counts(url: str, ok: Any) -> dict[str, int]:
    """The server's connector counts once ``ok(counts)`` holds (vLLM's stat loggers get them
    with the engine's outputs) and its blocks are all free."""
    eventually_sync(lambda: ok(counted(url)) and kv_usage(url) == 0, 60, 0.5,
                    what=lambda: f"{url}: {counted(url)}, KV cache usage {kv_usage(url)}")
    return counted(url)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ticket_the_prefill_refuses_is_served_at_once_with_its_handoff(
        servers: Any, model: Path, prompts: list[list[int]], baseline: list[list[int]], key_file: Path) -> None:
    """The proxy names the prefill's kvservice ``localhost:PORT`` where the prefill says
    ``127.0.0.1:PORT`` (a misconfigured ``--prefill-kvservice``): the decode's expect reaches
    the prefill's kvservice, the prefill refuses the ticket (``handoff_unusable``: not its
    senders) and hands off whole.  The proxy ends the decode's request and sends it again with
    that hand-off: loaded, the prefill's blocks freed, the tokens one engine's."""
    vllm, proxy = servers
    kv_port = free_port()
    prefill, _ = vllm("prefill", "kv_producer", 0, port=kv_port, auth_key_file=str(key_file))
    decode, _ = vllm("decode", "kv_consumer", 1, auth_key_file=str(key_file))
    front = proxy(prefill, decode, "--layerwise", "--key-file", str(key_file), "--prefill-kvservice",
                  f"localhost:{kv_port}", "--block-size", "32")
    got, _ = timed(front, model, prompts, streamed={0, 2})
    assert got == baseline
    n = len(prompts)
    assert http(f"{front}/stats") == {"layerwise_refused": n}
    ps = settled_counts(prefill, lambda c: c.get("handoffs_freed") == n)
    assert ps == {"handoff_unusable": n, "handoffs": n, "handoffs_freed": n, "sends_ok": n}, ps
    ds = settled_counts(decode, lambda c: c.get("loads_ok") == n)
    # each ticket's load (its expect held at the prefill) aborted with its request, then the
    # hand-off's loaded; no load waited for its arrival_timeout_s (each request took < HANG_S)
    assert ds["loads"] > n and ds["load_failed"] == ds["loads_abandoned"] == ds["loads"] - n, ds
    assert set(ds) == {"loads", "loads_ok", "load_failed", "loads_abandoned"}, ds


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_prefill_that_fails_or_is_gone_costs_the_decode_no_wait(
        servers: Any, model: Path, prompts: list[list[int]], baseline: list[list[int]], key_file: Path) -> None:
    """The prefill server answers HTTP 400 to prompts past its ``--max-model-len`` (50 tokens;
    the decode takes 1024) while its kvservice holds the decode's expect; then it is killed.
    The proxy ends the decode's request and sends it again without a hand-off: the decode
    prefills it, its tokens one engine's."""
    vllm, proxy = servers
    kv_port = free_port()
    prefill, p_proc = vllm("prefill", "kv_producer", 0, "--max-model-len", "50", port=kv_port,
                           auth_key_file=str(key_file))
    decode, _ = vllm("decode", "kv_consumer", 1, auth_key_file=str(key_file))
    front = proxy(prefill, decode, "--layerwise", "--key-file", str(key_file), "--prefill-kvservice",
                  f"127.0.0.1:{kv_port}", "--block-size", "32")
    assert len(prompts[0]) < 50 <= min(len(p) for p in prompts[1:])
    got, _ = timed(front, model, prompts, streamed={1})
    assert got == baseline
    failed = len(prompts) - 1
    eventually_sync(lambda: http(f"{front}/stats") == {"layerwise": 1, "layerwise_prefill_failed": failed}, 30, 0.5,
                    what=lambda: str(http(f"{front}/stats")))
    ps = settled_counts(prefill, lambda c: c.get("handoffs_freed") == 1)
    assert ps == {"layerwise": 1, "handoffs_freed": 1, "sends_ok": 1}, ps  # the others never reached its engine
    ds = settled_counts(decode, lambda c: c.get("loads_ok") == 1)
    # A failed prompt's decode request ends when the prefill's answer comes back: a load it had
    # started is aborted with it; one it had not started yet (the prefill's HTTP 400 came back
    # before the decode scheduled the request, as on a busy host) never starts. Either way no
    # load is left waiting (settled_counts: every block free).
    assert ds["loads_ok"] == 1 and ds.get("load_failed", 0) == ds.get("loads_abandoned", 0) == ds["loads"] - 1, ds

    kill_group(p_proc)  # the prefill server is gone, its kvservice with it
    p_proc.wait(timeout=30)
    got, _ = timed(front, model, prompts[:1], streamed=set())
    assert got == baseline[:1]
    assert http(f"{front}/stats") == {"layerwise": 1, "layerwise_prefill_failed": failed + 1}
    eventually_sync(lambda: kv_usage(decode) == 0, 60, 0.5, what=lambda: f"KV cache usage {kv_usage(decode)}")
