"""The layout of a staged page: where a staging buffer is, and how a pair's descriptor
tables reach it.

Two ranks' token-major (``NHD``) pages that hold different head ranges move the heads
they share as one short run per token (``_pairing``).  Through a staging buffer the same
bytes move as one descriptor per page per region: the buffer is cut into *cells*, each
one page of one region of the side that is not sliced, laid out as that side's page is;
the sliced side's page holds a cell's bytes as ``col:col + cell // tokens`` of each token.

* ``StagingArea``: where a buffer is (this service's, or a peer's as its memory's
  description names it: ``area_from_wire``) and its descriptor table as cells.
* ``Route``: how a pair moves a request through one side's buffer (a *gather* through
  the sender's, a *scatter* through the receiver's): the cell, the column and where the
  cells and the whole pages start in the pair's tables (``_pairing.route`` builds it).

Which requests go through staging, the ranges they hold and the copies in and out of a
buffer are the request plane's (``kvservice._transfer.staging``): memory only says what
a staged page is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

#: at most this many staging cells in one pair's descriptor table (tiny cells: the rest unused)
MAX_CELLS = 1 << 20


@dataclass(frozen=True, slots=True)
class StagingArea:
    """Where a staging buffer is: what a pair's tables are built over."""

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


@dataclass(frozen=True, slots=True)
class Route:
    """How a pair moves a request through staging (one side's staging, cells of ``cell``
    bytes: one page of one region of the side that is not sliced).  The sliced side's
    pages hold it as bytes ``col:col + cell // tokens`` of each token.

    ``gather``: the local table goes on with our staging's cells at ``local_base``, the
    remote one with every destination page at ``remote_base``; a scatter: the local
    table goes on with every source page, the remote one with the receiver's cells."""

    gather: bool
    cell: int
    col: int
    local_base: int
    remote_base: int
    #: pages of the side whose whole pages move (destination: gather; source: scatter)
    pages: int
    #: cells of the staging buffer in the table
    cells: int


def area_from_wire(addr: int, nbytes: int) -> StagingArea | None:
    """A peer's staging buffer as its memory's description names it (0 bytes: none).
    Raises ``ValueError`` when it cannot be a buffer."""
    if nbytes == 0:
        return None
    if addr <= 0 or addr + nbytes > 1 << 64:
        raise ValueError(f"staging buffer at {addr:#x} of {nbytes} bytes overflows the address space")
    return StagingArea(addr, nbytes)
