"""The pre-authentication slot pool's policy, step by step (``kvservice._control.preauth``)."""

from __future__ import annotations

import anyio
import pytest

from kvservice._control.preauth import (
    EVICTED,
    LIMIT,
    NO_ADDRESS,
    SOURCE_LIMIT,
    HandshakeSlots,
    Slot,
    budget_key,
    source_of,
)


def take(slots: HandshakeSlots, source: str) -> Slot:
    slot = slots.take(source)
    assert isinstance(slot, Slot), slot
    return slot


async def test_a_source_past_its_share_is_refused_and_others_are_not() -> None:
    slots = HandshakeSlots(total=8, per_source=3)
    held = [take(slots, "10.0.0.9") for _ in range(3)]
    assert slots.take("10.0.0.9") == SOURCE_LIMIT
    take(slots, "10.0.0.1")
    slots.give_back(held[0])
    slots.give_back(held[0])  # twice: counted once
    assert len(slots) == 3 and slots.held_by("10.0.0.9") == 2
    take(slots, "10.0.0.9")


async def test_a_full_pool_gives_a_lighter_source_the_heaviest_ones_oldest_slot() -> None:
    slots = HandshakeSlots(total=6, per_source=4)
    a = [take(slots, "a") for _ in range(4)]
    b = [take(slots, "b") for _ in range(2)]
    new = take(slots, "c")  # c holds 0 < a's 4: a's oldest goes
    assert a[0].evicted and a[0].scope.cancel_called and not a[0].held
    assert not any(s.evicted for s in [*a[1:], *b])
    assert len(slots) == 6 and slots.held_by("a") == 3 and slots.held_by("c") == 1
    assert take(slots, "b").source == "b"  # b holds 2 < a's 3
    assert a[1].evicted
    # now a 2, b 3, c 1: c again evicts b (the heaviest), never the other way round
    take(slots, "c")
    assert b[0].evicted and slots.held_by("b") == 2
    # a, b and c hold 2 each: nobody holds fewer than the heaviest, so all are refused
    for source in ("a", "b", "c"):
        assert slots.take(source) == LIMIT
    assert take(slots, "d").source == "d"  # a fourth source evicts the oldest of the tied
    assert a[2].evicted and not new.evicted
    assert EVICTED not in (LIMIT, SOURCE_LIMIT)


async def test_one_source_filling_the_pool_cannot_keep_out_another() -> None:
    """The finding: one source reopening whatever is closed.  Without a per-source bound it
    holds every slot; with either rule the other source always gets in, and is never evicted
    while the flooder holds more."""
    slots = HandshakeSlots(total=64, per_source=100)  # only the eviction rule at work
    flood = [take(slots, "127.0.0.2") for _ in range(64)]
    legit = [take(slots, "127.0.0.1") for _ in range(10)]
    for _ in range(200):  # the flooder reopens: refused (it is the heaviest) or evicts itself only
        outcome = slots.take("127.0.0.2")
        if isinstance(outcome, Slot):
            flood.append(outcome)
    assert not any(s.evicted for s in legit) and slots.held_by("127.0.0.1") == 10


@pytest.mark.parametrize(("remote", "source"), [
    (("127.0.0.2", 5), "127.0.0.2"),
    (("::ffff:10.1.2.3", 5, 0, 0), "10.1.2.3"),
    (("fe80::1%lo", 5, 0, 1), "fe80::1"),
    ("/tmp/sock", NO_ADDRESS),
    (None, NO_ADDRESS),
])
def test_source_of(remote: object, source: str) -> None:
    class Stream:
        def extra(self, attr: object, default: object = None) -> object:
            return default if remote is None else remote

    assert source_of(Stream()) == source  # type: ignore[arg-type]


@pytest.mark.parametrize(("source", "charged"), [
    ("10.1.2.3", "10.1.2.3"),
    ("127.0.0.1", "127.0.0.1"),  # where a local dialer connects from: its own share
    ("127.0.0.2", "127.0.0.0/8"),  # any other loopback address: one share for them all
    ("127.255.255.254", "127.0.0.0/8"),
    ("::1", "::1"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),  # an IPv6 host holds its /64
    ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
    ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
    ("fe80::1", "fe80::/64"),
    (NO_ADDRESS, NO_ADDRESS),
])
def test_the_budget_a_source_is_charged_to(source: str, charged: str) -> None:
    assert budget_key(source) == charged
    assert budget_key(charged) == charged  # a budget is its own


async def test_many_addresses_of_one_prefix_hold_one_share() -> None:
    """127.0.0.2-5 (every local process has them all) and the addresses of one IPv6 /64
    each hold one source's share together; 127.0.0.1 and another /64 keep theirs."""
    slots = HandshakeSlots(total=64, per_source=4)
    for i in range(4):
        take(slots, f"127.0.0.{2 + i}")
        take(slots, f"2001:db8::{i + 1}")
    assert slots.take("127.0.0.6") == SOURCE_LIMIT and slots.take("2001:db8::ffff") == SOURCE_LIMIT
    assert slots.held_by("127.0.0.2") == 4 and slots.held_by("2001:db8::/64") == 4
    assert take(slots, "127.0.0.1").source == "127.0.0.1"
    assert take(slots, "2001:db8:0:1::1").source == "2001:db8:0:1::/64"
    assert len(slots) == 10


async def test_an_eviction_cancels_the_handshake_it_wraps() -> None:
    slots = HandshakeSlots(total=1, per_source=1)
    victim = take(slots, "a")
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.sleep_forever)  # keeps the group honest: cancelled below
            with victim.scope:
                take(slots, "b")
                await anyio.sleep_forever()
            tg.cancel_scope.cancel()
    assert victim.evicted
