"""The seeded simulation of the whole control plane (issue #9): see ``world.py``.

``pytest tests/sim --seed N [--burst]`` replays one seed (and only it); a failing
seed's message prints that exact command.  Seeds that ever found a bug stay in
``REGRESSIONS`` (they replay the scheduler as it was when they were found: change
its random draws and they must be found again).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import time

import pytest

from kvservice._transfer.watchdog import Watchdog

from .world import SimFailure, World, run_seed

STEPS = 40
#: (seed, burst) -> what it found; each runs on every test run
REGRESSIONS: dict[tuple[int, bool], str] = {
    (66, False): "abort() of a not-yet-sent request (early expect) sent Abort but no Settled: the "
                 "receiver's pages stayed held until the prefill process exited",
    (79, False): "a receiver that shut down left requests held by an earlier-lost sender unsettled "
                 "for ever (await_settled never returned)",
    (180, False): "a receiver shutting down settled its requests when the sender's Bye arrived, while "
                  "its NIXL agent was still registered: the sender's fence WRITE landed after",
    (2764, False): "the sender's settle fence overtook its Failed (NIXL is faster than the control link): "
                   "the receiver ignored the fence of a request still live there and then held the pages "
                   "until the sender exited",
    (390, False): "a sender answered a receiver's Abort of a failed request that had posted WRITEs with "
                  "Settled(ok=False) before its fence landed: the receiver settled, a WRITE landed after",
    (3327, False): "a sender shutting down stopped listening, then drained with its NIXL agent alive: a "
                   "receiver took the refused dial for its exit and settled early (now: Reject while draining)",
    (1459, True): "at shutdown Watchdog.tick() ran while run()'s tick was in flight: one handle checked "
                  "after its release (now run() stops first)",
    (290, False): "a NIXL error on a settle fence's WRITE was dropped and no other fence followed: the "
                  "receiver held the pages until the sender exited (now up to FENCE_TRIES fences)",
    (39, False): "the same as 290, the error on the fence's check",
    (83, True): "the simulation's own: it forged a notification from a request's bound sender "
                "(impossible in NIXL) and the receiver took it as the last chunk",
    (0, False): "a tick queued behind one still posting checked the handles that one checked: one "
                "was checked after its release (now the queued tick leaves them to the one ahead)",
}
#: the sweep: CALM seeds one action per step, BURST seeds up to four (``--sim-seeds N``
#: or KVSERVICE_SIM_SEEDS=N for N in all, three quarters calm)
SWEEP = 2000
#: the sweep runs as this many tests, each a share of its seeds, so that a parallel run
#: (pytest -n) spreads them over its workers beside tests that mostly wait
SHARDS = 8
#: worker processes for each share (KVSERVICE_SIM_WORKERS): one per share in a parallel run,
#: two otherwise
WORKERS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


def _sweep_size(config: pytest.Config) -> int:
    n = config.getoption("--sim-seeds") or os.environ.get("KVSERVICE_SIM_SEEDS")
    return int(n) if n else SWEEP


def _run_range(seeds: list[tuple[int, bool]]) -> list[str]:
    """Run ``seeds``; the failures' messages (in a worker process)."""
    failures = []
    for seed, burst in seeds:
        try:
            run_seed(seed, STEPS, burst=burst)
        except SimFailure as exc:
            failures.append(str(exc))
    return failures


def test_replay(replay_seed: int | None, replay_burst: bool) -> None:
    """With ``--seed N``: that seed alone (the other tests skip)."""
    if replay_seed is None:
        pytest.skip("no --seed given")
    run_seed(replay_seed, STEPS, burst=replay_burst)


