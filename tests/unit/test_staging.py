"""The staging buffer (``kvservice._transfer.staging``): its arena, what a send holds and
gives back, and the gather checked by moving bytes with a gathering pair's own tables
(a ``memmove`` per descriptor, as the fake door does) between engine-shaped tensors."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from kvservice import ServiceConfig
from kvservice._results import ConfigError
from kvservice._transfer.staging import NO_CELL, Arena, Stager, staging_for
from kvservice.memory._pairing import PeerKV
from kvservice.memory.synthetic import EngineSpec, SyntheticKV
from kvservice.testing.fake_door import copy


def kv(engine: str = "sglang_mha", **kw: object) -> SyntheticKV:
    kw.setdefault("heads", 4)
    return SyntheticKV(EngineSpec(engine=engine, layers=2, pages=8, page_tokens=4, head_dim=8, **kw))  # type: ignore[arg-type]


# -- the arena ---------------------------------------------------------------------------


def test_arena_takes_first_fit_aligned_and_merges_what_is_given_back() -> None:
    a = Arena(100)
    assert a.take(30, 10) == 0
    assert a.take(25, 10) == 30
    assert a.take(10, 7) == 56  # aligned up past 55
    assert a.used == 65
    assert a.take(50, 1) is None  # 34 bytes left in two pieces
    a.give(30, 25)
    assert a.take(26, 1) == 30  # 30..56 free again (the 1-byte gap at 55 merged in)
    a.give(0, 30)
    a.give(30, 26)
    a.give(56, 10)
    assert a.free_ranges == [(0, 100)] and a.used == 0


def test_arena_refuses_a_double_give_and_bad_sizes() -> None:
    a = Arena(64)
    off = a.take(16, 16)
    assert off is not None
    a.give(off, 16)
    with pytest.raises(ValueError, match="free already"):
        a.give(off, 16)
    with pytest.raises(ValueError):
        a.take(0, 1)
    with pytest.raises(ValueError):
        Arena(0)


# -- holding and giving back ----------------------------------------------------------------


def _gathering(nbytes: int) -> tuple[SyntheticKV, SyntheticKV, Stager, PeerKV]:
    src, dst = kv(tp_size=1), kv(tp_size=2, tp_rank=1)
    counts: collections.Counter[str] = collections.Counter()
    staging = staging_for(src.memory, nbytes, counts)
    assert staging is not None
    peer = PeerKV.of(src.memory, dst.memory, staging.area)
    assert peer.gather is not None and peer.scatter is None
    return src, dst, Stager(staging, 16), peer


def test_a_send_holds_one_range_decided_at_its_first_post_and_gives_it_back() -> None:
    # a cell: 4 tokens x 2 heads x 8 x 2 bytes = 128; 4 regions x 3 pages = 12 cells
    _, _, stager, peer = _gathering(12 * 128 + 100)
    staging = stager.staging
    assert peer.gather is not None and staging is not None
    a, b = object(), object()
    held = staging.hold(a, peer.gather, 3)
    assert held is not None and staging.hold(a, peer.gather, 3) is held
    assert staging.hold(b, peer.gather, 3) is None  # no room: per-token, and so for all its chunks
    assert staging.hold(b, peer.gather, 3) is None
    assert staging.counts == {"gathered": 1, "fallback_full": 1}
    stager.sent(b)  # it held nothing
    stager.sent(a)
    stager.sent(a)  # once only
    assert stager.held_bytes == 0
    assert staging.hold(object(), peer.gather, 13) is None  # more than the whole buffer
    assert staging.counts["fallback_too_large"] == 1


def test_no_staging_when_off_or_pages_are_never_sliced() -> None:
    counts: collections.Counter[str] = collections.Counter()
    assert staging_for(kv().memory, 0, counts) is None
    assert staging_for(kv("vllm_hnd").memory, 1 << 20, counts) is None  # head-major: one run per head
    assert staging_for(kv("mla", heads=1).memory, 1 << 20, counts) is None


def test_which_side_stages_follows_which_side_is_sliced() -> None:
    counts: collections.Counter[str] = collections.Counter()
    two = kv(tp_size=2)
    staging = staging_for(two.memory, 1 << 20, counts)
    assert staging is not None
    area = staging.area
    to_four = PeerKV.of(two.memory, kv(tp_size=4, tp_rank=1).memory, area, area)
    assert to_four.gather is not None and to_four.scatter is None  # the source alone is sliced
    assert to_four.scatter_in is not None  # and back from a tp 4 rank, this side scatters
    to_one = PeerKV.of(two.memory, kv(tp_size=1).memory, area, area)
    assert to_one.gather is None and to_one.scatter is not None and to_one.scatter_in is None
    assert PeerKV.of(two.memory, kv(tp_size=1).memory, area, None).scatter is None  # it has no staging
    same = PeerKV.of(two.memory, kv(tp_size=2).memory, area, area)
    assert same.gather is None and same.scatter is None and same.scatter_in is None  # whole pages


def _check_landed(dst: SyntheticKV, dest: list[int], lo: int, hi: int) -> None:
    assert dst.holds("r", dest, range(lo, hi))
    untouched = [p for p in range(8) if p not in dest]
    for t in dst.tensors:
        assert not t.view(dst.memory.num_pages, -1)[untouched].any()


@pytest.mark.parametrize("layers", [(0, 2), (1, 2)])
def test_gathered_chunks_land_exactly_the_destination_ranks_heads(layers: tuple[int, int]) -> None:
    """Two chunks of one send (positions 0-1, then 2), gathered, then moved by the pair's
    staged tables: the destination rank holds its heads of the pattern, nothing else moved."""
    src, dst, stager, peer = _gathering(1 << 16)
    lo, hi = layers
    pages, dest = [5, 0, 3], np.array([7, 1, 2], dtype=np.int32)
    src.fill("r", pages)
    remote, local = peer.tables()
    assert local is not None
    descriptors = 0
    send = object()
    for pos, chunk in ((0, [5, 0]), (2, [3])):
        s = np.array(chunk, dtype=np.int32)
        staged = stager.indices(send, "peer", "r", peer, s, dest[pos : pos + len(chunk)], pos, lo, hi, 3)
        assert staged is not None
        li, ri, gather = staged
        assert li.dtype == ri.dtype == np.int32 and li.shape == ri.shape and gather is not None
        assert (local[li, 1] == remote[ri, 1]).all(), "paired descriptors differ in length"
        gather()
        copy(local, remote, li.tolist(), ri.tolist())
        descriptors += int(li.size)
    assert descriptors == 3 * 2 * (hi - lo)  # one per page per region: no run per token
    _check_landed(dst, dest.tolist(), lo, hi)
    stager.sent(send)
    assert stager.held_bytes == 0


@pytest.mark.parametrize("tp_p", [2, 4])
def test_scattered_requests_land_exactly_their_heads_after_the_copy(tp_p: int) -> None:
    """The receiver (tp 1) names a range in each source's Expect; each sender's chunks
    write whole pages there with the pair's tables; the receiver's scatters put them into
    its pages' heads: every head of the pattern, nothing else moved."""
    dst = kv(tp_size=1)
    counts: collections.Counter[str] = collections.Counter()
    staging = staging_for(dst.memory, 1 << 16, counts)
    assert staging is not None
    receiver = Stager(staging, 16)
    pages, dest = [5, 0, 3], np.array([7, 1, 2], dtype=np.int32)
    for rank in range(tp_p):
        src, sender, rid = kv(tp_size=tp_p, tp_rank=rank), Stager(None, 16), f"r@{rank}"
        back = PeerKV.of(dst.memory, src.memory, staging.area)  # the receiver's view of the sender
        out = PeerKV.of(src.memory, dst.memory, None, staging.area)  # the sender's view of the receiver
        assert out.scatter is not None and out.gather is None
        src.fill("r", pages)
        cell = receiver.take(rid, back, dest)
        assert cell >= 0 and receiver.scatters(rid)
        assert sender.expected("recv-agent", rid, out, cell, 3) is None
        remote, local = out.tables()
        assert local is not None
        send = object()
        for pos, chunk in ((0, [5, 0]), (2, [3])):
            s = np.array(chunk, dtype=np.int32)
            staged = sender.indices(send, "recv-agent", rid, out, s, dest[pos : pos + len(chunk)], pos, 0, 2, 3)
            assert staged is not None
            li, ri, prepare = staged
            assert prepare is None and (local[li, 1] == remote[ri, 1]).all()
            copy(local, remote, li.tolist(), ri.tolist())
    assert counts == {"scattered": tp_p}
    assert not dst.tensors[0].any()  # in staging yet
    for rank in range(tp_p):
        receiver.scatter(f"r@{rank}")
    _check_landed(dst, dest.tolist(), 0, 2)
    for rank in range(tp_p):
        receiver.received(f"r@{rank}")
    assert receiver.held_bytes == 0


