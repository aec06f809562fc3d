"""vLLM's tests run in vLLM's own environment (scripts/vllm-env.sh).  vLLM, torch and
transformers warn about their own deprecations on import and as they run; the suite's
``filterwarnings = error`` stays on for kvservice's code and the tests' own."""

from __future__ import annotations

import warnings

import pytest

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
