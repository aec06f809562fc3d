"""Every bound refuses or drops, and counts: Expects for ids not sent yet (count and
age), live requests, and requests pinned to a receiver."""

from __future__ import annotations

import anyio
import pytest

from kvservice import FailureReason, Overloaded
from kvservice._transfer.early import SOURCE_LIMIT, EarlyExpects, ExpectRefused
from kvservice.memory._layout import KVLayout
from kvservice.testing import FakeFabric
from kvservice.testing.inspect import inside
from tests.helpers import eventually

from .harness import GUARD_S, fill, two_services, unit_config


def why(refused: ExpectRefused | None) -> str:
    return "" if refused is None else refused.why


def test_early_expects_bound_per_peer_and_expire_oldest_first() -> None:
    early = EarlyExpects(per_peer=2, ttl=10.0, pages_per_peer=100, pages_total=1000)
    pages = KVLayout().check_pages([1])
    assert early.add("a1", "A", pages, now=0.0) is None and early.add("a2", "A", pages, now=1.0) is None
    assert "max_unknown_expects" in why(early.add("a3", "A", pages, now=2.0))  # A is at its limit ...
    assert early.add("b1", "B", pages, now=3.0) is None  # ... B is not disturbed
    assert early.add("a2", "B", pages, now=3.5) is None  # B's Expect for an id A expects is B's own
    assert early.agents("a2") == ["A", "B"]
    assert early.expire(now=10.5) == [("a1", "A")]
    assert early.add("a3", "A", pages, now=10.5) is None  # room again
    assert early.pop("a2", "A") is not None and early.pop("a2", "A") is None
    assert early.agents("a2") == ["B"]  # A's abort of its own entry left B's
    assert sorted(early.drop_peer("A")) == ["a3"]
    assert len(early) == 2 and "b1" in early and early.agents("b1") == ["B"]


def test_early_expects_bound_pages_per_peer_and_in_total() -> None:
    early = EarlyExpects(per_peer=100, ttl=10.0, pages_per_peer=10, pages_total=15)
    six, five = KVLayout().check_pages(range(6)), KVLayout().check_pages(range(5))
    assert early.add("a1", "A", six, now=0.0) is None
    assert "max_unknown_expect_pages (10)" in why(early.add("a2", "A", six, now=0.0))
    assert early.add("b1", "B", six, now=0.0) is None
    assert "max_unknown_expect_pages_total (15)" in why(early.add("c1", "C", six, now=0.0))
    assert early.pages == 12
    assert early.pop("a1", "A") is not None and early.pages == 6
    assert early.add("c1", "C", five, now=0.0) is None and early.pages == 11
    assert early.expire(now=20.0) and early.pages == 0


def test_early_expects_charge_a_sources_agents_together_and_leave_other_sources_room() -> None:
    """Names cost nothing: four agents of one source hold at most its share, in entries and in
    pages, and another source's Expects still fit; what the source's agents free is its again."""
    early = EarlyExpects(per_peer=100, ttl=10.0, pages_per_peer=10, pages_total=16, per_source=3,
                         pages_per_source=8)
    two = KVLayout().check_pages(range(2))
    for agent in "ABC":
        assert early.add(f"{agent}1", agent, two, now=0.0, source="10.0.0.2") is None
    refused = early.add("D1", "D", two, now=0.0, source="10.0.0.2")
    assert refused is not None and refused.kind == SOURCE_LIMIT and "max_unknown_expects_per_source = 3" in refused.why
    assert early.pop("C1", "C") is not None and early.held_by_source("10.0.0.2") == (2, 4)
    refused = early.add("A2", "A", KVLayout().check_pages(range(5)), now=0.0, source="10.0.0.2")
    assert refused is not None and "max_unknown_expect_pages_per_source (8)" in refused.why
    assert early.add("D1", "D", two, now=0.0, source="10.0.0.2") is None
    assert early.held_by_source("10.0.0.2") == (3, 6)
    assert early.add("E1", "E", KVLayout().check_pages(range(8)), now=0.0, source="10.0.0.3") is None
    assert early.pages == 14
    assert early.drop_peer("A") == ["A1"] and early.held_by_source("10.0.0.2") == (2, 4)
    assert early.expire(now=20.0) and early.held_by_source("10.0.0.2") == (0, 0) and early.pages == 0


async def test_expects_for_unknown_ids_are_bounded_and_counted() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric, sender=unit_config(max_unknown_expects=3)) as (tx, rx):
            for i in range(5):
                await rx.expect(f"u{i}", [i], sender=tx.address)
            for i in (3, 4):  # refused at once, not left to time out
                result = await rx.await_arrival(f"u{i}", timeout=GUARD_S)
                assert result.reason is FailureReason.REFUSED and "max_unknown_expects" in result.message
            assert len(inside(tx).early) == 3
            assert tx.status()["refused"]["unknown_expect_limit"] == 2
            fill(tx, "u0", [9])
            sent = await tx.await_completion(await tx.send("u0", [9], last=True), timeout=GUARD_S)
            assert sent.ok, sent  # an accepted one still works


async def test_expects_for_unknown_ids_expire_and_the_receiver_is_told() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric, sender=unit_config(unknown_expect_ttl_s=0.2)) as (tx, rx):
            await rx.expect("old", [1], sender=tx.address)
            result = await rx.await_arrival("old", timeout=GUARD_S)
            assert result.reason is FailureReason.TIMEOUT and "no send()" in result.message
            assert len(inside(tx).early) == 0 and tx.status()["refused"]["unknown_expect_expired"] == 1


async def test_live_requests_are_bounded() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric, sender=unit_config(max_live_requests=2)) as (tx, rx):
            await tx.send("l1", [1], last=True)
            await tx.send("l2", [2], last=True)
            with pytest.raises(Overloaded, match="max_live_requests"):
                await tx.send("l3", [3], last=True)
            with pytest.raises(Overloaded):
                await tx.expect("l4", [4], sender=rx.address)
            assert tx.status()["refused"]["live_request_limit"] == 2
            assert await tx.abort("l1") is not None
            await tx.send("l3", [3], last=True)  # room again


async def test_a_request_pinned_to_a_receiver_refuses_any_other() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with (
            two_services(fabric) as (tx, thief),
            two_services(fabric) as (_, meant),
        ):
            data = fill(tx, "pin", [5, 6])
            # the thief's Expect arrives first (before the send) and again after it
            await thief.expect("pin", [1, 2], sender=tx.address)
            await eventually(lambda: "pin" in inside(tx).early, GUARD_S)
            handle = await tx.send("pin", [5, 6], last=True, receiver=meant.address)
            refused = await thief.await_arrival("pin", timeout=GUARD_S)
            assert refused.reason is FailureReason.REFUSED and "pinned" in refused.message
            assert handle.result is None  # still waiting for the right receiver
            await thief.expect("pin2", [3], sender=tx.address)  # unrelated ids are fine
            await meant.expect("pin", [7, 8], sender=tx.address)
            sent = await tx.await_completion(handle, timeout=GUARD_S)
            assert sent.ok, sent
            assert (await meant.await_arrival("pin", timeout=GUARD_S)).ok
            assert bool((meant.kv.pages([7, 8]) == data).all())
            assert bool((thief.kv.pages([1, 2]) == 0).all())
            assert tx.status()["refused"]["receiver_mismatch"] == 1
            with pytest.raises(ValueError, match="host:port"):
                await tx.send("bad", [1], last=True, receiver="nowhere")
