"""KV memory as regions: engine constructors, validation, pairing (tensor-parallel
slicing) and the descriptor math, checked by moving bytes with the pair's own tables
(a ``memmove`` per descriptor, as the fake door does) between engine-shaped tensors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvservice import TensorParallel, TransferService
from kvservice._transfer.requests import place
from kvservice.memory import KVMemory, Region, from_regions, mla, sglang_mha, vllm_blocks, vllm_cpu_blocks
from kvservice.memory._pairing import Indexer, Pair, compare, pair
from kvservice.memory._regions import memory_from_wire, memory_to_wire, regions_table
from kvservice.memory.synthetic import ENGINES, EngineSpec, SyntheticKV
from kvservice.testing.fake_door import FakeFabric, copy

from .harness import GUARD_S, unit_config


def kv(engine: str = "sglang_mha", **kw: object) -> SyntheticKV:
    kw.setdefault("heads", 1 if engine == "mla" else 4)
    kw.setdefault("head_dim", 8)
    return SyntheticKV(EngineSpec(engine=engine, layers=2, pages=8, page_tokens=4, **kw))  # type: ignore[arg-type]


def move(p: Pair, src: list[int], dst: list[int], lo: int = 0, hi: int | None = None) -> int:
    """Copy ``src`` pages to ``dst`` pages of layers lo:hi with ``p``'s tables; the descriptor count."""
    li, ri = Indexer(p).indices(np.array(src, dtype=np.int32), np.array(dst, dtype=np.int32),
                                lo, p.src.layers if hi is None else hi)
    assert li.dtype == ri.dtype == np.int32 and li.shape == ri.shape
    stable, dtable = p.src_table(), p.dst_table()
    assert (stable[li, 1] == dtable[ri, 1]).all(), "paired descriptors differ in length"
    copy(stable, dtable, li.tolist(), ri.tolist())
    return int(li.size)


# -- constructors: regions point at the engine's pages --------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_regions_point_at_every_page_of_the_engine_tensors(engine: str) -> None:
    k = kv(engine)
    m = k.memory
    table = regions_table(m.regions, m.num_pages)
    assert m.num_pages == 8 and m.layers == 2 and len(m.regions) == 2 * m.per_layer
    for r, region in enumerate(m.regions):
        kind = 1 if region.kind == "v" else 0  # a fused K/V region starts with K
        for page in range(m.num_pages):
            view = k.page(region.layer, kind, page)
            start = view.data_ptr() if region.order == "NHD" else view.permute(1, 0, 2).data_ptr()
            assert table[r * m.num_pages + page].tolist() == [start, region.page_bytes, 0]
            assert region.page_bytes == view.numel() * view.element_size() * region.planes
    assert m.page_bytes == sum(r.page_bytes for r in m.regions)
    assert len(m.segments) == len(k.tensors) and m.mem_type == "DRAM"


def test_constructors_refuse_what_they_cannot_describe() -> None:
    t = torch.zeros(16, 2, 8)
    with pytest.raises(ValueError, match="as many layers"):
        sglang_mha([t, t], [t], 4)
    with pytest.raises(ValueError, match="page_size 32"):
        sglang_mha([t], [t], 32)
    with pytest.raises(ValueError, match="not contiguous"):
        strided = torch.zeros(16, 8, 2).transpose(1, 2)
        sglang_mha([strided], [strided], 4)
    with pytest.raises(ValueError, match="K/V dimension of 2"):
        vllm_blocks([torch.zeros(3, 4, 4, 2, 8)])
    with pytest.raises(ValueError, match=r"2 \* head_dim"):
        vllm_cpu_blocks([torch.zeros(3, 2, 32, 9)])
    with pytest.raises(ValueError, match="expected 4 dimensions"):
        vllm_cpu_blocks([torch.zeros(2, 3, 2, 32, 8)])
    with pytest.raises(ValueError, match=r"fused K/V region is head-major"):
        Region(4096, 4096, 0, "kv", "float32", 4, 2, 8, "NHD")
    with pytest.raises(ValueError, match=r"expected \(num_tokens, 1, width\)"):
        mla([torch.zeros(16, 2, 8)], 4)
    with pytest.raises(ValueError, match="layer 0 is"):
        sglang_mha([t, torch.zeros(16, 2, 4)], [t, t], 4)
    with pytest.raises(ValueError, match=r"dtype torch\.float64 is not supported"):
        mla([torch.zeros(16, 1, 8, dtype=torch.float64)], 4)


