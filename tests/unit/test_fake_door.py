"""The fake door itself: the bookkeeping the service tests rely on must be able to fail."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvservice import KVPool
from kvservice._control.protocol import ChunkNotif, encode_notif
from kvservice._nixl.door import DoorError, PostOp, TickPlan, XferState, run_tick
from kvservice._results import FailureReason
from kvservice.testing import FakeDoor, FakeFabric
from tests.helpers import SMALL, plane_indices, pool_table, register_pool

from .harness import unit_config


def pair() -> tuple[FakeFabric, FakeDoor, FakeDoor, KVPool, KVPool]:
    fabric = FakeFabric()
    a, b = fabric.factory("a", unit_config()), fabric.factory("b", unit_config())
    pa, pb = KVPool(SMALL), KVPool(SMALL)
    register_pool(a, pa)
    register_pool(b, pb)
    a.add_peer("b", b.metadata(), pool_table(SMALL, pb.base_addr))
    return fabric, a, b, pa, pb


def indices(pages: list[int]) -> npt.NDArray[np.int32]:
    return plane_indices(SMALL, np.array(pages, dtype=np.int32))


def test_post_copies_the_page_planes_and_delivers_the_notif() -> None:
    fabric, a, b, pa, pb = pair()
    pa.write([3, 4], torch.randn(SMALL.layers, 2, 2, SMALL.page_elems))
    xid, state = a.post("b", indices([3, 4]), indices([60, 0]), b"n1")
    assert state is XferState.DONE and a.release_counts[xid] == 1
    assert torch.equal(pb.pages([60, 0]), pa.pages([3, 4]))
    assert bool((pb.pages([1, 2, 59, 61]) == 0).all())
    assert b.notifs() == {"a": [b"n1"]} and b.notifs() == {}
    fabric.assert_clean()


def test_complete_after_and_hang() -> None:
    fabric, a, b, *_pools = pair()  # the pools stay alive: the doors copy their bytes
    a.complete_after(2)
    xid, state = a.post("b", indices([1]), indices([2]), b"x")
    assert state is XferState.PROC and b.notifs() == {}
    assert a.check(xid) is XferState.PROC
    assert a.check(xid) is XferState.DONE and b.notifs() == {"a": [b"x"]}
    a.hang()
    hung, _ = a.post("b", indices([1]), indices([3]), b"y")
    assert all(a.check(hung) is XferState.PROC for _ in range(20))
    assert a.finish_hung() == 1 and a.check(hung) is XferState.DONE
    fabric.assert_clean()


def test_check_after_release_is_a_violation_a_repeated_release_is_idempotent() -> None:
    fabric, a, _, *_pools = pair()  # the pools stay alive: the doors copy their bytes
    a.hang()
    xid, _ = a.post("b", indices([1]), indices([2]), b"x")
    assert a.release(xid) is True
    assert a.check(xid) is XferState.GONE
    assert a.release(xid) is False  # allowed by the Door contract, counted, not released again
    assert a.release(999) is False
    assert a.violations == [f"check({xid}) after release", "release(999): release of an id never posted"]
    assert a.release_counts[xid] == 1 and a.redundant_releases[xid] == 1
    with pytest.raises(AssertionError, match="after release"):
        fabric.assert_clean()


def test_a_handle_released_twice_by_nixl_fails_assert_clean() -> None:
    fabric, a, _, *_pools = pair()  # the pools stay alive: the doors copy their bytes
    a.hang()
    xid, _ = a.post("b", indices([1]), indices([2]), b"x")
    a.release_counts[xid] = 2  # as if NIXL's release had run twice
    a._live.clear()
    with pytest.raises(AssertionError, match="released 2 times"):
        fabric.assert_clean()


def test_a_leaked_handle_fails_assert_clean() -> None:
    fabric, a, _, *_pools = pair()  # the pools stay alive: the doors copy their bytes
    a.hang()
    a.post("b", indices([1]), indices([2]), b"x")
    with pytest.raises(AssertionError, match="1 live handles"):
        fabric.assert_clean()


def test_scripted_errors_carry_the_original() -> None:
    fabric, a, _, *_pools = pair()  # the pools stay alive: the doors copy their bytes
    original = ConnectionResetError("gone")
    a.fail_next_post(FailureReason.REMOTE_DISCONNECT, original)
    with pytest.raises(DoorError) as info:
        a.post("b", indices([1]), indices([2]), b"x")
    assert info.value.reason is FailureReason.REMOTE_DISCONNECT and info.value.original is original
    a.complete_after(5)
    xid, _ = a.post("b", indices([1]), indices([2]), b"x")
    a.fail_next_check(FailureReason.BACKEND, original)
    with pytest.raises(DoorError):
        a.check(xid)
    assert a.release_counts[xid] == 1 and a.live_xfers() == 0
    fabric.assert_clean()


def test_mismatched_descriptors_are_refused_and_recorded() -> None:
    _, a, _, *_pools = pair()  # the pools stay alive: the doors copy their bytes
    with pytest.raises(DoorError) as info:
        a.post("b", indices([1, 2]), indices([3]), b"x")
    assert info.value.reason is FailureReason.BACKEND
    with pytest.raises(DoorError):
        a.post("b", indices([1]).astype(np.int64), indices([3]), b"x")
    assert len(a.violations) == 2


def test_remove_peer_and_close_release_what_is_live() -> None:
    fabric, a, b, *_pools = pair()  # the pools stay alive: the doors copy their bytes
    a.hang()
    x1, _ = a.post("b", indices([1]), indices([2]), b"x")
    assert a.remove_peer("b") == [x1]
    with pytest.raises(DoorError) as info:
        a.post("b", indices([1]), indices([2]), b"x")
    assert info.value.reason is FailureReason.PEER_LOST
    b.close()
    b.close()  # idempotent
    assert fabric.lookup("b") is None
    fabric.assert_clean()


def test_run_tick_batches_posts_checks_and_notifs() -> None:
    fabric, a, b, pa, _pb = pair()  # the pools stay alive: the doors copy their bytes
    b.add_peer("a", a.metadata(), pool_table(SMALL, pa.base_addr))
    b.complete_after(1)
    notif = encode_notif(ChunkNotif("r", 0, 1), b"k" * 32)
    out = run_tick(b, TickPlan(posts=[PostOp("k", "a", indices([1]), indices([2]), notif)]))
    ((key, xid, state),) = out.posted
    assert key == "k" and state is XferState.PROC and out.live == 1
    assert isinstance(xid, int)
    out = run_tick(b, TickPlan(checks=[xid]))
    assert out.checked == [(xid, XferState.DONE)] and out.live == 0
    assert a.notifs() == {"b": [notif]}
    fabric.assert_clean()
