"""Two services' KV memories paired for transfers from one (``src``) to the other.

Both sides describe their regions (``KVMemory``); the pair decides, region by
region, which bytes of a source page go to which bytes of a destination page:

* same tensor-parallel split (or MLA, whose latent KV every rank holds whole):
  the whole page, one descriptor per page per region;
* different splits of the model's KV heads: the heads both ranks hold.  Head-major
  pages (``HND``) keep a head range contiguous, so still one descriptor per page;
  token-major pages (``NHD``) hold it as one run per token, so the pair uses
  ``tokens`` descriptors per page per region on *both* sides (entry *i* of the
  source list always pairs with entry *i* of the destination list).  Through a
  staging buffer (``_staging``) the same bytes move as one descriptor per page per
  region: when only the source is sliced (it holds more heads, e.g. prefill tp 1
  -> decode tp 2) the sender *gathers* them into its staging; when only the
  destination is, the sender writes whole pages into the receiver's staging and the
  receiver *scatters* them.  The per-token descriptors stay in the tables: a
  request that finds no staging room, and the settle fence, use them (the
  benchmark's TP cases measure both).

A pair's descriptor tables are region-major, then page, then run::

    index(region, page, run) = (region * num_pages + page) * runs + run

so a request's index arrays are one broadcast add, and a run of adjacent pages
of one region stays adjacent in the list.  A gathering pair's tables go on: the
local one with the staging buffer's cells, the remote one with every whole page
of every destination region (``Gather.local_base``, ``remote_base``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ._layout import PageIndex
from ._regions import KVMemory, Region, View, regions_table, views_table
from ._staging import Route, StagingArea


def head_range(memory: KVMemory) -> tuple[int, int]:
    """The model's KV heads (global indices) this rank's regions hold."""
    if memory.latent:
        return 0, 1
    heads = memory.regions[0].heads
    return memory.tp_rank * heads, (memory.tp_rank + 1) * heads


def _view(region: Region, lo: int, hi: int, runs: int) -> View:
    """Heads ``lo:hi`` (local indices) of ``region``'s page, as ``runs`` runs."""
    head = region.head_dim * region.itemsize
    if region.order == "HND":
        return View(lo * region.head_bytes, 1, 0, (hi - lo) * region.head_bytes)
    if runs == 1:  # whole page
        return View(0, 1, 0, region.page_bytes)
    return View(lo * head, runs, region.heads * head, (hi - lo) * head)


def compare(src: KVMemory, dst: KVMemory) -> str | None:
    """Why pages cannot move between the two memories at all, naming the region; None if they can."""
    if src.layers != dst.layers:
        return f"layers: {src.layers} here, {dst.layers} there"
    if src.per_layer != dst.per_layer or src.latent != dst.latent:
        return (f"regions per layer: {[r.kind for r in src.regions[:src.per_layer]]} here, "
                f"{[r.kind for r in dst.regions[:dst.per_layer]]} there")
    if src.region_heads() != dst.region_heads():
        return (f"model KV heads: {src.region_heads()} here ({src.regions[0].heads} x tp {src.tp_size}), "
                f"{dst.region_heads()} there ({dst.regions[0].heads} x tp {dst.tp_size})")
    for i, (a, b) in enumerate(zip(src.regions, dst.regions, strict=True)):
        for attr in ("dtype", "tokens", "head_dim", "order"):
            if getattr(a, attr) != getattr(b, attr):
                return f"region {i} ({a.name}): {attr} {getattr(a, attr)!r} here, {getattr(b, attr)!r} there"
        if src.tp_size == dst.tp_size and a.page_bytes != b.page_bytes:
            return f"region {i} ({a.name}): {a.page_bytes} bytes per page here, {b.page_bytes} there"
    return None


