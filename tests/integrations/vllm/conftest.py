"""vLLM's tests run in vLLM's own environment (scripts/engine-env.sh vllm).  vLLM, torch and
transformers warn about their own deprecations on import and as they run; the suite's
``filterwarnings = error`` stays on for kvservice's code and the tests' own."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest

from .engines import MAX_TOKENS, Engine, make_model

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


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engines' stderr, one file per engine (kvservice logs at INFO there)."""
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def baseline(model: Path, prompts: list[list[int]], logs: Path) -> list[list[int]]:
    """One engine, no connector: the tokens every disaggregated run must reproduce."""
    engine = Engine("baseline", model, cpu=0, log_dir=logs)
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
