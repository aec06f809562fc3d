"""Whether SGLang is importable here, and the one way a test that needs it skips or fails."""

from __future__ import annotations

import importlib.util
import os

import pytest

#: the SGLang suite runs in SGLang's environment (scripts/engine-env.sh sglang)
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


def require_sglang() -> None:
    """Skip the calling test where SGLang is not installed, or fail it where
    ``KVSERVICE_REQUIRE_SGLANG`` says it must run (CI's SGLang suite)."""
    if HAVE_SGLANG:
        return
    why = "SGLang is not installed here: run with the python of scripts/engine-env.sh sglang"
    if os.environ.get("KVSERVICE_REQUIRE_SGLANG"):
        pytest.fail(f"KVSERVICE_REQUIRE_SGLANG is set, but {why}")
    pytest.skip(why)
