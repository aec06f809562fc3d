"""vLLM's KV cache tensors (``register_kv_caches``) as a ``kvservice.memory.KVMemory``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...memory import KVMemory, vllm_blocks, vllm_cpu_blocks


def kv_memory(kv_caches: Sequence[torch.Tensor], *, tp_size: int = 1, tp_rank: int = 0) -> KVMemory:
    """The memory of vLLM's per-layer caches, in the layer order vLLM hands them.

    * ``(num_blocks, kv_heads, block_size, 2 * head_dim)``: the CPU attention backend;
    * ``(2, num_blocks, block_size, kv_heads, head_dim)`` (flash attention) or
      ``(num_blocks, 2, ...)`` (FlashInfer), stored as shaped (``NHD``) or with each
      block head-major (``HND``: vLLM keeps the logical shape and permutes the strides).
    """
    tensors = list(kv_caches)
    if not tensors:
        raise ValueError("register_kv_caches: no KV cache tensors")
    first = tensors[0]
    if first.dim() == 4:
        return vllm_cpu_blocks(tensors, tp_size=tp_size, tp_rank=tp_rank)
    if first.dim() == 5:
        kv_first = first.shape[0] == 2
        if all(t.is_contiguous() for t in tensors):
            return vllm_blocks(tensors, kv_first=kv_first, tp_size=tp_size, tp_rank=tp_rank)
        # head-major blocks: the logical (..., block_size, kv_heads, head_dim) over
        # (..., kv_heads, block_size, head_dim) storage
        physical = [t.permute(0, 1, 3, 2, 4) for t in tensors]
        if all(t.is_contiguous() for t in physical):
            return vllm_blocks(physical, kv_first=kv_first, order="HND", tp_size=tp_size, tp_rank=tp_rank)
    raise ValueError(f"KV cache of shape {tuple(first.shape)}, strides {first.stride()}: not a layout kvservice "
                     "knows (vLLM's CPU, flash-attention or FlashInfer caches, NHD or HND)")
