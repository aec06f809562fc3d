"""``KVMemory`` from the tensors engines keep their KV in, as they are.

Nothing is copied or reshaped: each constructor reads addresses and strides off
the engine's tensors and describes them as regions (see ``_regions``).  The
tensors must stay alive and in place while the service runs (the memory keeps a
reference to them).  CUDA tensors register as VRAM, CPU tensors as DRAM.

=========================  ============================================  =====
constructor                per-layer tensor                              order
=========================  ============================================  =====
``sglang_mha``             K and V ``(num_tokens, kv_heads, head_dim)``  NHD
``vllm_blocks``            ``(2, num_blocks, block_size, kv_heads, D)``  NHD
``vllm_blocks(kv_first=    ``(num_blocks, 2, block_size, kv_heads, D)``  NHD
False)``
``vllm_blocks(order=       ``(2, num_blocks, kv_heads, block_size, D)``  HND
"HND")``
``vllm_cpu_blocks``        ``(num_blocks, kv_heads, block_size, 2 * D)``  HND
                           (per head: K's tokens, then V's; one region)
``mla``                    ``(num_tokens, 1, kv_lora_rank + rope_dim)``  --
``pool_memory``            kvservice's pool ``(layers, 2, pages, elems)``  NHD
=========================  ============================================  =====
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._layout import DTYPE_SIZES, KVLayout
from ._regions import KVMemory, Region, Segment


def dtype_name(tensor: torch.Tensor) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"dtype {tensor.dtype} is not supported (one of {sorted(DTYPE_SIZES)})")
    return name


def _segments(tensors: Sequence[torch.Tensor]) -> tuple[tuple[Segment, ...], str]:
    seen: dict[int, Segment] = {}
    cuda = {t.is_cuda for t in tensors}
    if len(cuda) != 1:
        raise ValueError("KV tensors must all be on CPU or all on CUDA devices")
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"KV tensor of shape {tuple(t.shape)} is not contiguous")
        seen.setdefault(t.data_ptr(), (t.data_ptr(), t.numel() * t.element_size(), max(t.get_device(), 0)))
    return tuple(seen.values()), "VRAM" if cuda.pop() else "DRAM"


def _check_layers(name: str, tensors: Sequence[torch.Tensor], shape: tuple[int, ...] | None = None) -> None:
    if not tensors:
        raise ValueError(f"{name}: no layers")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}[{i}]: expected a tensor, got {type(t).__name__}")
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(f"{name}[{i}]: {tuple(t.shape)} {t.dtype}, layer 0 is {tuple(first.shape)} {first.dtype}")
    if shape is not None and len(first.shape) != len(shape):
        raise ValueError(f"{name}: expected {len(shape)} dimensions, got shape {tuple(first.shape)}")


def _memory(regions: list[Region], num_pages: int, tensors: Sequence[torch.Tensor],
            tp_size: int, tp_rank: int) -> KVMemory:
    segments, mem_type = _segments(tensors)
    return KVMemory(tuple(regions), num_pages, segments, mem_type, tp_size, tp_rank, keep=tuple(tensors))


def sglang_mha(
    k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], page_size: int, *,
    tp_size: int = 1, tp_rank: int = 0,
) -> KVMemory:
    """SGLang's MHA pool: per layer a K and a V tensor ``(num_tokens, kv_heads, head_dim)``
    holding this rank's heads; page *p* is tokens ``p * page_size`` onwards."""
    _check_layers("k_buffers", k_buffers, (0, 0, 0))
    _check_layers("v_buffers", v_buffers, (0, 0, 0))
    if len(k_buffers) != len(v_buffers) or k_buffers[0].shape != v_buffers[0].shape:
        raise ValueError("k_buffers and v_buffers must have as many layers, of the same shape")
    num_tokens, heads, head_dim = k_buffers[0].shape
    if page_size <= 0 or num_tokens < page_size:
        raise ValueError(f"page_size {page_size} must be in 1..{num_tokens} (the tokens per layer)")
    stride = page_size * heads * head_dim * k_buffers[0].element_size()
    dtype = dtype_name(k_buffers[0])
    regions = [
        Region(t.data_ptr(), stride, layer, kind, dtype, page_size, heads, head_dim, "NHD", max(t.get_device(), 0))
        for layer, (k, v) in enumerate(zip(k_buffers, v_buffers, strict=True))
        for kind, t in (("k", k), ("v", v))
    ]
    return _memory(regions, num_tokens // page_size, [*k_buffers, *v_buffers], tp_size, tp_rank)


def vllm_blocks(
    kv_caches: Sequence[torch.Tensor], *, kv_first: bool = True, order: str = "NHD",
    tp_size: int = 1, tp_rank: int = 0,
) -> KVMemory:
    """vLLM's paged caches, one tensor per layer: ``(2, num_blocks, block_size, kv_heads,
    head_dim)`` (``kv_first``, the flash-attention layout) or ``(num_blocks, 2, block_size,
    kv_heads, head_dim)``; with ``order="HND"`` the block's dimensions are ``(kv_heads,
    block_size, head_dim)``.  A page is a block."""
    _check_layers("kv_caches", kv_caches, (0, 0, 0, 0, 0))
    shape = tuple(kv_caches[0].shape)
    if order not in ("NHD", "HND"):
        raise ValueError(f"order must be 'NHD' or 'HND', got {order!r}")
    two, num_blocks = (shape[0], shape[1]) if kv_first else (shape[1], shape[0])
    if two != 2:
        raise ValueError(f"kv_caches: expected a K/V dimension of 2 {'first' if kv_first else 'second'}, "
                         f"got shape {shape}")
    block_size, heads = (shape[2], shape[3]) if order == "NHD" else (shape[3], shape[2])
    head_dim = shape[4]
    block = block_size * heads * head_dim * kv_caches[0].element_size()
    dtype = dtype_name(kv_caches[0])
    regions = []
    for layer, t in enumerate(kv_caches):
        base = t.data_ptr()
        for i, kind in enumerate(("k", "v")):
            addr = base + (i * num_blocks * block if kv_first else i * block)
            stride = block if kv_first else 2 * block
            regions.append(Region(addr, stride, layer, kind, dtype, block_size, heads, head_dim, order,
                                  max(t.get_device(), 0)))
    return _memory(regions, num_blocks, kv_caches, tp_size, tp_rank)


def vllm_cpu_blocks(kv_caches: Sequence[torch.Tensor], *, tp_size: int = 1, tp_rank: int = 0) -> KVMemory:
    """vLLM's CPU attention cache, one tensor per layer ``(num_blocks, kv_heads, block_size,
    2 * head_dim)``: each (block, head) holds the block's K tokens, then its V tokens
    (vLLM views it as ``(num_blocks, kv_heads, 2 * block_size, head_dim)`` and splits the
    third dimension).  One fused K/V region per layer (``kind="kv"``); a page is a block."""
    _check_layers("kv_caches", kv_caches, (0, 0, 0, 0))
    num_blocks, heads, block_size, width = kv_caches[0].shape
    if width % 2:
        raise ValueError(f"kv_caches: the last dimension holds K and V (2 * head_dim), got shape "
                         f"{tuple(kv_caches[0].shape)}")
    head_dim = width // 2
    stride = heads * block_size * width * kv_caches[0].element_size()
    dtype = dtype_name(kv_caches[0])
    regions = [Region(t.data_ptr(), stride, layer, "kv", dtype, block_size, heads, head_dim, "HND",
                      max(t.get_device(), 0))
               for layer, t in enumerate(kv_caches)]
    return _memory(regions, num_blocks, kv_caches, tp_size, tp_rank)


def mla(latent_buffers: Sequence[torch.Tensor], page_size: int, *, tp_size: int = 1, tp_rank: int = 0) -> KVMemory:
    """An MLA latent cache (SGLang's ``MLATokenToKVPool``): per layer ``(num_tokens, 1,
    kv_lora_rank + rope_dim)``, no K/V split, the same on every tensor-parallel rank."""
    _check_layers("latent_buffers", latent_buffers, (0, 0, 0))
    num_tokens, one, width = latent_buffers[0].shape
    if one != 1:
        raise ValueError(f"latent_buffers: expected (num_tokens, 1, width), got {tuple(latent_buffers[0].shape)}")
    if page_size <= 0 or num_tokens < page_size:
        raise ValueError(f"page_size {page_size} must be in 1..{num_tokens} (the tokens per layer)")
    stride = page_size * width * latent_buffers[0].element_size()
    dtype = dtype_name(latent_buffers[0])
    regions = [Region(t.data_ptr(), stride, layer, "latent", dtype, page_size, 1, width, "NHD", max(t.get_device(), 0))
               for layer, t in enumerate(latent_buffers)]
    return _memory(regions, num_tokens // page_size, latent_buffers, tp_size, tp_rank)


def pool_regions(layout: KVLayout, base: int, device_id: int = 0) -> list[Region]:
    """The regions of a pool of ``layout`` at ``base``: per layer a K and a V plane,
    each page-plane ``page_tokens x kv_heads x head_dim``."""
    plane = layout.plane_bytes
    return [
        Region(base + (layer * 2 + i) * layout.num_pages * plane, plane, layer, kind, layout.dtype,
               layout.page_tokens, layout.kv_heads, layout.head_dim, "NHD", device_id)
        for layer in range(layout.layers) for i, kind in enumerate(("k", "v"))
    ]


def pool_memory(layout: KVLayout, tensor: torch.Tensor) -> KVMemory:
    """kvservice's own pool (``KVPool``): ``(layers, 2, pages, page_elems)``."""
    regions = pool_regions(layout, tensor.data_ptr(), max(tensor.get_device(), 0))
    return _memory(regions, layout.num_pages, [tensor], 1, 0)


def from_regions(regions: Sequence[Region], num_pages: int, *, tensors: Sequence[Any] = (),
                 segments: Sequence[Segment] = (), mem_type: str = "DRAM",
                 tp_size: int = 1, tp_rank: int = 0) -> KVMemory:
    """Regions described by hand (base pointers, strides); ``segments`` are what NIXL
    registers (default: the ``tensors``').  For layouts the constructors above miss."""
    if tensors and not segments:
        segs, mem_type = _segments(list(tensors))
        segments = segs
    if not segments:
        raise ValueError("from_regions: give the tensors the regions live in, or their segments")
    return KVMemory(tuple(regions), num_pages, tuple(segments), mem_type, tp_size, tp_rank, keep=tuple(tensors))
