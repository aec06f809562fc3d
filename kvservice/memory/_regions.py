"""KV memory as regions: what kvservice registers with NIXL and moves pages of.

A *region* is one slab of KV of one layer: ``num_pages`` pages, page *p* at
``addr + p * page_stride``, each ``page_bytes`` long and holding ``tokens``
tokens of ``heads`` KV heads of ``head_dim`` elements, token-major (``NHD``:
``[token][head][dim]``) or head-major (``HND``: ``[head][token][dim]``).  An
engine's per-layer K and V tensors are two regions per layer; an MLA latent
cache is one (``kind="latent"``); a cache that keeps each head's K and V side by
side (vLLM's CPU attention: per block and head, the block's K tokens then its V
tokens) is one head-major region of ``kind="kv"``, whose pages hold two planes
per head; kvservice's own pool (``KVPool``) is one case of the same thing.

``KVMemory`` is the whole description of one service's KV: its regions ordered
by layer (every layer the same kinds in the same order), the memory segments
NIXL registers (the tensors the regions live in), and the service's tensor-
parallel rank, which says which of the model's KV heads its pages hold.  What a
peer learns of it is ``wire()``; ``_pairing`` turns two descriptions into the
descriptor tables a transfer between them uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .._control.protocol import MemoryWire, RegionWire
from ._layout import DTYPE_SIZES, PageIndex, check_pages

#: the kinds of region, in the order they appear within a layer
KINDS = ("k", "v", "latent", "kv")
#: what one layer's regions may be
LAYER_KINDS = (["k", "v"], ["latent"], ["kv"])
ORDERS = ("NHD", "HND")
_ADDRESS_SPACE = 1 << 64


@dataclass(frozen=True, slots=True)
class Region:
    """One layer's slab of K, V or MLA latent KV (see the module docstring)."""

    addr: int
    page_stride: int
    layer: int
    kind: str
    dtype: str
    tokens: int
    heads: int
    head_dim: int
    order: str = "NHD"
    device_id: int = 0

    def __post_init__(self) -> None:
        for name in ("addr", "page_stride", "tokens", "heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"region {self.name}: {name} must be a positive int, got {value!r}")
        if not isinstance(self.layer, int) or self.layer < 0:
            raise ValueError(f"region: layer must be an int >= 0, got {self.layer!r}")
        if self.kind not in KINDS:
            raise ValueError(f"region {self.name}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"region {self.name}: dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        if self.order not in ORDERS:
            raise ValueError(f"region {self.name}: order must be one of {ORDERS}, got {self.order!r}")
        if self.kind == "latent" and self.heads != 1:
            raise ValueError(f"region {self.name}: a latent region has one head, got {self.heads}")
        if self.kind == "kv" and self.order != "HND":
            raise ValueError(f"region {self.name}: a fused K/V region is head-major (HND), got {self.order!r}")
        if self.page_stride < self.page_bytes:
            raise ValueError(f"region {self.name}: page_stride {self.page_stride} is less than a page "
                             f"({self.page_bytes} bytes): pages would overlap")

    @property
    def name(self) -> str:
        return f"L{self.layer}.{self.kind}"

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def planes(self) -> int:
        """Planes per head in a page: 2 for a fused K/V region (K then V), else 1."""
        return 2 if self.kind == "kv" else 1

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one page (head-major: contiguous)."""
        return self.planes * self.tokens * self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def page_bytes(self) -> int:
        return self.heads * self.head_bytes

    def end(self, num_pages: int) -> int:
        """One past the last byte of the region's last page."""
        return self.addr + (num_pages - 1) * self.page_stride + self.page_bytes


#: memory NIXL registers: (address, bytes, device id)
Segment = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class KVMemory:
    """One service's KV: regions, registered segments, tensor-parallel rank.

    Build it with the constructors in ``kvservice.memory`` (``sglang_mha``,
    ``vllm_blocks``, ``mla``, ``from_regions``) or let the service build it for
    its own pool.  ``keep`` holds the tensors the regions live in, so they
    outlive the registration."""

    regions: tuple[Region, ...]
    num_pages: int
    segments: tuple[Segment, ...] = ()
    mem_type: str = "DRAM"
    tp_size: int = 1
    tp_rank: int = 0
    keep: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    #: regions per layer: 2 (K, V) or 1 (MLA latent, fused K/V)
    per_layer: int = field(init=False, compare=False, repr=False)
    layers: int = field(init=False, compare=False, repr=False)
    #: bytes of one page across every region
    page_bytes: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.regions:
            raise ValueError("KVMemory: at least one region")
        if not isinstance(self.num_pages, int) or self.num_pages <= 0:
            raise ValueError(f"KVMemory: num_pages must be a positive int, got {self.num_pages!r}")
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"KVMemory: mem_type must be DRAM or VRAM, got {self.mem_type!r}")
        if not (isinstance(self.tp_size, int) and isinstance(self.tp_rank, int)
                and self.tp_size >= 1 and 0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"KVMemory: tp_rank {self.tp_rank!r} of tp_size {self.tp_size!r} is not a rank")
        first = self.regions[0]
        kinds = [r.kind for r in self.regions if r.layer == 0]
        if kinds not in LAYER_KINDS:
            raise ValueError(f"KVMemory: a layer is a K then a V region, one latent region or one fused K/V "
                             f"region; layer 0 has {kinds}")
        if len(self.regions) % len(kinds):
            raise ValueError(f"KVMemory: every layer must have the same regions (layer 0 has {kinds})")
        for i, region in enumerate(self.regions):
            want_layer, want_kind = divmod(i, len(kinds))
            if region.layer != want_layer or region.kind != kinds[want_kind]:
                raise ValueError(f"KVMemory: region {i} is {region.name}, expected "
                                 f"L{want_layer}.{kinds[want_kind]} (regions in layer order, "
                                 f"each layer {'/'.join(kinds)})")
            for attr in ("dtype", "tokens", "order"):
                if getattr(region, attr) != getattr(first, attr):
                    raise ValueError(f"KVMemory: region {region.name} has {attr} {getattr(region, attr)!r}, "
                                     f"region {first.name} {getattr(first, attr)!r}: one value for all")
            if region.end(self.num_pages) > _ADDRESS_SPACE:
                raise ValueError(f"KVMemory: region {region.name} overflows the address space")

        if len(self.regions) * self.num_pages > np.iinfo(np.int32).max:
            raise ValueError("KVMemory: regions * num_pages must fit in int32 descriptor indices")
        for region in self.regions:
            if self.segments and not any(
                    a <= region.addr and region.end(self.num_pages) <= a + n and d == region.device_id
                    for a, n, d in self.segments):
                raise ValueError(f"KVMemory: region {region.name} lies outside every registered segment")
        # read on every send and post: computed once
        object.__setattr__(self, "per_layer", len(kinds))
        object.__setattr__(self, "layers", len(self.regions) // len(kinds))
        object.__setattr__(self, "page_bytes", sum(r.page_bytes for r in self.regions))

    # -- shape ---------------------------------------------------------------------
    @property
    def latent(self) -> bool:
        return self.regions[0].kind == "latent"

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    def bytes_for(self, npages: int) -> int:
        return npages * self.page_bytes

    def check_pages(self, pages: Sequence[int] | npt.NDArray[Any]) -> PageIndex:
        return check_pages(pages, self.num_pages)

    def check_layers(self, layers: range | None) -> tuple[int, int]:
        """``layers`` as ``(lo, hi)``; all layers when None.  Raises ``ValueError``."""
        if layers is None:
            return 0, self.layers
        if not isinstance(layers, range) or layers.step != 1 or len(layers) == 0:
            raise ValueError(f"layers must be a non-empty range with step 1, got {layers!r}")
        if layers.start < 0 or layers.stop > self.layers:
            raise ValueError(f"layers {layers.start}..{layers.stop - 1} out of range: "
                             f"{self.layers} layers")
        return layers.start, layers.stop

    def region_heads(self) -> int:
        """KV heads of the whole model in one region (all ranks together)."""
        return self.regions[0].heads * (1 if self.latent else self.tp_size)


@dataclass(frozen=True, slots=True)
class View:
    """Bytes of each page of one region that a pair moves: ``runs`` runs of
    ``run_bytes``, the first at ``offset`` into the page, ``run_stride`` apart."""

    offset: int
    runs: int
    run_stride: int
    run_bytes: int

    @property
    def nbytes(self) -> int:
        return self.runs * self.run_bytes


def views_table(regions: Sequence[Region], views: Sequence[View], num_pages: int) -> npt.NDArray[np.uint64]:
    """The descriptor table of ``views`` over ``regions`` (address, length, device id)."""
    runs = views[0].runs
    n = num_pages * runs
    table = np.empty((len(regions) * n, 3), dtype=np.uint64)
    pages = np.repeat(np.arange(num_pages, dtype=np.uint64), runs)
    run = np.tile(np.arange(runs, dtype=np.uint64), num_pages)
    for i, (region, view) in enumerate(zip(regions, views, strict=True)):
        rows = table[i * n : (i + 1) * n]
        rows[:, 0] = (np.uint64(region.addr + view.offset) + pages * np.uint64(region.page_stride)
                      + run * np.uint64(view.run_stride))
        rows[:, 1] = view.run_bytes
        rows[:, 2] = region.device_id
    return table


def regions_table(regions: Sequence[Region], num_pages: int) -> npt.NDArray[np.uint64]:
    """Every page of every region, region-major: entry ``r * num_pages + p`` is page
    *p* of region *r* (address, length, device id)."""
    return views_table(regions, tuple(View(0, 1, 0, r.page_bytes) for r in regions), num_pages)


def memory_to_wire(memory: KVMemory, staging: tuple[int, int] = (0, 0)) -> MemoryWire:
    """``memory`` as peers see it; ``staging``: this service's staging buffer (address, bytes)."""
    return MemoryWire(
        num_pages=memory.num_pages, mem_type=memory.mem_type, tp_size=memory.tp_size, tp_rank=memory.tp_rank,
        staging_addr=staging[0], staging_bytes=staging[1],
        regions=[RegionWire(r.addr, r.page_stride, r.layer, r.kind, r.dtype, r.tokens, r.heads, r.head_dim,
                            r.order, r.device_id) for r in memory.regions])


def memory_from_wire(wire: MemoryWire) -> KVMemory:
    """A peer's memory (no segments: NIXL's metadata holds its registrations).
    Raises ``ValueError`` naming what is wrong."""
    regions = tuple(Region(r.addr, r.page_stride, r.layer, r.kind, r.dtype, r.tokens, r.heads, r.head_dim,
                           r.order, r.device_id) for r in wire.regions)
    return KVMemory(regions, wire.num_pages, (), wire.mem_type, wire.tp_size, wire.tp_rank)