def test_an_expect_naming_a_range_the_pair_cannot_write_is_refused() -> None:
    src, dst = kv(tp_size=2), kv(tp_size=1)
    counts: collections.Counter[str] = collections.Counter()
    staging = staging_for(dst.memory, 4096, counts)
    assert staging is not None
    sender = Stager(None, 16)
    out = PeerKV.of(src.memory, dst.memory, None, staging.area)
    plain = PeerKV.of(src.memory, dst.memory, None, None)
    assert "outside the receiver's buffer" in (sender.expected("a", "r", out, 30, 3) or "")
    assert "does not write through" in (sender.expected("a", "r", plain, 0, 3) or "")
    assert sender.expected("a", "r", plain, NO_CELL, 3) is None


def test_a_send_whose_named_range_was_forgotten_fails_its_post_rather_than_guess() -> None:
    src, dst = kv(tp_size=2), kv(tp_size=1)
    staging = staging_for(dst.memory, 1 << 16, collections.Counter())
    assert staging is not None
    sender = Stager(None, 1)
    out = PeerKV.of(src.memory, dst.memory, None, staging.area)
    assert sender.expected("a", "r1", out, 0, 1) is None
    assert sender.expected("a", "r2", out, 8, 1) is None  # r1's entry falls out
    staged = sender.indices(object(), "a", "r1", out, np.array([1], dtype=np.int32), np.array([2], dtype=np.int32),
                            0, 0, 2, 1)
    assert staged is not None and staged[2] is not None
    with pytest.raises(ValueError, match="forgotten"):
        staged[2]()


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, True, 1.5, "64M", 1 << 40])
def test_staging_bytes_is_refused_naming_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match="staging_bytes"):
        ServiceConfig(staging_bytes=bad)  # type: ignore[arg-type]


def test_staging_bytes_zero_disables_it() -> None:
    assert ServiceConfig(staging_bytes=0).staging_bytes == 0
