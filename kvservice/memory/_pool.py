"""The registered KV pool: a torch tensor shaped by a ``KVLayout``."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from ._layout import KVLayout
from ._regions import KVMemory
from .engines import pool_memory


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


class KVPool:
    """``tensor`` has shape ``(layers, 2, num_pages, page_elems)``; page *p* of
    layer *l* is ``tensor[l, 0, p]`` (K) and ``tensor[l, 1, p]`` (V)."""

    def __init__(self, layout: KVLayout, tensor: torch.Tensor | None = None) -> None:
        dtype = torch_dtype(layout.dtype)
        if tensor is None:
            # zeros() touches every page once: untouched memory copies ~5x slower.
            tensor = torch.zeros(layout.shape, dtype=dtype)
        elif tuple(tensor.shape) != layout.shape or tensor.dtype != dtype:
            raise ValueError(
                f"pool tensor must be {layout.shape} {dtype}, got {tuple(tensor.shape)} {tensor.dtype}"
            )
        elif not tensor.is_contiguous():
            raise ValueError("pool tensor must be contiguous")
        self.layout = layout
        self.tensor = tensor

    @property
    def base_addr(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def device_id(self) -> int:
        return max(self.tensor.get_device(), 0)

    @functools.cached_property
    def memory(self) -> KVMemory:
        """The pool as regions: what a service registers and peers see."""
        return pool_memory(self.layout, self.tensor)

    def pages(self, pages: Sequence[int] | np.ndarray) -> torch.Tensor:
        """A copy of ``pages`` across all planes: shape (layers, 2, len(pages), page_elems)."""
        idx = torch.as_tensor(self.layout.check_pages(pages), dtype=torch.long)
        return self.tensor.index_select(2, idx)

    def write(self, pages: Sequence[int] | np.ndarray, values: torch.Tensor) -> None:
        idx = torch.as_tensor(self.layout.check_pages(pages), dtype=torch.long)
        self.tensor.index_copy_(2, idx, values.to(self.tensor.dtype))
