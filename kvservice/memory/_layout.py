"""The shape of kvservice's own KV pool, and page-list validation.

The pool is one tensor of shape ``(layers, 2, num_pages, page_elems)``: for each
layer a K plane and a V plane, each an array of pages.  One page is therefore
``2 * layers`` page-planes of ``plane_bytes`` each; as regions (``_regions``) each
plane is one region, so consecutive pages of one plane are adjacent in memory
*and* in the descriptor list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

# name -> bytes per element.  Names are torch's dtype attribute names.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

PageIndex = npt.NDArray[np.int32]
#: page lists up to this long are validated with Python ints (faster than numpy when short)
_SHORT = 64


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of a KV pool.  Two services can exchange pages when every field
    but ``num_pages`` is equal (see ``compatible_with``)."""

    layers: int = 4
    page_tokens: int = 16
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "bfloat16"
    num_pages: int = 256

    def __post_init__(self) -> None:
        for name in ("layers", "page_tokens", "kv_heads", "head_dim", "num_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(
                f"KVLayout.dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}"
            )
        if self.num_pages > np.iinfo(np.int32).max // (2 * self.layers):
            raise ValueError("KVLayout: layers * 2 * num_pages must fit in int32 indices")

    # -- sizes -------------------------------------------------------------------
    @property
    def planes(self) -> int:
        return 2 * self.layers

    @property
    def page_elems(self) -> int:
        return self.page_tokens * self.kv_heads * self.head_dim

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def plane_bytes(self) -> int:
        """Bytes of one page in one plane: the size of one descriptor."""
        return self.page_elems * self.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all planes."""
        return self.planes * self.plane_bytes

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.layers, 2, self.num_pages, self.page_elems)

    # -- compatibility -------------------------------------------------------------
    def wire_shape(self) -> dict[str, Any]:
        """Fields that must match between peers."""
        return {
            "layers": self.layers,
            "page_tokens": self.page_tokens,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }

    def compatible_with(self, other: KVLayout) -> str | None:
        """``None`` when pages can move between the two pools, else why not."""
        mine, theirs = self.wire_shape(), other.wire_shape()
        diffs = [f"{k}: {mine[k]!r} here, {theirs[k]!r} there" for k in mine if mine[k] != theirs[k]]
        return "; ".join(diffs) or None

    # -- pages and descriptors ----------------------------------------------------
    def check_pages(self, pages: Sequence[int] | npt.NDArray[Any]) -> PageIndex:
        """Validate a page list against this pool and return it as int32 (``check_pages``)."""
        return check_pages(pages, self.num_pages)

    def bytes_for(self, npages: int) -> int:
        return npages * self.page_bytes


def check_pages(pages: Sequence[int] | npt.NDArray[Any], num_pages: int) -> PageIndex:
    """Validate a page list and return it as int32.  Raises ``ValueError``.

    Runs for every ``send``, ``expect`` and received Expect, so short page
    lists (the common case) are checked with plain ints: numpy's ``unique``
    and reductions cost ~10 us each on a handful of elements.
    """
    if isinstance(pages, list) and 0 < len(pages) <= _SHORT and all(type(p) is int for p in pages):
        values: list[int] = pages
    else:
        arr = np.asarray(pages)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError("pages must be a non-empty 1-D sequence of page indices")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"pages must be integers, got dtype {arr.dtype}")
        if arr.size > _SHORT:
            return _check_page_array(arr, num_pages)
        values = arr.tolist()
    lo, hi = min(values), max(values)
    if lo < 0 or hi >= num_pages:
        raise ValueError(f"pages out of range: {lo}..{hi}, pool has {num_pages} pages")
    if len(set(values)) != len(values):
        raise ValueError("pages must not repeat within a request")
    return np.array(values, dtype=np.int32)


def _check_page_array(arr: npt.NDArray[Any], num_pages: int) -> PageIndex:
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= num_pages:
        raise ValueError(f"pages out of range: {lo}..{hi}, pool has {num_pages} pages")
    out = arr.astype(np.int32, copy=False)
    ordered = np.sort(out)
    if bool((ordered[1:] == ordered[:-1]).any()):
        raise ValueError("pages must not repeat within a request")
    return out
