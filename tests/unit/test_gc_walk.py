"""What the cyclic GC has to walk once requests have ended: nothing of theirs.

An ended request is freed by refcounting as soon as its caller lets go of its handle
(no reference cycle through it, nothing in the service holding it), and the results
a service keeps (``results_kept``) are tuples the collector stops tracking.  Every
full collection walks what is left, thousands of requests at a time (``python -m
benchmarks.gc_probe``)."""

from __future__ import annotations

import asyncio
import gc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import anyio

from kvservice import FailureReason, TransferResult, TransferStatus
from kvservice._transfer.history import Results
from kvservice.testing import FakeFabric
from kvservice.testing.inspect import inside

from .harness import GUARD_S, two_services

#: fewer than the deadline heap's compaction floor (``Deadlines.FLOOR``): nothing but
#: the end of each request itself may let go of it
N = 100
#: what may remain of the last request: the event loop's last callback, a frame's variable
LAST = 2
#: what of a request the test counts
TRACKED = ("SendRequest", "RecvRequest", "TransferHandle", "_Waiter")


@contextmanager
def collector_off() -> Iterator[None]:
    """No automatic collection meanwhile, and what a collection finds unreachable is kept
    in ``gc.garbage`` for the test to see."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def kinds(objects: list[object], before: set[int]) -> Counter[str]:
    return Counter(type(o).__qualname__ for o in objects if id(o) not in before)


async def test_ended_requests_are_freed_by_refcounting_and_leave_no_cycles() -> None:
    async with two_services(FakeFabric()) as (tx, rx):
        with anyio.fail_after(GUARD_S):
            for i in range(4):  # the link, the peers' first exchanges: not what is counted
                await rx.expect(f"w{i}", [i], sender=tx.address)
                assert (await tx.await_completion(await tx.send(f"w{i}", [i], last=True))).ok
                assert (await rx.await_arrival(f"w{i}")).ok
            with collector_off():
                before = {id(o) for o in gc.get_objects()}
                for i in range(N):
                    await rx.expect(f"r{i}", [i % 8], sender=tx.address)
                handles = [await tx.send(f"r{i}", [i % 8], last=True) for i in range(N)]
                sent = await asyncio.gather(*(tx.await_completion(h) for h in handles))
                arrived = [await rx.await_arrival(f"r{i}") for i in range(N)]
                assert all(r.ok for r in sent) and all(r.ok for r in arrived)
                del handles, sent, arrived
                # a few watchdog ticks (deadlines scanned, nothing pending): on a loaded machine
                # more than the 50 ms they take idle, so until the ended requests are gone, or
                # the guard's deadline, after which the assertions below say what was left
                left = kinds(gc.get_objects(), before)
                for _ in range(int(GUARD_S / 2 / 0.05)):
                    await anyio.sleep(0.05)
                    left = kinds(gc.get_objects(), before)
                    if all(left[kind] <= LAST for kind in TRACKED):
                        break
                unreachable = gc.collect()
                garbage = kinds(gc.garbage, set())
    # with the collector off, only refcounting freed them: no request, handle or waiter is
    # left (but the last one, which the event loop or a task's frame may hold for a turn),
    # and none of them was in a cycle only a collection would have broken
    for kind in TRACKED:
        assert left[kind] <= LAST, (kind, left)
    assert unreachable == 0 and not garbage, garbage


async def test_kept_results_are_nothing_the_collector_walks() -> None:
    async with two_services(FakeFabric()) as (tx, rx):
        with anyio.fail_after(GUARD_S):
            gc.collect()
            before = {id(o) for o in gc.get_objects()}
            for i in range(N):
                await rx.expect(f"r{i}", [i % 8], sender=tx.address)
                assert (await tx.await_completion(await tx.send(f"r{i}", [i % 8], last=True))).ok
                assert (await rx.await_arrival(f"r{i}")).ok
            gc.collect()
            for svc in (tx, rx):
                plane = inside(svc).plane
                for done in (plane.sends_done, plane.recvs_done):
                    assert not any(gc.is_tracked(p) for p in done._kept.values())
            # (the last request's result may still be in the event loop's hands for a turn)
            assert kinds(gc.get_objects(), before)["TransferResult"] <= LAST, "results kept as objects"
            # and looked up after the end, a result is what it was
            again = await rx.await_arrival("r7")
            assert again.ok and again.request_id == "r7" and again.pages == 1 and again.settled


def test_a_kept_result_reads_back_equal_with_every_field() -> None:
    error = RuntimeError("nixl said no")
    failed = TransferResult(request_id="f", status=TransferStatus.FAILED, reason=FailureReason.PEER_LOST,
                            error=error, message="gone", peer="10.0.0.1:7000", bytes=0, pages=3,
                            created_at=1.0, started_at=None, finished_at=3.0, settled=False)
    ok = TransferResult(request_id="s", status=TransferStatus.SUCCESS, peer="10.0.0.2:7000", bytes=4096,
                        pages=2, created_at=1.0, started_at=1.5, finished_at=2.0, settled=True, payload=b"tok")
    kept = Results(capacity=2)
    kept.put("f", failed)
    kept.put("s", ok)
    assert kept.get("s") == ok and kept.get("s") is not ok  # a success: an equal copy
    assert kept.get("f") is failed  # a failure: the same object, its error with it
    kept.put("f", failed)  # a put moves its id to the newest end
    kept.put("n", ok)
    assert "s" not in kept and "f" in kept and "n" in kept and len(kept) == 2
    assert kept.get("missing") is None