def test_memory_validation_names_the_region() -> None:
    base = kv().memory
    r0, r1 = base.regions[0], base.regions[1]
    with pytest.raises(ValueError, match=r"one fused K/V region; layer 0 has \['k', 'k'\]"):
        KVMemory((r0, r0), base.num_pages, base.segments)
    with pytest.raises(ValueError, match=r"region 2 is L1\.v, expected L1\.k"):
        KVMemory((r0, r1, base.regions[3], base.regions[2]), base.num_pages, base.segments)
    with pytest.raises(ValueError, match="pages would overlap"):
        Region(r0.addr, 16, 0, "k", "bfloat16", 4, 2, 8)
    with pytest.raises(ValueError, match="outside every registered segment"):
        KVMemory((r0, r1), base.num_pages + 100, base.segments)
    with pytest.raises(ValueError, match="tp_rank 2 of tp_size 2"):
        KVMemory(base.regions, base.num_pages, base.segments, tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match="give the tensors"):
        from_regions(base.regions, base.num_pages)


def test_wire_round_trip() -> None:
    m = kv("vllm_hnd", tp_size=2, tp_rank=1).memory
    back = memory_from_wire(memory_to_wire(m))
    assert back.regions == m.regions and (back.num_pages, back.tp_size, back.tp_rank) == (8, 2, 1)


def test_compare_names_the_first_region_that_differs() -> None:
    a = kv().memory
    assert compare(a, kv().memory) is None
    assert compare(a, kv(dtype="float16").memory) == \
        "region 0 (L0.k): dtype 'bfloat16' here, 'float16' there"
    assert "layers: 2 here, 3 there" in (compare(a, SyntheticKV(EngineSpec(layers=3, pages=8)).memory) or "")
    assert "model KV heads: 4 here" in (compare(a, kv(heads=2).memory) or "")
    assert "order 'NHD' here, 'HND' there" in (compare(kv("vllm").memory, kv("vllm_hnd").memory) or "")
    assert "regions per layer" in (compare(a, kv("mla").memory) or "")
    fused = compare(kv("vllm_hnd").memory, kv("vllm_cpu").memory) or ""
    assert "regions per layer: ['k', 'v'] here, ['kv'] there" in fused
    # a hand-described memory whose V regions of layer 1 hold half the heads
    regions = list(a.regions)
    half = regions[3]
    regions[3] = Region(half.addr, half.page_stride, 1, "v", half.dtype, half.tokens, 2, half.head_dim)
    odd = from_regions(regions, a.num_pages, segments=a.segments)
    assert compare(a, odd) == f"region 3 (L1.v): {half.page_bytes} bytes per page here, {half.page_bytes // 2} there"


# -- pairs: whole pages, or the heads two ranks share --------------------------------------------


@pytest.mark.parametrize("engine", ["sglang_mha", "vllm", "vllm_blocks_first", "vllm_hnd", "vllm_cpu"])
@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 4)])
def test_each_decode_rank_gets_exactly_its_heads_from_its_sources(engine: str, tp_p: int, tp_d: int) -> None:
    tp = TensorParallel(tp_p, tp_d)
    prefill = [kv(engine, tp_size=tp_p, tp_rank=i) for i in range(tp_p)]
    decode = [kv(engine, tp_size=tp_d, tp_rank=j) for j in range(tp_d)]
    for k in prefill:
        k.fill("r", [1, 2, 5])
    for i, j in itertools.product(range(tp_p), range(tp_d)):
        p = pair(prefill[i].memory, decode[j].memory)
        if i not in tp.sources(j):
            assert isinstance(p, str) and "none in common" in p
            continue
        assert isinstance(p, Pair), p
        sliced = tp_p != tp_d
        runs = 4 if sliced and engine not in ("vllm_hnd", "vllm_cpu") else 1
        assert p.runs == runs
        n = move(p, [1, 2, 5], [7, 0, 3])
        assert n == 3 * len(p.src.regions) * runs  # never one descriptor per token unless token-major and sliced
        # the heads both ranks hold: 4 / max(tp_p, tp_d) of them
        assert p.page_bytes == prefill[i].memory.page_bytes * tp_p // max(tp_p, tp_d)
    for j, d in enumerate(decode):
        assert d.holds("r", [7, 0, 3]), f"decode rank {j}"
        assert d.untouched([1, 2, 4, 5, 6])


