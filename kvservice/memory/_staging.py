"""Staging: token-major pages sliced by tensor parallelism, in a few large descriptors.

When this rank's token-major (``NHD``) pages hold more KV heads than it shares with a
peer's rank (prefill tp 1 -> decode tp 2), the heads the pair moves are one short run
per token of every page: one descriptor each (``_pairing``).  With staging, the sender
*gathers* those heads of a request's pages into a buffer registered with NIXL once, at
start, laid out exactly as the destination's pages are, and posts one descriptor per
page per region from there, as head-major pages move.

* ``Arena``: which bytes of the buffer are taken (first fit, aligned to the pair's cell).
* ``Staging``: the buffer (one DRAM tensor, one registered segment), its arena, the
  range each send holds, and the gather (a chunk's pages copied in, on the door thread
  just before the chunk's post: off the event loop, and the copy of chunk *k+1*
  overlaps the WRITE of chunk *k*).

A send takes one range for all its pages at its first post: ``cells`` cells, one per
(region, page position), each the bytes of one destination page of one region.  It
gives the range back once the door has released every handle of it (the watchdog's
``_settle_if_released``), on success and on every failure path alike.  A released
WRITE may still be reading the range then (a release does not stop a zero-copy WRITE
already under way); whatever it reads lands only in the failed request's destination
pages, which are unsettled until the fence, so reuse cannot corrupt a request that
succeeds.

Staging is an optimisation: a send that finds no free range (or needs more than the
whole buffer) moves by the per-token descriptors, as without staging, and is counted
(``Stats.staging``).  Nothing waits for staging and nothing fails for lack of it.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from ._layout import PageIndex
from ._regions import KVMemory, Region

#: at most this many staging cells in one pair's descriptor table (tiny cells: the rest unused)
MAX_CELLS = 1 << 20


@dataclass(frozen=True, slots=True)
class StagingArea:
    """Where the staging buffer is: what a pair's tables are built over."""

    addr: int
    nbytes: int
    device_id: int = 0

    def cells(self, cell: int) -> int:
        """Cells of ``cell`` bytes the buffer's descriptor table holds."""
        return min(self.nbytes // cell, MAX_CELLS)

    def table(self, cell: int) -> npt.NDArray[np.uint64]:
        """Descriptor table of the buffer as cells of ``cell`` bytes (address, length, device)."""
        n = self.cells(cell)
        table = np.empty((n, 3), dtype=np.uint64)
        table[:, 0] = np.uint64(self.addr) + np.arange(n, dtype=np.uint64) * np.uint64(cell)
        table[:, 1] = cell
        table[:, 2] = self.device_id
        return table


class Arena:
    """First-fit allocation of byte ranges of ``size`` bytes; free neighbours merge."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        self.size = size
        self._starts: list[int] = [0]  # free ranges, sorted by start
        self._ends: list[int] = [size]
        self.used = 0

    def take(self, nbytes: int, align: int) -> int | None:
        """The offset of ``nbytes`` free bytes starting at a multiple of ``align``; None if none."""
        if nbytes <= 0 or align <= 0:
            raise ValueError(f"take({nbytes}, {align}): both must be positive")
        for i, (lo, hi) in enumerate(zip(self._starts, self._ends, strict=True)):
            start = -(-lo // align) * align
            if start + nbytes > hi:
                continue
            del self._starts[i], self._ends[i]
            for a, b in ((start + nbytes, hi), (lo, start)):  # the rest stays free
                if a < b:
                    j = bisect.bisect_left(self._starts, a)
                    self._starts.insert(j, a)
                    self._ends.insert(j, b)
            self.used += nbytes
            return start
        return None

    def give(self, offset: int, nbytes: int) -> None:
        """Free a range ``take`` returned."""
        end = offset + nbytes
        i = bisect.bisect_left(self._starts, offset)
        if (i < len(self._starts) and self._starts[i] < end) or (i > 0 and self._ends[i - 1] > offset):
            raise ValueError(f"range {offset}..{end} is (partly) free already")
        self._starts.insert(i, offset)
        self._ends.insert(i, end)
        if i + 1 < len(self._starts) and self._starts[i + 1] == end:  # merge the next
            self._ends[i] = self._ends.pop(i + 1)
            del self._starts[i + 1]
        if i > 0 and self._ends[i - 1] == offset:  # merge into the previous
            self._ends[i - 1] = self._ends.pop(i)
            del self._starts[i]
        self.used -= nbytes

    @property
    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))


@dataclass(frozen=True, slots=True)
class Gather:
    """How a pair gathers: the source's heads ``lo:hi`` (bytes ``col:col + cell // tokens``
    of each token) of each page go to one cell of ``cell`` bytes, a destination page."""

    cell: int
    col: int
    #: where the staging cells start in the pair's local table, and the destination's
    #: whole pages in its remote table
    local_base: int
    remote_base: int
    dst_pages: int


@dataclass(slots=True)
class Held:
    """A send's range: ``offset`` bytes in, ``cells`` cells of the pair's ``gather``."""

    offset: int
    nbytes: int
    first_cell: int
    npages: int
    gather: Gather


def _raw(region: Region, num_pages: int) -> torch.Tensor:
    """``region``'s pages as a ``(pages, tokens, bytes per token)`` uint8 view (DRAM)."""
    span = (num_pages - 1) * region.page_stride + region.page_bytes
    flat = torch.frombuffer((ctypes.c_uint8 * span).from_address(region.addr), dtype=torch.uint8)
    per_token = region.heads * region.head_dim * region.itemsize
    return flat.as_strided((num_pages, region.tokens, per_token), (region.page_stride, per_token, 1))


