"""What a test's pages hold: a deterministic pattern per request id.

The sender fills a request's pages with ``pattern(layout, request_id, n)`` and the
receiver checks them with ``holds``: both sides derive the same bytes from the
request id alone, so every byte is verified without shipping a checksum, across
processes and across restarts.
"""

from __future__ import annotations

import zlib

import torch

from ..memory._layout import KVLayout
from ..memory._pool import KVPool, torch_dtype


def pattern(layout: KVLayout, request_id: str, npages: int) -> torch.Tensor:
    """The bytes request ``request_id`` carries: shape (layers, 2, npages, page_elems)."""
    gen = torch.Generator().manual_seed(zlib.crc32(request_id.encode()))
    values = torch.randn((layout.layers, 2, npages, layout.page_elems), generator=gen)
    return values.to(torch_dtype(layout.dtype))


def holds(kv: KVPool, request_id: str, pages: list[int]) -> bool:
    """Whether ``pages`` of ``kv`` hold exactly what request ``request_id`` carries."""
    return bool(torch.equal(kv.pages(pages), pattern(kv.layout, request_id, len(pages))))
