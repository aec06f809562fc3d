"""kvservice as vLLM's KV connector (``kv_connector_module_path="kvservice.integrations.vllm"``).

``KVServiceConnector`` (and ``KVServiceMetadata``) import vLLM when first asked for; the
rest of the package (``params``, ``scheduler``, ``memory``, ``worker``) does not need it.
How to run it: ``docs/vllm.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KVServiceConnector", "KVServiceMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.connector"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
