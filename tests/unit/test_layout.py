"""KVLayout: validation, its pool's descriptor table and indices, page checks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvservice import KVLayout, KVPool
from kvservice.memory import KVMemory
from kvservice.memory._pairing import Indexer, Pair, pair
from kvservice.memory._regions import regions_table
from kvservice.memory.engines import pool_regions

L = KVLayout(layers=3, page_tokens=4, kv_heads=2, head_dim=8, dtype="float16", num_pages=10)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("layers", 0), ("layers", -1), ("layers", True), ("layers", 2.0),
        ("page_tokens", 0), ("kv_heads", 0), ("head_dim", "64"), ("num_pages", 0),
    ],
)
def test_bad_sizes_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"KVLayout\.{field} must be a positive int"):
        KVLayout(**{field: value})


def test_bad_dtype_lists_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"KVLayout\.dtype must be one of .*bfloat16.*got 'float64'"):
        KVLayout(dtype="float64")


def test_indices_must_fit_int32() -> None:
    limit = np.iinfo(np.int32).max // 8
    KVLayout(layers=4, num_pages=limit)  # the largest that fits
    with pytest.raises(ValueError, match="int32"):
        KVLayout(layers=4, num_pages=limit + 1)


def test_sizes() -> None:
    assert L.planes == 6
    assert L.plane_bytes == 4 * 2 * 8 * 2
    assert L.page_bytes == 6 * L.plane_bytes
    assert L.pool_bytes == 10 * L.page_bytes
    assert L.shape == (3, 2, 10, 64)
    assert L.bytes_for(3) == 3 * L.page_bytes


def test_compatible_with_ignores_num_pages_and_names_differences() -> None:
    assert L.compatible_with(KVLayout(**{**L.wire_shape(), "num_pages": 99})) is None
    other = KVLayout(**{**L.wire_shape(), "head_dim": 16, "dtype": "bfloat16"})
    why = L.compatible_with(other)
    assert why is not None
    assert "head_dim: 8 here, 16 there" in why and "dtype: 'float16' here, 'bfloat16' there" in why


def test_pool_table_addresses() -> None:
    table = regions_table(pool_regions(L, 0x10000, device_id=3), L.num_pages)
    assert table.shape == (L.planes * L.num_pages, 3) and table.dtype == np.uint64
    assert table[0].tolist() == [0x10000, L.plane_bytes, 3]
    assert table[1, 0] == 0x10000 + L.plane_bytes
    assert table[-1, 0] == 0x10000 + L.pool_bytes - L.plane_bytes
    assert set(table[:, 1].tolist()) == {L.plane_bytes}
    assert set(table[:, 2].tolist()) == {3}


def test_pool_table_points_at_each_page_plane_of_a_real_pool() -> None:
    pool = KVPool(L)
    m = pool.memory
    table = regions_table(m.regions, m.num_pages)
    li, _ = Indexer(whole(m, m)).indices(np.array([0, 7, 9], dtype=np.int32), np.zeros(3, dtype=np.int32), 0, L.layers)
    planes = [(layer, kv) for layer in range(L.layers) for kv in (0, 1)]
    expected = [pool.tensor[layer, kv, page].data_ptr() for layer, kv in planes for page in (0, 7, 9)]
    assert table[li, 0].tolist() == expected


def test_indices_are_plane_major() -> None:
    m = KVPool(L).memory
    idx, _ = Indexer(whole(m, m)).indices(np.array([5, 6, 2], dtype=np.int32), np.zeros(3, dtype=np.int32),
                                          0, L.layers)
    assert idx.dtype == np.int32
    expected = [plane * L.num_pages + page for plane in range(L.planes) for page in (5, 6, 2)]
    assert idx.tolist() == expected
    # contiguous pages are adjacent in the list, within each plane
    per_plane = idx.reshape(L.planes, 3)
    assert (per_plane[:, 1] - per_plane[:, 0] == 1).all()


def test_indices_pair_up_between_two_pools() -> None:
    """Entry i of the local indices and entry i of the remote ones are the same plane."""
    remote = KVLayout(**{**L.wire_shape(), "num_pages": 40})
    src, dst = np.array([1, 2, 3], dtype=np.int32), np.array([30, 4, 39], dtype=np.int32)
    li, ri = Indexer(whole(KVPool(L).memory, KVPool(remote).memory)).indices(src, dst, 0, L.layers)
    assert li.shape == ri.shape == (L.planes * 3,)
    assert (li // L.num_pages).tolist() == (ri // remote.num_pages).tolist()
    assert (li % L.num_pages).tolist() == np.tile(src, L.planes).tolist()
    assert (ri % remote.num_pages).tolist() == np.tile(dst, L.planes).tolist()


def whole(a: KVMemory, b: KVMemory) -> Pair:
    p = pair(a, b)
    assert isinstance(p, Pair) and p.whole, p
    return p


def test_check_pages_accepts_lists_and_arrays() -> None:
    out = L.check_pages([3, 0, 9])
    assert out.dtype == np.int32 and out.tolist() == [3, 0, 9]
    assert L.check_pages(np.array([4, 5], dtype=np.int64)).tolist() == [4, 5]
    assert L.check_pages(torch.tensor([1, 2]).numpy()).tolist() == [1, 2]


@pytest.mark.parametrize(
    ("pages", "match"),
    [
        ([10], r"out of range: 10\.\.10, pool has 10 pages"),
        ([-1, 2], r"out of range: -1\.\.2"),
        ([1, 2, 1], "must not repeat"),
        ([], "non-empty 1-D"),
        ([[1, 2], [3, 4]], "non-empty 1-D"),
        ([1.0, 2.0], "must be integers"),
        (["1"], "must be integers"),
        ([True, False], "must be integers"),
    ],
)
def test_check_pages_errors(pages: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        L.check_pages(pages)
