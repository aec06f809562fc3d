"""The KV memory kvservice moves pages of: regions over the engine's own tensors.

``KVMemory`` describes one service's KV as regions (``Region``); the
constructors in ``engines`` build it from engine tensors as they are, and a
service without one gets its own pool (``KVPool``, described by ``pool_memory``).
Two services' memories pair up (``_pairing``) region by region at the handshake.
"""

from ._layout import KVLayout
from ._pool import KVPool
from ._regions import KVMemory, Region
from .engines import from_regions, mla, pool_memory, sglang_mha, vllm_blocks, vllm_cpu_blocks

__all__ = ["KVLayout", "KVMemory", "KVPool", "Region", "from_regions", "mla", "pool_memory", "sglang_mha",
           "vllm_blocks", "vllm_cpu_blocks"]