def test_the_sweep_queues_ticks_behind_ticks_that_post(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inline door answers a tick that posts only after its copies' (virtual) time, so
    the watchdog queues the next tick behind it (``Watchdog._queue_next``), and the sweep
    checks the door's order on that path too."""
    queued = 0
    queue_next = Watchdog._queue_next

    def counting(self: Watchdog) -> None:
        nonlocal queued
        before = self._queued
        queue_next(self)
        queued += before is None and self._queued is not None

    monkeypatch.setattr(Watchdog, "_queue_next", counting)
    for seed in range(10):
        run_seed(seed, STEPS)
    assert queued > 0


def test_regressions(replay_seed: int | None) -> None:
    if replay_seed is not None:
        pytest.skip("--seed replays one seed")
    for seed, burst in REGRESSIONS:
        run_seed(seed, STEPS, burst=burst)


@pytest.mark.slow
@pytest.mark.timeout(300)  # a share (250 seeds): 45 s on one busy core
@pytest.mark.parametrize("shard", range(SHARDS))
def test_sweep(shard: int, replay_seed: int | None, request: pytest.FixtureRequest) -> None:
    """Seeds ``shard``, ``shard + SHARDS``, ... of the sweep: its ``SHARDS`` tests run every seed once."""
    if replay_seed is not None:
        pytest.skip("--seed replays one seed")
    n = _sweep_size(request.config)
    calm = n - n // 4
    seeds = ([(s, False) for s in range(calm)] + [(s, True) for s in range(n - calm)])[shard::SHARDS]
    workers = int(os.environ.get("KVSERVICE_SIM_WORKERS", WORKERS))
    t0 = time.perf_counter()
    if workers <= 1:
        failures = _run_range(seeds)
    else:
        shares = [seeds[i::workers] for i in range(workers)]
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            failures = [f for got in pool.map(_run_range, shares) for f in got]
    elapsed = time.perf_counter() - t0
    print(f"simulation: {len(seeds)} of {n} seeds in {elapsed:.1f}s ({len(seeds) / elapsed:.0f} seeds/s, "
          f"{workers} workers)")
    assert not failures, f"{len(failures)} seeds failed; the first:\n{failures[0]}"


def test_same_seed_same_trace(replay_seed: int | None) -> None:
    if replay_seed is not None:
        pytest.skip("--seed replays one seed")
    for seed, burst in ((3, False), (17, False), (21, True)):
        first = run_seed(seed, STEPS, burst=burst).trace
        again = run_seed(seed, STEPS, burst=burst).trace
        assert first == again, f"seed {seed}: the trace differs between two runs"
        assert any(" write " in line for line in first), "the simulation moved no bytes"


def test_checker_catches_a_double_finish() -> None:
    """The invariant checker can fail: a fabricated second finish of a request is caught,
    and the message names the seed and the command that replays it."""

    def finish_twice(world: World) -> None:
        original = world.on_finish
        fabricated = []

        def double(proc, req):  # type: ignore[no-untyped-def]
            original(proc, req)
            if not fabricated:
                fabricated.append(req)
                original(proc, req)

        world.on_finish = double  # type: ignore[method-assign]

    with pytest.raises(SimFailure, match=r"(?s)seed 5: .*ended 2 times.*replay: pytest tests/sim --seed 5\n"):
        run_seed(5, STEPS, world_hook=finish_twice)


def test_checker_catches_a_late_write() -> None:
    """A WRITE that lands after its request settled on the receiver is caught."""

    def settle_early(world: World) -> None:
        original = world.on_write

        def write(src, dst, notif, remote_idx, **kw):  # type: ignore[no-untyped-def]
            from kvservice._control.protocol import peek_notif

            n = peek_notif(notif)
            if n is not None:
                world.settled_at.setdefault((dst, n.request_id), world.now - 1.0)
            original(src, dst, notif, remote_idx, **kw)

        world.on_write = write  # type: ignore[method-assign]

    with pytest.raises(SimFailure, match="after the request settled"):
        run_seed(5, STEPS, world_hook=settle_early)


def test_checker_catches_wrong_bytes() -> None:
    """A receiver SUCCESS whose pages do not hold the request's bytes is caught."""

    def corrupt(world: World) -> None:
        original = world.on_write

        def write(src, dst, notif, remote_idx, **kw):  # type: ignore[no-untyped-def]
            original(src, dst, notif, remote_idx, **kw)
            door = world.fabric.lookup(src)
            assert door is not None and door._pool is not None
            for data in door._pool.data:
                data[:] = 7  # the copy that follows carries garbage

        world.on_write = write  # type: ignore[method-assign]

    with pytest.raises(SimFailure, match="do not hold its bytes"):
        run_seed(5, STEPS, world_hook=corrupt)