@dataclass(frozen=True, slots=True)
class Pair:
    """How pages move from ``src`` (this service, sending) to ``dst`` (a peer)."""

    src: KVMemory
    dst: KVMemory
    src_views: tuple[View, ...]
    dst_views: tuple[View, ...]
    runs: int
    #: only the source is sliced, token-major: byte offset of the shared heads in each of
    #: its tokens (a gather through staging may serve it); None otherwise
    gather_col: int | None = None
    #: only the destination is sliced, token-major: the same offset in its tokens (the
    #: receiver may scatter from its staging)
    scatter_col: int | None = None
    #: bytes moved per page across every layer (read on every post: computed once)
    page_bytes: int = field(init=False)
    #: the source side moves whole pages: its plain regions table serves
    whole: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "page_bytes", sum(v.nbytes for v in self.src_views))
        object.__setattr__(self, "whole", self.runs == 1 and all(
            v.nbytes == r.page_bytes for v, r in zip(self.src_views, self.src.regions, strict=True)))

    def layer_bytes(self, layers: int) -> int:
        """Bytes moved per page for ``layers`` layers."""
        return self.page_bytes * layers // self.src.layers

    def src_table(self) -> npt.NDArray[np.uint64]:
        return views_table(self.src.regions, self.src_views, self.src.num_pages)

    def dst_table(self) -> npt.NDArray[np.uint64]:
        return views_table(self.dst.regions, self.dst_views, self.dst.num_pages)

    def columns(self) -> tuple[PageIndex, PageIndex]:
        """Per region, the index of its first entry in the source / destination table,
        as read-only columns (``Indexer`` adds pages to them)."""
        src = (np.arange(len(self.src.regions), dtype=np.int64) * self.src.num_pages * self.runs)
        dst = (np.arange(len(self.dst.regions), dtype=np.int64) * self.dst.num_pages * self.runs)
        return _column(src), _column(dst)


def _column(values: npt.NDArray[np.int64]) -> PageIndex:
    column = values.astype(np.int32)[:, None]
    column.flags.writeable = False
    return column


def pair(src: KVMemory, dst: KVMemory) -> Pair | str:
    """The pair from ``src`` to ``dst``, or why there is none (incompatible, or the two
    ranks share no KV heads)."""
    why = compare(src, dst)
    if why is not None:
        return why
    if src.latent:
        # Latent KV is whole on every rank: one source rank serves each destination rank.
        if src.tp_rank != dst.tp_rank * src.tp_size // dst.tp_size:
            return (f"MLA: destination rank {dst.tp_rank} of {dst.tp_size} is served by source rank "
                    f"{dst.tp_rank * src.tp_size // dst.tp_size}, not {src.tp_rank}")
        lo_s, hi_s, lo_d, hi_d = 0, 1, 0, 1
    else:
        (a, b), (c, d) = head_range(src), head_range(dst)
        lo, hi = max(a, c), min(b, d)
        if lo >= hi:
            return (f"source rank {src.tp_rank} of {src.tp_size} holds KV heads {a}..{b - 1}, destination "
                    f"rank {dst.tp_rank} of {dst.tp_size} holds {c}..{d - 1}: none in common")
        lo_s, hi_s, lo_d, hi_d = lo - a, hi - a, lo - c, hi - c
    first_s, first_d = src.regions[0], dst.regions[0]
    sliced = (hi_s - lo_s) != first_s.heads or (hi_d - lo_d) != first_d.heads
    runs = first_s.tokens if sliced and first_s.order == "NHD" else 1
    src_views = tuple(_view(r, lo_s, hi_s, runs) for r in src.regions)
    dst_views = tuple(_view(r, lo_d, hi_d, runs) for r in dst.regions)
    if len(src.regions) * src.num_pages * runs > np.iinfo(np.int32).max or \
            len(dst.regions) * dst.num_pages * runs > np.iinfo(np.int32).max:
        return "descriptor indices of this pair overflow int32"
    gather_col = scatter_col = None
    if runs > 1 and hi_d - lo_d == first_d.heads and len({r.page_bytes for r in dst.regions}) == 1:
        gather_col = src_views[0].offset  # every source region slices the same heads
    if runs > 1 and hi_s - lo_s == first_s.heads and len({r.page_bytes for r in src.regions}) == 1:
        scatter_col = dst_views[0].offset
    return Pair(src, dst, src_views, dst_views, runs, gather_col, scatter_col)


def route(p: Pair, area: StagingArea | None, *, gather: bool) -> Route | None:
    """The pair's gather (through ``area``, the sender's staging) or scatter (``area``:
    the receiver's), or None.  Both sides compute a scatter alike, from the same memories."""
    col = p.gather_col if gather else p.scatter_col
    if area is None or p.runs == 1 or col is None:
        return None
    whole = p.dst if gather else p.src
    cell = whole.regions[0].page_bytes
    cells = area.cells(cell)
    local_base = len(p.src.regions) * p.src.num_pages * p.runs
    remote_base = len(p.dst.regions) * p.dst.num_pages * p.runs
    extra = len(whole.regions) * whole.num_pages
    local_n, remote_n = (cells, extra) if gather else (extra, cells)
    if cells == 0 or max(local_base + local_n, remote_base + remote_n) > np.iinfo(np.int32).max:
        return None
    return Route(gather, cell, col, local_base, remote_base, whole.num_pages, cells)


