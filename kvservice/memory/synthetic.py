"""Engine-shaped KV tensors with known contents, for tests, the demo and the benchmark.

``SyntheticKV`` allocates the tensors one engine layout keeps (``EngineSpec``),
describes them with that layout's constructor (``engines``), and reads and
writes pages through the *logical* view every layout shares: one page of one
region is ``(tokens, heads, head_dim)``, whatever order the engine stores it in.
Contents are a pattern per request over the model's *global* KV heads
(``pattern``), so a tensor-parallel rank fills or verifies exactly its heads, and a
decode rank can check it received its heads from however many prefill ranks.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ._layout import DTYPE_SIZES
from ._regions import KVMemory
from .engines import mla, sglang_mha, vllm_blocks, vllm_cpu_blocks

#: the layouts ``SyntheticKV`` builds: name -> (constructor, its keyword arguments)
ENGINES = ("sglang_mha", "vllm", "vllm_blocks_first", "vllm_hnd", "vllm_cpu", "mla")


@dataclass(frozen=True)
class EngineSpec:
    """One engine's KV shape.  ``heads`` counts the model's KV heads (all ranks); each
    of ``tp_size`` ranks holds ``heads // tp_size`` (MLA: one latent "head" everywhere)."""

    engine: str = "sglang_mha"
    layers: int = 2
    pages: int = 32
    page_tokens: int = 4
    heads: int = 4
    head_dim: int = 8
    dtype: str = "bfloat16"
    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        if not self.latent and self.heads % self.tp_size:
            raise ValueError(f"{self.heads} KV heads do not split evenly over {self.tp_size} ranks")

    @property
    def latent(self) -> bool:
        return self.engine == "mla"

    @property
    def local_heads(self) -> int:
        return 1 if self.latent else self.heads // self.tp_size

    @property
    def global_heads(self) -> int:
        return 1 if self.latent else self.heads

    @property
    def kinds(self) -> int:
        return 1 if self.latent else 2

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pattern(spec: EngineSpec, request_id: str, npages: int) -> torch.Tensor:
    """What request ``request_id`` carries, over the model's global heads: shape
    ``(layers, kinds, npages, tokens, global_heads, head_dim)``."""
    gen = torch.Generator().manual_seed(zlib.crc32(request_id.encode()))
    shape = (spec.layers, spec.kinds, npages, spec.page_tokens, spec.global_heads, spec.head_dim)
    return torch.randn(shape, generator=gen).to(getattr(torch, spec.dtype))


class SyntheticKV:
    """Tensors laid out as ``spec.engine`` keeps them, zeroed, and their ``memory``."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        s = spec
        dtype = getattr(torch, s.dtype)
        tokens = s.pages * s.page_tokens
        h = s.local_heads
        self.tensors: list[torch.Tensor]
        tp = {"tp_size": s.tp_size, "tp_rank": s.tp_rank}
        if s.engine == "sglang_mha":
            k = [torch.zeros(tokens, h, s.head_dim, dtype=dtype) for _ in range(s.layers)]
            v = [torch.zeros(tokens, h, s.head_dim, dtype=dtype) for _ in range(s.layers)]
            self.tensors = [*k, *v]
            self.memory: KVMemory = sglang_mha(k, v, s.page_tokens, **tp)
        elif s.engine == "mla":
            self.tensors = [torch.zeros(tokens, 1, s.head_dim, dtype=dtype) for _ in range(s.layers)]
            self.memory = mla(self.tensors, s.page_tokens, **tp)
        elif s.engine == "vllm_cpu":
            self.tensors = [torch.zeros(s.pages, h, s.page_tokens, 2 * s.head_dim, dtype=dtype)
                            for _ in range(s.layers)]
            self.memory = vllm_cpu_blocks(self.tensors, **tp)
        else:
            block = (h, s.page_tokens) if s.engine == "vllm_hnd" else (s.page_tokens, h)
            first = s.engine != "vllm_blocks_first"
            shape = (2, s.pages, *block, s.head_dim) if first else (s.pages, 2, *block, s.head_dim)
            self.tensors = [torch.zeros(shape, dtype=dtype) for _ in range(s.layers)]
            self.memory = vllm_blocks(self.tensors, kv_first=first,
                                      order="HND" if s.engine == "vllm_hnd" else "NHD", **tp)

    def page(self, layer: int, kind: int, page: int) -> torch.Tensor:
        """One page of one region as ``(tokens, local_heads, head_dim)`` (a view)."""
        s = self.spec
        if s.engine == "sglang_mha":
            t = self.tensors[kind * s.layers + layer]
            return t[page * s.page_tokens : (page + 1) * s.page_tokens]
        if s.engine == "mla":
            return self.tensors[layer][page * s.page_tokens : (page + 1) * s.page_tokens]
        t = self.tensors[layer]
        if s.engine == "vllm_cpu":  # per head: the block's K tokens, then its V tokens
            fused = t[page].view(s.local_heads, 2 * s.page_tokens, s.head_dim)
            return fused[:, kind * s.page_tokens : (kind + 1) * s.page_tokens].permute(1, 0, 2)
        block = t[page, kind] if s.engine == "vllm_blocks_first" else t[kind, page]
        return block.permute(1, 0, 2) if s.engine == "vllm_hnd" else block

    def _heads(self) -> slice:
        h = self.spec.local_heads
        return slice(0, 1) if self.spec.latent else slice(self.spec.tp_rank * h, (self.spec.tp_rank + 1) * h)

    def fill(self, request_id: str, pages: Sequence[int], layers: range | None = None) -> None:
        """Write request ``request_id``'s pattern (this rank's heads) into ``pages``."""
        data = pattern(self.spec, request_id, len(pages))[:, :, :, :, self._heads()]
        for layer in layers or range(self.spec.layers):
            for kind in range(self.spec.kinds):
                for i, page in enumerate(pages):
                    self.page(layer, kind, page).copy_(data[layer, kind, i])

    def holds(self, request_id: str, pages: Sequence[int], layers: range | None = None) -> bool:
        """Whether ``pages`` hold exactly request ``request_id``'s pattern (this rank's heads)."""
        data = pattern(self.spec, request_id, len(pages))[:, :, :, :, self._heads()]
        return all(
            torch.equal(self.page(layer, kind, page), data[layer, kind, i])
            for layer in layers or range(self.spec.layers) for kind in range(self.spec.kinds)
            for i, page in enumerate(pages))

    def untouched(self, pages: Sequence[int]) -> bool:
        """Whether every byte of ``pages`` is still zero."""
        return all(bool((self.page(layer, kind, page) == 0).all())
                   for layer in range(self.spec.layers) for kind in range(self.spec.kinds) for page in pages)
