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


def decode_app(decode: Upstream) -> web.Application:
    application = web.Application()
    application.router.add_post("/v1/completions", decode.handle)
    return application


def run(key_file: Path, prefill: Upstream, bodies: list[dict[str, Any]], *, tokenize: Upstream | None = None,
        want: int = 1) -> tuple[Upstream, list[int], dict[str, int]]:
    """Each of ``bodies`` through a ``--layerwise`` proxy: (the decode, the statuses, the stats
    once ``want`` counts are in, within 10 s)."""
    decode = Upstream(lambda _: web.json_response({"choices": [{"text": "ok"}]}))
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
