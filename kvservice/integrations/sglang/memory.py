"""SGLang's ``KVArgs`` as ``kvservice.memory``, and its aux buffers as a request's payload.

SGLang hands a transfer backend raw buffers, not tensors (``KVArgs``):

* ``kv_data_ptrs`` / ``kv_data_lens`` / ``kv_item_lens``: one entry per buffer, an item
  being one page of that buffer.  An MHA pool lists every layer's K buffer, then every
  layer's V buffer (``MHATokenToKVPool``: ``k_buffer + v_buffer``); an MLA pool one latent
  buffer per layer.  kvservice wants regions in layer order (``L0.k, L0.v, L1.k ...``),
  so the K and V halves are interleaved here.
* Both sides describe their pools from what both of SGLang's schedulers set before
  ``KVManager(...)``: the buffers (``kv_data_*``, ``kv_item_lens``), ``page_size``,
  ``num_draft_entries``, the aux buffers.  Nothing else: SGLang's prefill also sets
  ``kv_head_num``, ``total_kv_head_num`` and ``gpu_id``, its decode none of them
  (``disaggregation/prefill.py`` and ``decode.py``, ``_init_kv_manager``), so a pool
  described from them would differ between the two sides of one model.  A rank's heads
  are therefore described as one (``heads=1``, ``head_dim`` = the bytes of all the
  rank's heads of one token): the backend pairs equal attention-TP only (``conn``), where
  pages move whole, and the handshake still compares bytes per page, tokens, layers.
* ``kv_cache_dtype_str`` may be ``"auto"`` (the model's dtype, which ``KVArgs`` does not
  carry), so a token's heads are described in bytes: ``dtype="uint8"``.
* ``aux_data_ptrs`` / ``aux_item_lens``: per-request metadata rows in CPU memory (the
  first output token, its logprobs, the bootstrap room...), row ``aux_index`` of each
  buffer.  kvservice carries them as the last chunk's payload (``send(payload=)``) and the
  decode writes them into its own rows when the request succeeds: one fewer transfer, and
  the metadata is authenticated with the rest.

Nothing here imports SGLang: ``kv_args`` is any object with those attributes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from ...memory import KVMemory, Region, from_regions


def _ints(kv_args: Any, name: str) -> list[int]:
    values = getattr(kv_args, name, None)
    if values is None:
        raise ValueError(f"KVArgs.{name} is not set")
    out = [int(v) for v in values]
    if any(v <= 0 for v in out):
        raise ValueError(f"KVArgs.{name}: every entry must be positive, got {out}")
    return out


def _buffers(kv_args: Any) -> tuple[list[int], list[int], list[int]]:
    ptrs, lens, items = (_ints(kv_args, n) for n in ("kv_data_ptrs", "kv_data_lens", "kv_item_lens"))
    if not ptrs or len(ptrs) != len(lens) or len(ptrs) != len(items):
        raise ValueError(f"KVArgs: kv_data_ptrs, kv_data_lens and kv_item_lens must be non-empty and as long "
                         f"as each other, got {len(ptrs)}, {len(lens)}, {len(items)}")
    return ptrs, lens, items


def kv_memory(kv_args: Any, *, is_mla: bool, tp_size: int, tp_rank: int, mem_type: str = "DRAM",
              device: int = 0) -> KVMemory:
    """The KV buffers ``kv_args`` describes, as ``KVMemory`` (nothing is copied).

    ``is_mla``: one latent buffer per layer, the same on every tensor-parallel rank;
    otherwise K buffers then V buffers, this rank's heads each (described as one).
    ``mem_type``: ``"VRAM"`` (GPU pools, on GPU ``device``) or ``"DRAM"``."""
    if mem_type not in ("DRAM", "VRAM"):
        raise ValueError(f"mem_type must be 'DRAM' or 'VRAM', got {mem_type!r}")
    if getattr(kv_args, "num_draft_entries", 0):
        raise ValueError("KVArgs: a draft model's KV (speculative decoding) is not supported by the kvservice backend")
    ptrs, lens, items = _buffers(kv_args)
    page_tokens = int(getattr(kv_args, "page_size", 0) or 0)
    if page_tokens <= 0:
        raise ValueError(f"KVArgs.page_size must be positive, got {page_tokens}")
    num_pages = {n // i for n, i in zip(lens, items, strict=True)}
    if any(n % i for n, i in zip(lens, items, strict=True)) or len(num_pages) != 1:
        raise ValueError(f"KVArgs: every buffer must hold the same whole number of pages "
                         f"(kv_data_lens {lens}, kv_item_lens {items})")
    device = device if mem_type == "VRAM" else 0
    if is_mla:
        order = [(layer, "latent", i) for layer, i in enumerate(range(len(ptrs)))]
    else:
        if len(ptrs) % 2:
            raise ValueError(f"KVArgs: an MHA pool lists K then V buffers, got an odd count ({len(ptrs)})")
        half = len(ptrs) // 2
        order = [(layer, kind, layer + j * half) for layer in range(half) for j, kind in enumerate(("k", "v"))]
    heads = 1  # the rank's heads as one: see the module's note
    regions = []
    for layer, kind, i in order:
        if items[i] != items[order[0][2]] or items[i] % (page_tokens * heads):
            raise ValueError(f"KVArgs: buffer {i} has pages of {items[i]} bytes; every buffer must have pages of "
                             f"{items[order[0][2]]} bytes, a multiple of page_size ({page_tokens})")
        regions.append(Region(ptrs[i], items[i], layer, kind, "uint8", page_tokens, heads,
                              items[i] // (page_tokens * heads), "NHD", device))
    segments = [(p, n, device) for p, n in zip(ptrs, lens, strict=True)]
    return from_regions(regions, num_pages.pop(), segments=segments, mem_type=mem_type,
                        tp_size=tp_size, tp_rank=tp_rank)


class AuxRows:
    """Row ``index`` of each of SGLang's aux (metadata) buffers, read as one payload on
    the prefill and written back on the decode.  The buffers are CPU memory the
    scheduler owns; the row is the scheduler's for as long as the request holds it."""

    def __init__(self, kv_args: Any) -> None:
        ptrs = [int(p) for p in getattr(kv_args, "aux_data_ptrs", None) or ()]
        lens = [int(n) for n in getattr(kv_args, "aux_data_lens", None) or ()]
        items = [int(n) for n in getattr(kv_args, "aux_item_lens", None) or ()]
        if len(ptrs) != len(lens) or len(ptrs) != len(items) or any(n <= 0 for n in items):
            raise ValueError("KVArgs: aux_data_ptrs, aux_data_lens and aux_item_lens must be as long as each "
                             "other, with positive item lengths")
        self._buffers: Sequence[tuple[int, int, int]] = list(zip(ptrs, lens, items, strict=True))
        self.row_bytes = sum(items)
        #: rows every buffer has (an aux index is below it)
        self.rows = min((size // item for _, size, item in self._buffers), default=0)

    def _rows(self, index: int) -> list[tuple[int, int]]:
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"aux index must be a non-negative int, got {index!r}")
        rows = []
        for ptr, size, item in self._buffers:
            if (index + 1) * item > size:
                raise ValueError(f"aux index {index} is past the end of an aux buffer of {size // item} rows")
            rows.append((ptr + index * item, item))
        return rows

    def read(self, index: int) -> bytes:
        """Row ``index`` of every aux buffer, concatenated."""
        return b"".join(ctypes.string_at(addr, n) for addr, n in self._rows(index))

    def write(self, index: int, payload: bytes) -> None:
        """Write ``payload`` (a peer's ``read``) into row ``index``; ``ValueError`` when
        its length is not this side's row length (the two sides' aux layouts differ)."""
        rows = self._rows(index)
        if len(payload) != self.row_bytes:
            raise ValueError(f"aux payload of {len(payload)} bytes, this side's aux row is {self.row_bytes} bytes "
                             "(prefill and decode must run the same model and metadata layout)")
        offset = 0
        for addr, n in rows:
            ctypes.memmove(addr, payload[offset:offset + n], n)
            offset += n
