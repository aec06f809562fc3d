"""Landing checks' arithmetic: the sender's and the receiver's CRC32C walk the same bytes
in the same order, for every pair (whole pages, tensor-parallel slices, MLA), so they
agree after a real move and disagree after one changed byte.  The moves are a
``memmove`` per descriptor of the pair's own tables (``test_memory.move``); the
transfers themselves are in tests/system/test_landing.py."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import numpy.typing as npt
import pytest

from kvservice import TensorParallel
from kvservice._config import ServiceConfig
from kvservice._control.protocol import LandingSum
from kvservice._results import ConfigError
from kvservice._transfer import landing
from kvservice.memory import KVMemory
from kvservice.memory._pairing import Pair, PeerKV, pair
from kvservice.memory._regions import View

from .test_memory import kv, move


def _pages(pages: list[int]) -> npt.NDArray[np.int32]:
    return np.array(pages, dtype=np.int32)


@pytest.mark.parametrize("engine", ["sglang_mha", "vllm", "vllm_hnd", "vllm_cpu", "mla"])
@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_the_sums_of_both_sides_agree_after_a_move_and_catch_one_changed_byte(
        engine: str, tp_p: int, tp_d: int) -> None:
    tp = TensorParallel(tp_p, tp_d, latent=engine == "mla")
    for i, j in itertools.product(range(tp_p), range(tp_d)):
        if i not in tp.sources(j):
            continue
        prefill, decode = kv(engine, tp_size=tp_p, tp_rank=i), kv(engine, tp_size=tp_d, tp_rank=j)
        prefill.fill("r", [1, 2, 5])
        p = pair(prefill.memory, decode.memory)
        assert isinstance(p, Pair), p
        back = PeerKV.of(decode.memory, prefill.memory).back  # what the receiver checks with
        assert back is not None
        src, dst = [1, 2, 5], [7, 0, 3]
        move(p, src, dst)
        sums = [LandingSum(landing.checksum(p.src, p.src_views, _pages(src[a:b]), lo, hi), a, b - a, lo, hi)
                for (a, b), (lo, hi) in [((0, 2), (0, 1)), ((0, 2), (1, 2)), ((2, 3), (0, 2))]]
        assert landing.mismatches(back, _pages(dst), sums) == []
        # one byte of the bytes moved, changed on the receiving side: that chunk's sum only
        runs = landing.spans(back.dst, back.dst_views, _pages([dst[2]]), 0, 1)
        cell = ctypes.c_uint8.from_address(int(runs[0][-1]) + int(runs[1][-1]) - 1)  # its last byte
        cell.value ^= 0xFF
        bad = landing.mismatches(back, _pages(dst), sums)
        assert [s for s, _ in bad] == [sums[2]], (engine, tp_p, tp_d, i, j)
        cell.value ^= 0xFF
        assert landing.mismatches(back, _pages(dst), sums) == []


def test_spans_merge_adjacent_runs_in_descriptor_order() -> None:
    m = kv("sglang_mha").memory
    addrs, lens = landing.spans(m, _whole(m), _pages([3, 4, 6]), 0, 1)
    k, v = m.regions[0], m.regions[1]
    # pages 3 and 4 of a region are adjacent: one run; page 6 is its own
    assert addrs.tolist() == [k.addr + 3 * k.page_stride, k.addr + 6 * k.page_stride,
                              v.addr + 3 * v.page_stride, v.addr + 6 * v.page_stride]
    assert lens.tolist() == [2 * k.page_bytes, k.page_bytes, 2 * v.page_bytes, v.page_bytes]


def _whole(m: KVMemory) -> list[View]:
    p = pair(m, m)
    assert isinstance(p, Pair)
    return list(p.src_views)


def test_landing_sums_outside_the_request_or_over_covered_cells_are_refused() -> None:
    kept = landing.Landing()
    assert "outside" in (kept.add(LandingSum(1, 1, 2, 0, 2), npages=2, layers=2) or "")
    assert "outside" in (kept.add(LandingSum(1, 0, 1, 1, 3), npages=2, layers=2) or "")
    assert "outside" in (kept.add(LandingSum(1, 0, 1, 1, 1), npages=2, layers=2) or "")
    assert kept.add(LandingSum(1, 0, 2, 0, 1), npages=2, layers=2) is None  # layer 0 of both pages
    assert kept.uncovered(npages=2, layers=2) == 2
    assert kept.add(LandingSum(1, 1, 1, 1, 2), npages=2, layers=2) is None
    assert kept.uncovered(npages=2, layers=2) == 1
    # a sum of the whole request again would make the receiver read it twice
    assert "covers 3 (page, layer) cells another sum covers" in (
        kept.add(LandingSum(1, 0, 2, 0, 2), npages=2, layers=2) or "")
    assert kept.add(LandingSum(1, 0, 1, 1, 2), npages=2, layers=2) is None
    assert kept.uncovered(npages=2, layers=2) == 0 and len(kept.sums) == 3


def test_a_sum_repeated_for_another_chunk_is_refused_not_counted_twice() -> None:
    """Chunk 2 carries chunk 1's sum: as many cells as the request has, yet half of it
    vouched for twice and the other half never.  Refused as it comes; the other half
    stays uncovered."""
    kept = landing.Landing()
    first = LandingSum(0x1234, 0, 1, 0, 2)  # page 0, both layers
    assert kept.add(first, npages=2, layers=2) is None
    why = kept.add(first, npages=2, layers=2)
    assert why is not None and "pages 0..0, layers 0..1 covers 2 (page, layer) cells another sum covers" in why
    assert kept.sums == [first] and kept.uncovered(npages=2, layers=2) == 2
    # one cell of it, or a larger sum over it, is refused the same way
    assert "covers 1 " in (kept.add(LandingSum(1, 0, 1, 1, 2), npages=2, layers=2) or "")
    assert "covers 2 " in (kept.add(LandingSum(1, 0, 2, 0, 2), npages=2, layers=2) or "")
    assert kept.add(LandingSum(0x5678, 1, 1, 0, 2), npages=2, layers=2) is None  # the chunk it left out
    assert kept.uncovered(npages=2, layers=2) == 0


def test_vram_refuses_landing_checks() -> None:
    m = kv("sglang_mha").memory
    assert landing.refusal(m) is None
    vram = KVMemory(m.regions, m.num_pages, m.segments, mem_type="VRAM")
    assert "VRAM" in (landing.refusal(vram) or "")


def test_verify_landing_is_a_bool() -> None:
    assert ServiceConfig().verify_landing is False
    assert ServiceConfig(verify_landing=True).verify_landing is True
    with pytest.raises(ConfigError, match="verify_landing"):
        ServiceConfig(verify_landing="yes")  # type: ignore[arg-type]
