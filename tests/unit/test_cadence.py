"""The idle back-off of the watchdog (``_transfer.cadence``) and the lag monitor's idle sleep."""

from __future__ import annotations

import itertools

import anyio
import pytest

from kvservice._stats import LAG_IDLE_INTERVAL_S, Stats
from kvservice._transfer.cadence import IDLE_FIRST_S, IdleBackoff
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
