"""vLLM's tests run in vLLM's own environment (scripts/engine-env.sh vllm).  vLLM, torch and
transformers warn about their own deprecations on import and as they run; the suite's
``filterwarnings = error`` stays on for kvservice's code and the tests' own."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .engines import ENGINE_FLAGS, MAX_TOKENS, ROOT, Engine, engine_env, free_port, kill_group, make_model, wait_up

_THEIRS = r"(vllm|torch|transformers|triton|huggingface_hub|safetensors)(\..*)?"

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
        import vllm.config
        import vllm.v1.core.sched.scheduler  # noqa: F401
    except ImportError:
        pass


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "integrations/vllm" in str(item.path):
            item.add_marker(pytest.mark.filterwarnings(f"ignore:::{_THEIRS}"))


#: prompts longer than one block (32 tokens), none a whole number of blocks but one
LENGTHS = (45, 70, 100, 64)


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test model: seeded random weights (``engine_proc.MODEL``), written once."""
    path = tmp_path_factory.mktemp("model")
    make_model(path)
    return path


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(1, 1000) for _ in range(n)] for n in LENGTHS]


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    """The engines' stderr, one file per engine (kvservice logs at INFO there), in the test's
    own directory: a test's engine logs are never overwritten by the next test's."""
    path = tmp_path / "engine-logs"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def baseline(model: Path, prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """One engine, no connector: the tokens every disaggregated run must reproduce."""
    engine = Engine("baseline", model, cpu=0, log_dir=tmp_path_factory.mktemp("baseline-log"))
    try:
        for i, prompt in enumerate(prompts):
            engine.generate(f"b{i}", prompt, MAX_TOKENS)
        return [engine.result(f"b{i}")["tokens"] for i in range(len(prompts))]
    finally:
        engine.stop()


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    """The cluster's key, as ``auth_key_file``: one per test."""
    from kvservice._trust.keys import generate_key

    path = tmp_path / "key"
    generate_key(path)
    return path


@pytest.fixture
def servers(model: Path, logs: Path) -> Iterator[Any]:
    """``(vllm, proxy)``: start vLLM's OpenAI server with the connector, and the proxy, as
    processes (docs/vllm.md "Run"); each is stopped at teardown, with whatever it left."""
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

    def vllm(name: str, role: str, cpu: int, *flags: str, **service: Any) -> tuple[str, subprocess.Popen[bytes]]:
        """``flags``: more of the server's flags (after ``ENGINE_FLAGS``: a flag given twice
        takes the later value)."""
        port = free_port()
        config = {"kv_connector": "KVServiceConnector", "kv_connector_module_path": "kvservice.integrations.vllm",
                  "kv_role": role, "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"kvservice": service}}
        url = f"http://127.0.0.1:{port}"
        proc = start(name, ["vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
                            "--port", str(port), *ENGINE_FLAGS, *flags, "--kv-transfer-config", json.dumps(config)],
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