@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_mla_each_decode_rank_has_one_source_and_the_whole_latent(tp_p: int, tp_d: int) -> None:
    tp = TensorParallel(tp_p, tp_d, latent=True)
    prefill = [kv("mla", tp_size=tp_p, tp_rank=i) for i in range(tp_p)]
    decode = [kv("mla", tp_size=tp_d, tp_rank=j) for j in range(tp_d)]
    for k in prefill:
        k.fill("m", [0, 6])
    for j, d in enumerate(decode):
        (i,) = tp.sources(j)
        p = pair(prefill[i].memory, d.memory)
        assert isinstance(p, Pair) and p.whole
        move(p, [0, 6], [4, 5])
        assert d.holds("m", [4, 5])
        others = [x for x in range(tp_p) if x != i]
        assert all(isinstance(pair(prefill[x].memory, d.memory), str) for x in others)
    assert sorted(j for i in range(tp_p) for j in tp.targets(i)) == list(range(tp_d))


def test_layers_move_separately_and_land_once() -> None:
    a, b = kv("vllm"), kv("vllm")
    a.fill("l", [3, 4])
    p = pair(a.memory, b.memory)
    assert isinstance(p, Pair)
    assert move(p, [3, 4], [0, 1], 1, 2) == 2 * 2  # one layer: K and V, two pages
    assert b.holds("l", [0, 1], range(1, 2)) and not b.holds("l", [0, 1], range(0, 1))
    move(p, [3, 4], [0, 1], 0, 1)
    assert b.holds("l", [0, 1])


def test_tensor_parallel_routing() -> None:
    tp = TensorParallel(4, 2)
    assert [tp.sources(j) for j in range(2)] == [[0, 1], [2, 3]]
    assert [tp.targets(i) for i in range(4)] == [[0], [0], [1], [1]]
    tp = TensorParallel(2, 4)
    assert [tp.sources(j) for j in range(4)] == [[0], [0], [1], [1]]
    assert tp.targets(1) == [2, 3]
    assert TensorParallel(3, 2).sources(0) == [0, 1]  # uneven: rank 1's heads straddle both
    assert TensorParallel.request_id("r", 1, 0) == "r@tp1.0"
    with pytest.raises(ValueError, match=r"decode rank 2 is not in 0\.\.1"):
        TensorParallel(4, 2).sources(2)
    with pytest.raises(ValueError, match="positive int"):
        TensorParallel(0, 1)


# -- layer positions and the send() inputs that go with them ---------------------------------------


def test_place_gives_every_layer_its_own_position() -> None:
    assert place(0, None, 4, 0, 3, 3) == (0, None, 4)  # whole pages: the fast path
    pos, cursors, top = place(4, None, 2, 1, 2, 3)
    assert (pos, cursors, top) == (4, [4, 6, 4], 6)
    pos, cursors, top = place(4, [4, 6, 4], 2, 0, 1, 3)
    assert (pos, cursors, top) == (4, [6, 6, 4], 6)
    assert place(4, [6, 6, 4], 2, 2, 3, 3) == (4, None, 6)  # all equal again
    with pytest.raises(ValueError, match=r"layers 0..2 have been sent up to different pages \(\[6, 6, 4\]\)"):
        place(4, [6, 6, 4], 1, 0, 3, 3)


async def test_layer_and_payload_inputs_raise_before_anything_is_queued() -> None:
    fabric = FakeFabric()
    async with TransferService(unit_config(max_payload_bytes=64 * 1024), door_factory=fabric.factory) as svc:
        with pytest.raises(ValueError, match="out of range: 2 layers"):
            await svc.send("a", [1], layers=range(1, 3))
        with pytest.raises(ValueError, match="non-empty range with step 1"):
            await svc.send("a", [1], layers=range(0, 2, 2))
        with pytest.raises(ValueError, match="payload must be bytes"):
            await svc.send("a", [1], last=True, payload="text")  # type: ignore[arg-type]
        await svc.send("b", [1, 2], layers=range(0, 1))
        with pytest.raises(ValueError, match="last chunk leaves layers at different pages"):
            await svc.send("b", [3], layers=range(1, 2), last=True)
        with pytest.raises(ValueError, match="sent up to different pages"):
            await svc.send("b", [3])
        handle = await svc.send("b", [1, 2], layers=range(1, 2), last=True)  # completes the layers
        assert svc.status()["sending"] == 1
        assert (await svc.abort("b")) is not None
        assert (await svc.await_completion(handle, timeout=GUARD_S)).settled
    fabric.assert_clean()
