"""Landing checks: the receiver proves that its pages hold the bytes the sender wrote.

Opt-in (``verify_landing``, ``expect(verify=)``), because it reads every byte twice.
A receiver that wants it says so in its Expect (``Expect.verify``); the sender then
computes, on its door thread just before each chunk's WRITE, the CRC32C of the bytes
that WRITE moves (its ``LandingSum``) and sends it in that chunk's notification.  Once
every chunk's notification has come, the receiver computes the same CRCs over its own
pages, on a worker thread (not the event loop, not the door thread), and reports
``SUCCESS`` only if each one matches; a mismatch fails the request ``CORRUPTED``.  A
sender that sends no checksum (a version without landing checks ignores
``Expect.verify``) fails it ``INCOMPATIBLE``: never an unchecked success.

Which bytes: a pair (``memory._pairing``) moves, for each page and region, the
``runs`` runs of its ``View`` on one side into the same-length runs of the other's,
entry *i* into entry *i*.  Both sides walk a chunk's runs in that order (region-major
over layers ``lo:hi``, then page, then run) and checksum their concatenation: the
sender over its source pages, the receiver over the destination pages.  A staging
buffer in between (a gather or a scatter, ``_transfer.staging``) moves the same bytes,
so the sums compare the pages themselves, after the scatter on the receiving side.

What it catches: bytes that differ in the receiver's pages from the sender's pages at
the time of the WRITE: a WRITE that landed short or elsewhere, pages overwritten
between the landing and the check (a page still in use, freed too early), a sender
whose pages changed after the checksum.  What it does not: a change on either side
after the check.  Host memory only: the CRC is computed by the CPU, so a service whose
KV is in VRAM refuses the ask (``refusal``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import crc32c
import numpy as np
import numpy.typing as npt

from .._control.protocol import ChunkNotif, LandingSum, encode_notif
from .._nixl.door import PostOp
from ..memory._layout import PageIndex
from ..memory._pairing import Pair
from ..memory._regions import KVMemory, View

#: the memory type a landing check can read (the CPU computes the CRC)
HOST = "DRAM"


def refusal(memory: KVMemory) -> str | None:
    """Why landing checks cannot run on ``memory`` (None: they can)."""
    if memory.mem_type != HOST:
        return (f"landing checks read the KV with the CPU, and this service's KV is in "
                f"{memory.mem_type}, not host memory (DRAM)")
    return None


def spans(memory: KVMemory, views: Sequence[View], pages: PageIndex, lo: int,
          hi: int) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Addresses and lengths of the runs of ``pages`` of layers ``lo:hi`` that a pair's
    ``views`` of ``memory`` move, in the pair's descriptor order (``Indexer.indices``),
    adjacent runs merged."""
    a, b = lo * memory.per_layer, hi * memory.per_layer
    regions, shown = memory.regions[a:b], views[a:b]
    runs = shown[0].runs  # a pair's views all have its ``runs``
    # (region, page, run), as the pair's tables are laid out
    base = np.array([r.addr + v.offset for r, v in zip(regions, shown, strict=True)], dtype=np.uint64)
    stride = np.array([r.page_stride for r in regions], dtype=np.uint64)
    run_stride = np.array([v.run_stride for v in shown], dtype=np.uint64)
    run = np.arange(runs, dtype=np.uint64)
    addr = (base[:, None, None] + stride[:, None, None] * pages.astype(np.uint64)[None, :, None]
            + run_stride[:, None, None] * run[None, None, :]).ravel()
    length = np.repeat(np.array([v.run_bytes for v in shown], dtype=np.uint64), pages.size * runs)
    ends = addr + length
    starts = np.flatnonzero(np.concatenate(([True], addr[1:] != ends[:-1])))
    merged = np.add.reduceat(length, starts)
    return addr[starts], merged.astype(np.uint64)


def checksum(memory: KVMemory, views: Sequence[View], pages: PageIndex, lo: int, hi: int) -> int:
    """The CRC32C of those runs' bytes, concatenated.  Reads process memory at the
    regions' addresses: ``memory`` must be this service's own, in host memory."""
    value = 0
    addrs, lens = spans(memory, views, pages, lo, hi)
    for addr, n in zip(addrs.tolist(), lens.tolist(), strict=True):
        # the GIL released for every run (the default keeps it below 32 KiB, a page's run
        # here): the event loop goes on while a door or worker thread checksums
        value = crc32c.crc32c((ctypes.c_char * n).from_address(addr), value, gil_release_mode=1)
    return value


