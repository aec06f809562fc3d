"""Staging: which requests move through a staging buffer, the range each holds, and the
copies in and out of it.

When two ranks' token-major (``NHD``) pages hold different head ranges, the heads a
pair moves are one short run per token of every page: one descriptor each
(``memory._pairing``).  Each service registers one staging buffer with NIXL at start, and
a request moves through it as one descriptor per page per region, as head-major
pages move:

* *gather* (the source is sliced: prefill tp 1 -> decode tp 2): the sender copies the
  shared heads of the request's pages into its staging, laid out exactly as the
  destination's pages are, and posts from there into the destination's pages;
* *scatter* (the destination is sliced: prefill tp 2 -> decode tp 1): the receiver
  takes a range of its staging when it expects the request and names it in the
  Expect (its buffer's address travels with its memory at the handshake); the
  sender writes its whole pages there, and the receiver copies them into its pages'
  head range once the last chunk's notification arrived, before the request
  reports SUCCESS.

What a staged page is (the buffer's cells, a pair's ``Route`` through it) is memory's
(``memory._staging``); this module is the request plane's use of it:

* ``Arena``: which bytes of the buffer are taken (first fit, aligned to the pair's cell).
* ``Staging``: the buffer (one DRAM tensor, one registered segment), its arena, the
  range each request holds, and the copies (a gather on the door thread just before
  the chunk's post, so the copy of chunk *k+1* overlaps the WRITE of chunk *k*; a
  scatter on the door thread too): never on the event loop.
* ``Stager``: the service's side of it: which requests go through staging, their
  index arrays, and when their ranges come back.

A request holds one range for all its pages: a cell per (region, page position), each
the bytes one page of one region moves. A send's gather range comes back once the
request is released (the watchdog's ``_settle_if_released``), on success and on every
failure path alike; a WRITE let go in flight may still read it then, but what it reads
lands only in the failed request's pages, unsettled until it has ended. A receiver's
scatter range comes back when its request is *settled* (``_settle``), exactly when its
pages could be reused: after the scatter on success; on failure once no WRITE of the
sender can land any more (its fence, its ``Settled``, its process gone), and not while a
scatter copies.

Staging is an optimisation: a request that finds no free range (or needs more than
the whole buffer) moves by the per-token descriptors, as without staging, and is
counted (``Stats.staging``).  Nothing waits for staging and nothing fails for lack
of it.  A receiver that names a range in its Expect is written there, or the sender
refuses the Expect: a pair never disagrees on where the bytes are.
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

from ..memory._layout import PageIndex
from ..memory._pairing import PeerKV
from ..memory._regions import KVMemory, Region
from ..memory._staging import Route, StagingArea

#: a request moves by per-token descriptors
NO_CELL = -1


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


@dataclass(slots=True)
class Held:
    """A request's range: ``nbytes`` at ``offset``, its cells from ``first_cell`` on,
    for ``npages`` page positions of every region."""

    offset: int
    nbytes: int
    first_cell: int
    npages: int
    route: Route
    #: a receiver's: its pages, where the scatter copies to
    pages: PageIndex | None = None


def _raw(region: Region, num_pages: int) -> torch.Tensor:
    """``region``'s pages as a ``(pages, tokens, bytes per token)`` uint8 view (DRAM)."""
    span = (num_pages - 1) * region.page_stride + region.page_bytes
    flat = torch.frombuffer((ctypes.c_uint8 * span).from_address(region.addr), dtype=torch.uint8)
    per_token = region.heads * region.head_dim * region.itemsize
    return flat.as_strided((num_pages, region.tokens, per_token), (region.page_stride, per_token, 1))


