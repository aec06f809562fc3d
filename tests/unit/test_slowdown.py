"""``tests.helpers``' slowdown: the factor short timeouts are scaled by follows the machine's
load, within bounds: measured as a run starts, raised before a test where the machine got
busier since, never lowered."""

from __future__ import annotations

import pytest

from tests import helpers


@pytest.mark.parametrize(("load", "workers", "cpus", "factor"), [
    (0.0, 1, 2, 1.0),  # an idle machine: as written
    (0.0, 4, 2, 2.0),  # four workers on two cores: twice as long
    (12.0, 4, 2, 8.0),  # a bench and other runs beside it
    (60.0, 4, 2, 10.0),  # at most ten times
])
def test_the_factor_is_runnable_processes_per_cpu(monkeypatch: pytest.MonkeyPatch, load: float, workers: int,
                                                  cpus: int, factor: float) -> None:
    monkeypatch.setattr(helpers.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(helpers.os, "cpu_count", lambda: cpus)
    assert helpers.measure_slowdown(workers) == factor


def test_the_runs_factor_is_the_one_set_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(helpers.SLOWDOWN_ENV, "2.5")
    monkeypatch.setattr(helpers.os, "getloadavg", lambda: (99.0, 99.0, 99.0))  # not measured again
    assert helpers.scaled(1.0) == 2.5


def test_a_load_that_arrives_later_raises_the_factor_and_a_lighter_one_never_lowers_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(helpers.SLOWDOWN_ENV, "2.00")
    monkeypatch.setattr(helpers.os, "cpu_count", lambda: 2)
    load = [3.0]
    monkeypatch.setattr(helpers.os, "getloadavg", lambda: (load[0],) * 3)
    assert helpers.raise_slowdown() == 2.0  # 3 runnable on 2 cores: lighter than measured
    load[0] = 12.0  # another run started beside this one
    assert helpers.raise_slowdown() == 6.0 and helpers.scaled(1.0) == 6.0
    load[0] = 0.5  # and ended
    assert helpers.raise_slowdown() == 6.0


def test_a_test_started_after_the_load_rose_gets_a_longer_hang_guard(request: pytest.FixtureRequest,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``tests/conftest.py``'s ``pytest_runtest_protocol`` rescales the test's hang guard (the
    mark pytest-timeout reads as its own hook starts) by the factor raised just before."""
    from tests import conftest

    monkeypatch.setenv(helpers.SLOWDOWN_ENV, "1.00")
    monkeypatch.setattr(helpers.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(helpers.os, "getloadavg", lambda: (8.0, 8.0, 8.0))
    item = request.node
    monkeypatch.setitem(item.stash, conftest.GUARD_KEY, 100.0)
    hook = conftest.pytest_runtest_protocol(item, None)
    next(hook)
    mark = item.get_closest_marker("timeout")
    assert mark is not None and mark.args[0] == 400.0
    hook.close()
