"""``tests.helpers``' slowdown: the factor short timeouts are scaled by follows the machine's
load, within bounds, and is measured once per run."""

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
    helpers.slowdown.cache_clear()
    try:
        assert helpers.scaled(1.0) == 2.5
    finally:
        helpers.slowdown.cache_clear()


@pytest.mark.parametrize(("load", "guard"), [
    (8.0, 400.0),  # a load that arrived after the run began: 4 runnable per core
    (0.5, 150.0),  # lighter than when the run began: the run's factor, never less
])
def test_a_tests_hang_guard_follows_the_load_as_it_starts(request: pytest.FixtureRequest,
                                                           monkeypatch: pytest.MonkeyPatch, load: float,
                                                           guard: float) -> None:
    """``tests/conftest.py``'s ``pytest_runtest_protocol`` scales the test's hang guard (the
    mark pytest-timeout reads as its own hook starts) by the higher of the run's factor and
    the load now; the run's factor itself stays."""
    from tests import conftest

    monkeypatch.setenv(helpers.SLOWDOWN_ENV, "1.50")
    helpers.slowdown.cache_clear()
    monkeypatch.setattr(helpers.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(helpers.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setitem(request.node.stash, conftest.GUARD_KEY, 100.0)
    try:
        hook = conftest.pytest_runtest_protocol(request.node, None)
        next(hook)
        mark = request.node.get_closest_marker("timeout")
        assert mark is not None and mark.args[0] == guard
        assert helpers.slowdown() == 1.5
        hook.close()
    finally:
        helpers.slowdown.cache_clear()
