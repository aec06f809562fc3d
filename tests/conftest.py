"""Test-wide configuration.

The two-process integration tests run the in-process service on both event
loops kvservice supports, asyncio's default loop and uvloop (child processes
use uvloop when installed, through ``kvservice._runtime.run``).

Every NIXL agent the tests make, in this process or a child, starts with this host's
UCX defaults (``kvservice._config.host_ucx_defaults``): a service applies them to
its own agent, but raw agents (the forger, the door tests, the bench's raw baseline)
would otherwise load UCX's RDMA modules on a host with libibverbs and no device,
and the process that made one (pytest itself, too) would crash as it exits."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Generator, Mapping

import pytest
import uvloop

from kvservice._config import host_ucx_defaults
from kvservice.testing.peer_process import use_fork_server
from tests.helpers import SLOWDOWN_ENV, measure_slowdown, scaled, shm_names, slowdown, sweep_shm

for _name, _value in host_ucx_defaults().items():
    os.environ.setdefault(_name, _value)

#: a test's hang guard before scaling (its ``timeout`` mark, else the run's default)
GUARD_KEY = pytest.StashKey[float]()
#: the names under /dev/shm as the run began, and those its end swept (``pytest_sessionfinish``)
SHM_KEY = pytest.StashKey[set[str]]()
SWEPT_KEY = pytest.StashKey[list[str]]()

BOTH_LOOPS = {"tests/system/test_two_process.py", "tests/faults/test_bad_input.py"}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.nodeid.split("::")[0] in BOTH_LOOPS:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


def pytest_configure(config: pytest.Config) -> None:
    """Peers are forked from a server that imported them once (``use_fork_server``: a
    start costs a fork, not ~2-3 s of CPU importing torch and kvservice; each process of
    the run, each xdist worker, has its own server).  Measure this run's slowdown once,
    before any xdist worker starts (they inherit it), counting the run's own workers:
    ``tests.helpers.scaled``."""
    if os.environ.get("KVSERVICE_TEST_FORK", "1") != "0":
        use_fork_server()
    if os.environ.get("PYTEST_XDIST_WORKER") is None and not os.environ.get(SLOWDOWN_ENV):
        workers = config.getoption("numprocesses", default=None) or 1  # None without xdist, 0 for -n 0
        if not isinstance(workers, int):  # -n auto or logical, where xdist has not resolved it yet
            workers = os.cpu_count() or 1
        os.environ[SLOWDOWN_ENV] = f"{measure_slowdown(workers):.2f}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test's hang guard (pytest-timeout: its own ``timeout`` mark, else the run's
    default) is scaled by the run's slowdown, as the short timeouts are: a loaded machine
    makes a test slower, not hung.  In a parallel run, the tests marked ``slow`` are handed
    out first (each worker collects the same order), so that none of them starts last and
    runs alone while the others idle."""
    default = float(config.getini("timeout") or 0)
    for item in items:
        mark = item.get_closest_marker("timeout")
        guard = float(mark.args[0]) if mark is not None and mark.args else default
        item.stash[GUARD_KEY] = guard
        if guard > 0:
            item.add_marker(pytest.mark.timeout(scaled(guard)), append=False)
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """Before each test, outside pytest-timeout's own hook (which starts the hang guard): scale
    the test's hang guard by the higher of the run's slowdown and the machine's load now, so
    that a load that arrives after the run measured its slowdown (another run, a bench
    started beside it) makes a test slower, not hung.  Only the guard follows the load: the
    run's short timeouts keep the one factor every module and child read as the run began."""
    guard = item.stash.get(GUARD_KEY, 0.0)
    if guard > 0:
        factor = max(slowdown(), measure_slowdown(workers=0))  # the run's workers are in the load by now
        item.add_marker(pytest.mark.timeout(guard * factor), append=False)
    return (yield)


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        session.config.stash[SHM_KEY] = shm_names()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Once every test and fixture has ended (in a parallel run, every worker): unlink what
    the engines this run started and stopped left under /dev/shm (``tests.helpers.sweep_shm``:
    what no live process holds), so that runs after runs do not fill it."""
    before = session.config.stash.get(SHM_KEY, None)
    if before is not None:
        session.config.stash[SWEPT_KEY] = sweep_shm(before)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    swept = config.stash.get(SWEPT_KEY, [])
    if swept:
        terminalreporter.write_line(f"/dev/shm: unlinked {len(swept)} file(s) the engines this run stopped "
                                    f"left behind ({', '.join(swept[:4])}{', ...' if len(swept) > 4 else ''})")


def pytest_report_header(config: pytest.Config) -> str:
    return f"slowdown: {slowdown():.2f} (short timeouts scaled by it: tests.helpers.scaled)"