class Indexer:
    """Index arrays of a pair's transfers: the hot path of every post."""

    __slots__ = ("_dst", "_per_layer", "_run", "_runs", "_src")

    def __init__(self, p: Pair) -> None:
        self._src, self._dst = p.columns()
        self._per_layer = p.src.per_layer
        self._runs = p.runs
        run = np.arange(p.runs, dtype=np.int32)[None, None, :]
        run.flags.writeable = False
        self._run = run

    def indices(self, src_pages: PageIndex, dst_pages: PageIndex, lo: int, hi: int) -> tuple[PageIndex, PageIndex]:
        """Source and destination index arrays for pages ``src_pages`` -> ``dst_pages`` of
        layers ``lo:hi``: entry *i* of one pairs with entry *i* of the other."""
        a, b = lo * self._per_layer, hi * self._per_layer
        if self._runs == 1:
            return ((self._src[a:b] + src_pages[None, :]).ravel(),
                    (self._dst[a:b] + dst_pages[None, :]).ravel())
        runs = self._runs
        return ((self._src[a:b, :, None] + (src_pages * runs)[None, :, None] + self._run).ravel(),
                (self._dst[a:b, :, None] + (dst_pages * runs)[None, :, None] + self._run).ravel())


@dataclass(frozen=True, slots=True)
class PeerKV:
    """A linked peer's KV memory and what it means for transfers with it."""

    memory: KVMemory
    #: pages we send it move by this pair; None when our ranks share no KV (``why``)
    out: Pair | None
    why: str | None
    indexer: Indexer | None
    #: bytes per page (all layers) a request it sends us moves
    inbound_page_bytes: int
    #: sends to it gather through our staging (``_staging``); or scatter: write into its
    #: staging (``remote_staging``), from which it copies into its pages
    gather: Route | None = None
    scatter: Route | None = None
    remote_staging: StagingArea | None = None
    gather_area: StagingArea | None = None  # ours, when sends to it gather
    #: requests it sends us may land in our staging (``_staging``: the receiver's scatter)
    scatter_in: Route | None = None
    #: how requests it sends us move (its ``out`` for us): what a landing check walks
    back: Pair | None = None

    @classmethod
    def of(cls, local: KVMemory, remote: KVMemory, staging: StagingArea | None = None,
           remote_staging: StagingArea | None = None) -> PeerKV:
        out = pair(local, remote)
        back = pair(remote, local)
        inbound = back.page_bytes if isinstance(back, Pair) else 0
        scatter_in = route(back, staging, gather=False) if isinstance(back, Pair) else None
        inbound_pair = back if isinstance(back, Pair) else None
        if not isinstance(out, Pair):
            return cls(remote, None, out, None, inbound, scatter_in=scatter_in, back=inbound_pair)
        gather = route(out, staging, gather=True)
        scatter = route(out, remote_staging, gather=False)
        return cls(remote, out, None, Indexer(out), inbound, gather, scatter, remote_staging,
                   staging if gather is not None else None, scatter_in, inbound_pair)

    def tables(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64] | None]:
        """The peer's descriptor table, and ours for this peer when it is not the plain one
        (built on the door thread: a large pool's tables take milliseconds)."""
        if self.out is None:  # nothing will be posted to it: its plain table (for NIXL's sake)
            return regions_table(self.memory.regions, self.memory.num_pages), None
        out = self.out
        if self.gather is not None and self.gather_area is not None:
            return (np.concatenate([out.dst_table(), regions_table(out.dst.regions, out.dst.num_pages)]),
                    np.concatenate([out.src_table(), self.gather_area.table(self.gather.cell)]))
        if self.scatter is not None and self.remote_staging is not None:
            return (np.concatenate([out.dst_table(), self.remote_staging.table(self.scatter.cell)]),
                    np.concatenate([out.src_table(), regions_table(out.src.regions, out.src.num_pages)]))
        return out.dst_table(), None if out.whole else out.src_table()

    @property
    def local_key(self) -> tuple[object, ...] | None:
        """Identifies our table for this peer among peers (None: the plain one)."""
        if self.out is None or (self.out.whole and self.gather is None and self.scatter is None):
            return None
        if self.gather is not None:
            return (*self.out.src_views, "gather", self.gather.cell)
        return (*self.out.src_views, "scatter") if self.scatter is not None else self.out.src_views