class Staging:
    """One service's staging buffer and who holds what of it (see the module docstring)."""

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

    def hold(self, key: object, r: Route, npages: int, pages: PageIndex | None = None) -> Held | None:
        """The range ``key`` (a request of ``npages`` pages) holds, taken now if it holds none;
        None: it moves by per-token descriptors (no room, counted)."""
        if key in self._held:  # decided once, for all its chunks
            return self._held[key]
        nbytes = len(self._memory.regions) * npages * r.cell
        offset = None
        if nbytes > r.cells * r.cell:
            self.counts["fallback_too_large"] += 1
        elif (offset := self.arena.take(nbytes, r.cell)) is None:
            self.counts["fallback_full"] += 1
        if offset is None:
            self._held[key] = None
            return None
        self.counts["gathered" if r.gather else "scattered"] += 1
        held = self._held[key] = Held(offset, nbytes, offset // r.cell, npages, r, pages)
        return held

    def release(self, key: object) -> None:
        """``key`` ended and nothing can land in (or be read from) its range: free again."""
        held = self._held.pop(key, None)
        if held is not None:
            self.arena.give(held.offset, held.nbytes)

    def held(self, key: object) -> Held | None:
        return self._held.get(key)

    def _cells(self, held: Held, r: int, pos: int, n: int) -> torch.Tensor:
        """The cells of positions ``pos..pos+n`` of region ``r``, as ``(n, tokens, width)``."""
        start = held.offset + (r * held.npages + pos) * held.route.cell
        width = held.route.cell // self._memory.regions[0].tokens
        return self.tensor[start : start + n * held.route.cell].view(n, -1, width)

    def gather(self, held: Held, src: PageIndex, pos: int, first: int, last: int) -> Callable[[], None]:
        """The copy of pages ``src`` (positions ``pos..``) of regions ``first:last`` into ``held``."""
        def copy() -> None:
            index = torch.from_numpy(src.astype(np.int64))
            n, col = int(src.size), held.route.col
            for r in range(first, last):
                out = self._cells(held, r, pos, n)
                torch.index_select(self._pages[r][:, :, col : col + out.shape[2]], 0, index, out=out)

        return copy

    def scatter(self, key: object) -> None:
        """Copy a receiver's range into its pages (the sender's WRITEs have all landed)."""
        held = self._held.get(key)
        assert held is not None and held.pages is not None
        n, col = int(held.pages.size), held.route.col
        # A strided destination copies ~25x faster by slices than by index_copy_: one per run
        # of consecutive pages (an engine's pages often come in runs).
        runs = _runs(held.pages)
        for r in range(len(self._memory.regions)):
            cells = self._cells(held, r, 0, n)
            heads = self._pages[r][:, :, col : col + cells.shape[2]]
            for pos, page, length in runs:
                heads[page : page + length].copy_(cells[pos : pos + length])


def _runs(pages: PageIndex) -> list[tuple[int, int, int]]:
    """``pages`` as runs of consecutive pages: (position, first page, length)."""
    breaks = np.flatnonzero(np.diff(pages.astype(np.int64)) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [pages.size]])
    return [(int(a), int(pages[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]


def staging_for(memory: KVMemory, nbytes: int, counts: collections.Counter[str]) -> Staging | None:
    """The staging buffer of a service over ``memory`` (``ServiceConfig.staging_bytes``),
    or None: disabled, or pages that are never sliced here (head-major, MLA, VRAM)."""
    return Staging(memory, nbytes, counts) if Staging.wanted(memory, nbytes) else None


def _regions(lo: int, hi: int, per_layer: int) -> npt.NDArray[np.int64]:
    return np.arange(lo * per_layer, hi * per_layer, dtype=np.int64)[:, None]


class Stager:
    """A service's use of staging: which requests move through it, their index arrays,
    and when their ranges come back.  ``staging`` None: this service has no buffer (it
    still writes into a receiver's)."""

    def __init__(self, staging: Staging | None, expects_kept: int) -> None:
        self.staging = staging
        #: sender: (receiver agent, request id) -> the cell its Expect named
        self._named: collections.OrderedDict[tuple[str, str], int] = collections.OrderedDict()
        self._kept = expects_kept
        self._scattering: dict[object, int] = {}  # sender: a send -> the cell it writes from

    @property
    def area(self) -> StagingArea | None:
        return self.staging.area if self.staging is not None else None

    @property
    def held_bytes(self) -> int:
        return self.staging.arena.used if self.staging is not None else 0

    # -- sender ---------------------------------------------------------------------------
    def expected(self, agent: str, rid: str, kv: PeerKV, cell: int, npages: int) -> str | None:
        """A receiver's Expect named ``cell`` of its staging (or ``NO_CELL``): why it is
        refused, or None (remembered for the send's first post)."""
        r = kv.scatter
        if cell != NO_CELL:
            if r is None:
                return "the expect names a staging range this pair does not write through"
            if cell < 0 or cell + len(kv.memory.regions) * npages > r.cells:
                return f"the expect's staging range (cell {cell}, {npages} pages) is outside the receiver's buffer"
        if r is not None and (agent, rid) not in self._named:
            self._named[(agent, rid)] = cell
            while len(self._named) > self._kept:
                self._named.popitem(last=False)
        return None

    def indices(self, req: object, peer: str, rid: str, kv: PeerKV, src: PageIndex, dst: PageIndex, pos: int,
                lo: int, hi: int, npages: int) -> tuple[PageIndex, PageIndex, Callable[[], None] | None] | None:
        """A send's chunk through staging: index arrays and the copy before its post (a
        gather), or None (per-token descriptors)."""
        assert kv.out is not None
        per_layer = kv.out.src.per_layer
        if kv.gather is not None and self.staging is not None:
            held = self.staging.hold(req, kv.gather, npages)
            if held is None:
                return None
            g = held.route
            regions = _regions(lo, hi, per_layer)
            cells = held.first_cell + regions * held.npages + pos + np.arange(src.size, dtype=np.int64)[None, :]
            local = (g.local_base + cells).astype(np.int32).ravel()
            remote = (g.remote_base + regions * g.pages + dst.astype(np.int64)[None, :]).astype(np.int32).ravel()
            return local, remote, self.staging.gather(held, src, pos, lo * per_layer, hi * per_layer)
        if kv.scatter is None:
            return None
        if req not in self._scattering:
            self._scattering[req] = self._named.pop((peer, rid), -2)
        cell = self._scattering[req]
        if cell == NO_CELL:
            return None
        if cell < 0:  # its Expect's entry was forgotten: fail the post rather than guess
            def forgotten() -> None:
                raise ValueError("the receiver's staging range for this request was forgotten (too many expects)")
            empty = np.empty(0, dtype=np.int32)
            return empty, empty, forgotten
        s = kv.scatter
        regions = _regions(lo, hi, per_layer)
        local = (s.local_base + regions * s.pages + src.astype(np.int64)[None, :]).astype(np.int32).ravel()
        cells = cell + regions * npages + pos + np.arange(src.size, dtype=np.int64)[None, :]
        return local, (s.remote_base + cells).astype(np.int32).ravel(), None

    def sent(self, req: object) -> None:
        """A send ended and the door released every handle of it."""
        self._scattering.pop(req, None)
        if self.staging is not None:
            self.staging.release(req)

    # -- receiver --------------------------------------------------------------------------
    def take(self, rid: str, kv: PeerKV | None, pages: PageIndex) -> int:
        """The first cell of the range an expect of ``pages`` from ``kv``'s peer holds (named in
        its Expect), or ``NO_CELL``."""
        if kv is None or kv.scatter_in is None or self.staging is None:
            return NO_CELL
        held = self.staging.hold(("recv", rid), kv.scatter_in, int(pages.size), pages)
        return NO_CELL if held is None else held.first_cell

    def scatters(self, rid: str) -> bool:
        return self.staging is not None and self.staging.held(("recv", rid)) is not None

    def scatter(self, rid: str) -> None:
        """On a worker thread: the arrived request's pages, from its range."""
        assert self.staging is not None
        self.staging.scatter(("recv", rid))

    def received(self, rid: str) -> None:
        """A receiver's request is settled: nothing lands in its range any more."""
        if self.staging is not None:
            self.staging.release(("recv", rid))
