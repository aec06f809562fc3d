"""The way docs/vllm.md runs it: two ``vllm.entrypoints.openai.api_server`` processes with
``--kv-transfer-config`` naming the connector, and ``kvservice.integrations.vllm.proxy``
in front; a client's completions through the proxy equal one engine's, a hand-off the
client wrote itself goes nowhere, and a prefill server that is gone costs the client
nothing (the decode prefills by itself)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/engine-env.sh vllm builds its environment")

from kvservice._trust.keys import generate_key
from tests.helpers import eventually_sync

from .engines import MAX_TOKENS, ROOT, engine_env, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

#: the engine flags of docs/vllm.md, sized for a test on a CPU
ENGINE_FLAGS = ["--dtype", "float32", "--block-size", "32", "--no-enable-prefix-caching",
                "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager", "--distributed-executor-backend", "uni",
                "--skip-tokenizer-init", "--max-model-len", "1024"]


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 180.0) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited (rc={proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    eventually_sync(up, timeout, 0.5, what=f"{url} up")


@pytest.fixture
def servers(model: Path, logs: Path) -> Iterator[Any]:
    procs: list[tuple[subprocess.Popen[bytes], Any]] = []

    def start(name: str, args: list[str], cpu: int, health: str) -> subprocess.Popen[bytes]:
        out = open(logs / f"{name}.log", "wb")  # closed at teardown
        # a session of its own: vLLM's server runs its engine in a child process, and a server
        # "SIGKILLed" is its whole group (as when its container dies), never an orphaned engine
        proc = subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT,
                                env=engine_env(cpu), cwd=ROOT, start_new_session=True)
        procs.append((proc, out))
        wait_up(health, proc)
        return proc

    def vllm(name: str, role: str, cpu: int, **service: Any) -> tuple[str, subprocess.Popen[bytes]]:
        port = free_port()
        config = {"kv_connector": "KVServiceConnector", "kv_connector_module_path": "kvservice.integrations.vllm",
                  "kv_role": role, "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"kvservice": service}}
        url = f"http://127.0.0.1:{port}"
        proc = start(name, ["vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
                            "--port", str(port), *ENGINE_FLAGS, "--kv-transfer-config", json.dumps(config)],
                     cpu, f"{url}/health")
        return url, proc

    def proxy(prefill: str, decode: str, *options: str) -> str:
        port = free_port()
        start("proxy", ["kvservice.integrations.vllm.proxy", "--prefill", prefill, "--decode", decode,
                        "--port", str(port), *options], 0, f"http://127.0.0.1:{port}/health")
        return f"http://127.0.0.1:{port}"

    yield vllm, proxy
    for proc, out in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        kill_group(proc)  # whatever the server left behind (its engine process)
        out.close()


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s process group (its session, started for it), by its id."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