class Staging:
    """The sender's staging buffer and who holds what of it (see the module docstring)."""

    def __init__(self, memory: KVMemory, nbytes: int, counts: collections.Counter[str]) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.area = StagingArea(int(self.tensor.data_ptr()), nbytes)
        self.arena = Arena(nbytes)
        self._memory = memory
        self._pages = [_raw(r, memory.num_pages) for r in memory.regions]
        self._held: dict[object, Held | None] = {}  # None: it moves by per-token descriptors
        self.counts = counts

    @staticmethod
    def wanted(memory: KVMemory, nbytes: int) -> bool:
        """Whether a service over ``memory`` gets a staging buffer of ``nbytes``: only
        token-major DRAM pages can be sliced (head-major and MLA pages never are)."""
        return nbytes > 0 and memory.mem_type == "DRAM" and not memory.latent and memory.regions[0].order == "NHD"

    @property
    def segment(self) -> tuple[int, int, int]:
        return self.area.addr, self.area.nbytes, self.area.device_id

    def hold(self, key: object, gather: Gather, npages: int) -> Held | None:
        """The range ``key`` (a send of ``npages`` pages) holds, taken now if it holds none;
        None: it moves by per-token descriptors (no room, counted)."""
        if key in self._held:  # decided at its first post, for all its chunks
            return self._held[key]
        cells = len(self._memory.regions) * npages
        nbytes = cells * gather.cell
        offset = None
        if nbytes > self.area.cells(gather.cell) * gather.cell:
            self.counts["fallback_too_large"] += 1
        elif (offset := self.arena.take(nbytes, gather.cell)) is None:
            self.counts["fallback_full"] += 1
        if offset is None:
            self._held[key] = None
            return None
        self.counts["gathered"] += 1
        held = self._held[key] = Held(offset, nbytes, offset // gather.cell, npages, gather)
        return held

    def release(self, key: object) -> None:
        """``key`` ended and nothing of it is posted any more: its range is free again."""
        held = self._held.pop(key, None)
        if held is not None:
            self.arena.give(held.offset, held.nbytes)

    def holds(self, key: object) -> bool:
        """Whether ``key`` holds a range."""
        return self._held.get(key) is not None

    def chunk(self, held: Held, src: PageIndex, dst: PageIndex, pos: int, lo: int, hi: int,
              per_layer: int) -> tuple[PageIndex, PageIndex, Callable[[], None]]:
        """Index arrays of a chunk (pages ``src`` -> ``dst`` at positions ``pos..``, layers
        ``lo:hi``) through ``held``, and the copy that fills its cells before the post."""
        g = held.gather
        regions = np.arange(lo * per_layer, hi * per_layer, dtype=np.int64)[:, None]
        n = int(src.size)
        cells = held.first_cell + regions * held.npages + pos + np.arange(n, dtype=np.int64)[None, :]
        local = (g.local_base + cells).astype(np.int32).ravel()
        remote = (g.remote_base + regions * g.dst_pages + dst.astype(np.int64)[None, :]).astype(np.int32).ravel()
        first, last = int(regions[0, 0]), int(regions[-1, 0]) + 1

        def gather() -> None:
            index = torch.from_numpy(src.astype(np.int64))
            width = g.cell // self._memory.regions[0].tokens
            for r in range(first, last):
                start = held.offset + (r * held.npages + pos) * g.cell
                out = self.tensor[start : start + n * g.cell].view(n, -1, width)
                torch.index_select(self._pages[r][:, :, g.col : g.col + width], 0, index, out=out)

        return local, remote, gather


def staging_for(memory: KVMemory, nbytes: int, counts: collections.Counter[str]) -> Staging | None:
    """The staging buffer of a service over ``memory`` (``ServiceConfig.staging_bytes``),
    or None: disabled, or pages that are never sliced here (head-major, MLA, VRAM)."""
    return Staging(memory, nbytes, counts) if Staging.wanted(memory, nbytes) else None