class Seal:
    """A post's ``prepare`` (run on the door thread just before its WRITE): runs the
    post's own prepare (a staging gather), then checksums the chunk's source bytes and
    puts the sum into the post's notification."""

    __slots__ = ("_key", "_notif", "_op", "_out", "_pages", "_prepare", "_sum")

    def __init__(self, op: PostOp, out: Pair, notif: ChunkNotif, key: bytes, src: PageIndex,
                 pos: int, lo: int, hi: int) -> None:
        self._op = op
        self._prepare = op.prepare
        self._out = out
        self._notif = notif
        self._key = key
        self._pages = src
        self._sum = LandingSum(0, pos, int(src.size), lo, hi)

    def __call__(self) -> None:
        if self._prepare is not None:
            self._prepare()
        s = self._sum
        crc = checksum(self._out.src, self._out.src_views, self._pages, s.lo, s.hi)
        n = self._notif
        self._op.notif = encode_notif(
            ChunkNotif(n.request_id, n.chunk, n.total, n.payload, LandingSum(crc, s.pos, s.pages, s.lo, s.hi)),
            self._key)


def seal(op: PostOp, out: Pair, notif: ChunkNotif, key: bytes, src: PageIndex, pos: int, lo: int,
         hi: int) -> None:
    """Make ``op`` carry the landing sum of its chunk (pages ``src`` of layers ``lo:hi``,
    to the receiver's pages from ``pos`` on): computed on the door thread before it posts."""
    op.prepare = Seal(op, out, notif, key, src, pos, lo, hi)


class Landing:
    """A receiver's request's landing sums, as its chunks' notifications bring them.

    Every (page, layer) of a request is sent exactly once, so its chunks' sums cover
    each of its ``pages x layers`` cells once: a sum over a cell another sum covers is
    refused as it comes (a sender cannot vouch for one chunk twice and leave another
    unchecked, nor make the receiver checksum its pages over and over), cells no sum
    covers when the check starts (``uncovered``).  Which cells are covered is a bitmap
    of the request's own size (its pages, this service's layers), made on the first sum."""

    __slots__ = ("_covered", "sums")

    def __init__(self) -> None:
        self.sums: list[LandingSum] = []
        self._covered: npt.NDArray[np.bool_] | None = None  # [page, layer]: a sum covers it

    def add(self, s: LandingSum, npages: int, layers: int) -> str | None:
        """Keep one chunk's sum; why it cannot be (outside the request, or over cells
        another sum covers) or None."""
        if s.pos + s.pages > npages or not s.lo < s.hi <= layers:
            return (f"landing sum for pages {s.pos}..{s.pos + s.pages - 1}, layers {s.lo}..{s.hi - 1} "
                    f"outside the request's {npages} pages and {layers} layers")
        if self._covered is None:
            self._covered = np.zeros((npages, layers), dtype=np.bool_)
        cells = self._covered[s.pos : s.pos + s.pages, s.lo : s.hi]
        if cells.any():
            return (f"landing sum for pages {s.pos}..{s.pos + s.pages - 1}, layers {s.lo}..{s.hi - 1} "
                    f"covers {int(np.count_nonzero(cells))} (page, layer) cells another sum covers")
        cells[...] = True
        self.sums.append(s)
        return None

    def uncovered(self, npages: int, layers: int) -> int:
        """(page, layer) cells of the request no sum covers."""
        covered = 0 if self._covered is None else int(np.count_nonzero(self._covered))
        return npages * layers - covered


def mismatches(back: Pair, pages: PageIndex, sums: Sequence[LandingSum]) -> list[tuple[LandingSum, int]]:
    """The sums the destination pages ``pages`` (the request's, in order) do not match,
    each with the CRC found.  CPU work over every byte: run it off the event loop."""
    bad = []
    for s in sums:
        found = checksum(back.dst, back.dst_views, pages[s.pos : s.pos + s.pages], s.lo, s.hi)
        if found != s.crc:
            bad.append((s, found))
    return bad


