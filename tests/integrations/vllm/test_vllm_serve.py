"""The way docs/vllm.md runs it: two ``vllm.entrypoints.openai.api_server`` processes with
``--kv-transfer-config`` naming the connector, and ``kvservice.integrations.vllm.proxy``
in front; a client's completions through the proxy equal one engine's, a hand-off the
client wrote itself goes nowhere, and a prefill server that is gone costs the client
nothing (the decode prefills by itself)."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/engine-env.sh vllm builds its environment")

from kvservice._trust.keys import generate_key
from tests.helpers import eventually_sync

from .engines import MAX_TOKENS, free_port, http, kill_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def scrape(url: str) -> dict[str, float]:
    """A server's ``/metrics``, the ``vllm:kvservice_*`` samples: ``events:<event>`` for the
    counter by event, else the sample's name (labels left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:kvservice_events_total":
                out[f"events:{sample.labels['event']}"] = sample.value
            elif sample.name.startswith("vllm:kvservice_") and not sample.name.endswith("_created"):
                if "le" not in sample.labels:
                    out[sample.name] = sample.value
    return out


def counted(url: str) -> dict[str, int]:
    return {k.removeprefix("events:"): int(v) for k, v in scrape(url).items() if k.startswith("events:")}


def complete(url: str, model: Path, prompt: list[int], **extra: Any) -> list[int]:
    answer = http(f"{url}/v1/completions", {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS,
                                           "temperature": 0.0, "return_token_ids": True, **extra})
    return list(answer["choices"][0]["token_ids"])


def test_two_vllm_servers_and_the_proxy_answer_as_one_engine(
        servers: Any, model: Path, prompts: list[list[int]], baseline: list[list[int]]) -> None:
    vllm, proxy = servers
    prefill, p_proc = vllm("serve-prefill", "kv_producer", 0, port=free_port())
    decode, _ = vllm("serve-decode", "kv_consumer", 1)
    front = proxy(prefill, decode)
    assert [complete(front, model, prompt) for prompt in prompts] == baseline
    assert http(f"{front}/stats") == {"handed_off": len(prompts)}
    # each server's own /metrics has the connector's counts and transfer times (vLLM's stat
    # loggers get them with the engine's outputs: awaited, then exact)
    n = len(prompts)
    eventually_sync(lambda: counted(prefill).get("handoffs_freed") == n, 60, 0.5, what=lambda: str(scrape(prefill)))
    eventually_sync(lambda: counted(decode).get("loads_ok") == n, 60, 0.5, what=lambda: str(scrape(decode)))
    assert counted(prefill) == {"handoffs": n, "handoffs_freed": n, "sends_ok": n}
    assert counted(decode) == {"loads": n, "loads_ok": n}
    sent, loaded = scrape(prefill), scrape(decode)
    assert sent["vllm:kvservice_send_time_seconds_count"] == loaded["vllm:kvservice_load_time_seconds_count"] == n
    assert sent["vllm:kvservice_send_bytes_sum"] == loaded["vllm:kvservice_load_bytes_sum"] > 0

    # a client's own hand-off, naming a sender of its choosing, reaches neither server: the
    # proxy drops it, the prefill hands off as ever, and the tokens are still one engine's
    forged = {"do_remote_prefill": True, "kvservice": {
        "request": "victim", "senders": [f"127.0.0.1:{free_port()}"], "num_tokens": len(prompts[0]),
        "block_size": 32, "expires": int(time.time()) + 30, "prompt": "0" * 64, "mac": "0" * 64}}
    assert complete(front, model, prompts[0], kv_transfer_params=forged) == baseline[0]
    assert http(f"{front}/stats") == {"handed_off": len(prompts) + 1, "client_params_dropped": 1}

    kill_group(p_proc)  # the prefill server is gone (and its engine): the client still gets its tokens
    p_proc.wait(timeout=30)
    assert complete(front, model, prompts[0]) == baseline[0]
    assert http(f"{front}/stats") == {"handed_off": len(prompts) + 1, "prefill_unreachable": 1,
                                      "client_params_dropped": 1}


def test_the_layerwise_proxy_and_two_vllm_servers_answer_as_one_engine(
        servers: Any, model: Path, prompts: list[list[int]], baseline: list[list[int]], tmp_path: Path) -> None:
    """``--layerwise`` as docs/vllm.md "Layer-wise push" runs it: each completion written layer
    by layer by the prefill into the blocks the decode reserved first."""
    key = tmp_path / "key"
    generate_key(key)
    vllm, proxy = servers
    kv_port = free_port()
    prefill, _ = vllm("lw-serve-prefill", "kv_producer", 0, port=kv_port, auth_key_file=str(key))
    decode, _ = vllm("lw-serve-decode", "kv_consumer", 1, auth_key_file=str(key))
    front = proxy(prefill, decode, "--layerwise", "--key-file", str(key), "--prefill-kvservice",
                  f"127.0.0.1:{kv_port}", "--block-size", "32")
    assert [complete(front, model, prompt) for prompt in prompts] == baseline
    n = len(prompts)
    eventually_sync(lambda: http(f"{front}/stats").get("layerwise") == n, 60, 0.5,
                    what=lambda: str(http(f"{front}/stats")))
    assert http(f"{front}/stats") == {"layerwise": n}
    eventually_sync(lambda: counted(prefill).get("handoffs_freed") == n, 60, 0.5, what=lambda: str(scrape(prefill)))
    eventually_sync(lambda: counted(decode).get("loads_ok") == n, 60, 0.5, what=lambda: str(scrape(decode)))
    assert counted(prefill) == {"layerwise": n, "handoffs_freed": n, "sends_ok": n}
    assert counted(decode) == {"loads": n, "loads_ok": n}
