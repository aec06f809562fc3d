"""kvservice as vLLM's KV connector (``kv_connector_module_path="kvservice.integrations.vllm"``).

Importing this package imports vLLM; ``docs/vllm.md`` says how to run it.
"""

from .connector import KVServiceConnector, KVServiceMetadata

__all__ = ["KVServiceConnector", "KVServiceMetadata"]
