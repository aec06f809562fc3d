"""The idle back-off of the watchdog (``_transfer.cadence``), which receivers it knows to poll
(``Warmth``), and the lag monitor's idle sleep."""

from __future__ import annotations

import itertools

import anyio
import pytest

from kvservice._stats import LAG_IDLE_INTERVAL_S, Stats
from kvservice._transfer.cadence import IDLE_FIRST_S, WARM_GRACE_S, IdleBackoff, Warmth
from tests.helpers import eventually


def test_idle_waits_double_up_to_the_ceiling() -> None:
    backoff = IdleBackoff(1.0)
    waits = [backoff.next() for _ in range(8)]
    assert waits[0] == IDLE_FIRST_S
    assert all(b == min(1.0, 2 * a) for a, b in itertools.pairwise(waits))
    assert waits[-1] == 1.0


def test_reset_starts_the_back_off_again() -> None:
    backoff = IdleBackoff(1.0)
    for _ in range(10):
        backoff.next()
    backoff.reset()
    assert backoff.next() == IDLE_FIRST_S


def test_a_ceiling_below_the_first_wait_is_a_steady_cadence() -> None:
    backoff = IdleBackoff(0.01)
    assert [backoff.next() for _ in range(4)] == [0.01] * 4


def test_a_receiver_counts_as_polling_for_half_its_grace_after_the_tick_that_completed_its_request() -> None:
    warmth = Warmth()
    assert not warmth.polls("rx", 100.0)  # never seen: cold
    warmth.saw("rx", 100.0)
    assert warmth.polls("rx", 100.0) and warmth.polls("rx", 100.0 + WARM_GRACE_S / 2 - 1e-6)
    assert not warmth.polls("rx", 100.0 + WARM_GRACE_S / 2)  # the other half is the receiver loop's margin
    assert not warmth.polls("other", 100.0)
    warmth.saw("rx", 200.0)  # a later tick: counted from it
    assert warmth.polls("rx", 200.0 + WARM_GRACE_S / 4)


def test_every_peer_of_a_ticks_posts_must_poll_and_a_forgotten_one_is_cold() -> None:
    warmth = Warmth()
    warmth.saw("a", 10.0)
    warmth.saw("b", 10.0)
    assert warmth.all_poll(["a", "b", "a"], 10.001)
    assert not warmth.all_poll(["a", "c"], 10.001)
    warmth.forget("b")
    warmth.forget("never-seen")  # nothing to forget: no error
    assert not warmth.all_poll(["a", "b"], 10.001) and warmth.polls("a", 10.001)


@pytest.mark.parametrize("ceiling", [0.0, -1.0])
def test_a_ceiling_must_be_positive(ceiling: float) -> None:
    with pytest.raises(ValueError, match="ceiling must be positive"):
        IdleBackoff(ceiling)


async def test_lag_monitor_sleeps_long_while_idle() -> None:
    """No request live: the monitor takes no sample within a span well under its idle sleep;
    once busy, it samples again (after the idle sleep it was in ends)."""
    stats = Stats()
    busy = False
    async with anyio.create_task_group() as tg:
        await tg.start(stats.monitor_loop_lag, lambda: busy)
        await anyio.sleep(LAG_IDLE_INTERVAL_S / 4)
        assert len(stats.lag_samples) == 0
        busy = True
        # about LAG_IDLE_INTERVAL_S: the idle sleep under way ends first
        await eventually(lambda: len(stats.lag_samples) >= 3, timeout=30, what="lag samples once busy")
        tg.cancel_scope.cancel()
