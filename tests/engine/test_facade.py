"""The poll-style facade over two services on fake NIXL doors (real loopback TCP control
plane, each engine on its own loop thread): the state mapping, failures as results,
bounds, shutdown.  The real-NIXL proof is ``test_sync_scheduler.py``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvservice import FailureReason, KVPoll, ServiceConfig, TransferFailed, TransferService
from kvservice.engine import KVReceiver, KVSender, KVTransferEngine
from kvservice.testing import FakeFabric, pattern
from kvservice.testing.inspect import EngineInside, inside_engine
from tests.helpers import SMALL, eventually_sync
from tests.unit.harness import GUARD_S, unit_config


class FakeNixlError(Exception):
    """Stands in for one of NIXL's exception classes."""


@contextlib.contextmanager
def engines(fabric: FakeFabric, tx: ServiceConfig | None = None,
            rx: ServiceConfig | None = None) -> Iterator[tuple[KVTransferEngine, KVTransferEngine]]:
    def factory(cfg: ServiceConfig) -> TransferService:
        return TransferService(cfg, door_factory=fabric.factory)

    with (KVTransferEngine(tx or unit_config(), service_factory=factory) as prefill,
          KVTransferEngine(rx or unit_config(), service_factory=factory) as decode):
        yield prefill, decode


# Poll like a scheduler: a bounded number of bounded steps.
until = functools.partial(eventually_sync, timeout=GUARD_S, interval=0.002)


def ended(*transfers: KVSender | KVReceiver) -> Callable[[], bool]:
    return lambda: all(t.poll() in (KVPoll.Success, KVPoll.Failed) for t in transfers)


def polls(transfer: KVSender | KVReceiver, seen: list[KVPoll]) -> Callable[[], bool]:
    def step() -> bool:
        state = transfer.poll()
        seen.append(state)
        return state in (KVPoll.Success, KVPoll.Failed)
    return step


def test_chunks_arrive_byte_exact_and_states_only_move_forward() -> None:
    fabric = FakeFabric()
    with engines(fabric) as (prefill, decode):
        src, dst = [3, 4, 5, 6, 7], [50, 40, 41, 42, 9]
        data = pattern(SMALL, "r1", len(src))
        prefill.kv.write(src, data)
        sender = prefill.sender("r1")
        assert sender.poll() is KVPoll.Bootstrapping
        sender.init(len(src))
        sender.send(src[:2])  # before the receiver's expect: waits in Bootstrapping
        receiver = decode.receiver("r1", sender=prefill.address)
        assert receiver.poll() is KVPoll.Bootstrapping
        receiver.init(dst)
        sender.send(src[2:4])
        sender.send(src[4:])  # reaches init()'s num_pages: the last chunk
        with pytest.raises(RuntimeError, match="after the last chunk"):
            sender.send([1])
        tx_seen: list[KVPoll] = []
        rx_seen: list[KVPoll] = []
        until(lambda: polls(sender, tx_seen)() & polls(receiver, rx_seen)())
        for seen in (tx_seen, rx_seen):
            assert seen == [*sorted(seen[:-1]), seen[-1]], seen  # never back
            assert seen[-1] is KVPoll.Success
        assert sender.result is not None and sender.result.ok and sender.settled
        assert receiver.result is not None and receiver.result.ok and receiver.settled
        assert receiver.result.bytes == len(dst) * SMALL.page_bytes
        assert torch.equal(decode.kv.pages(dst), data)
        rest = [p for p in range(SMALL.num_pages) if p not in dst]
        assert bool((decode.kv.pages(rest) == 0).all())
        with pytest.raises(RuntimeError, match="has not failed"):
            sender.failure_exception()
        sender.clear()
        receiver.clear()
        assert prefill.live() == [] and decode.live() == []
        assert prefill.status()["live_nixl_handles"] == 0
    fabric.assert_clean()


def test_an_error_of_the_service_is_a_failed_poll_never_an_exception() -> None:
    fabric = FakeFabric()
    with engines(fabric) as (prefill, decode):
        # pages out of range: the service's ValueError, kept as the error
        bad = decode.receiver("bad", sender=prefill.address)
        bad.init([SMALL.num_pages + 5])
        until(ended(bad))
        assert bad.poll() is KVPoll.Failed
        assert bad.result is not None and bad.result.reason is FailureReason.REFUSED and bad.settled
        with pytest.raises(TransferFailed, match=rf"request 'bad' failed REFUSED \(peer {prefill.address}\): "
                           r".*out of range") as refused:
            bad.failure_exception()
        assert isinstance(refused.value.__cause__, ValueError) and refused.value.__cause__ is bad.result.error
        # a malformed sender address
        lost = decode.receiver("lost", sender="no-port")
        lost.init([1])
        until(ended(lost))
        assert lost.result is not None and lost.result.reason is FailureReason.REFUSED
        # a later chunk with more pages than the receiver expects: refused, and the
        # service's request (already bound) is aborted, so the receiver ends too
        receiver = decode.receiver("more", sender=prefill.address)
        receiver.init([10, 11])
        until(lambda: receiver.poll() is KVPoll.WaitingForInput)
        sender = prefill.sender("more")
        sender.send([1], last=False)
        until(lambda: sender.poll() in (KVPoll.WaitingForInput, KVPoll.Transferring))
        sender.send([2, 3], last=True)
        until(ended(sender, receiver))
        assert sender.result is not None and sender.result.reason is FailureReason.REFUSED
        with pytest.raises(TransferFailed, match=r"failed REFUSED .*receiver expects 2") as more:
            sender.failure_exception()
        assert isinstance(more.value.__cause__, ValueError)
        assert receiver.result is not None and receiver.result.reason is FailureReason.ABORTED
        until(lambda: sender.settled and receiver.settled)
        assert prefill.status()["live_nixl_handles"] == 0


def test_failure_exception_names_why_with_nixls_own_error_as_its_cause() -> None:
    fabric = FakeFabric()
    with engines(fabric) as (prefill, decode):
        original = FakeNixlError("endpoint gone")
        receiver = decode.receiver("rd", sender=prefill.address)
        receiver.init([5])
        until(lambda: receiver.poll() is KVPoll.WaitingForInput)
        fabric.door(prefill.agent_name).fail_next_post(FailureReason.REMOTE_DISCONNECT, original)
        sender = prefill.sender("rd")
        sender.send([1], last=True)
        until(ended(sender, receiver))
        assert sender.result is not None and sender.result.reason is FailureReason.REMOTE_DISCONNECT
        # the receiver it was not pinned to, named by its address
        with pytest.raises(TransferFailed, match=f"failed REMOTE_DISCONNECT \\(peer {decode.address}\\): "
                           ".*endpoint gone") as info:
            sender.failure_exception()
        assert info.value.__cause__ is original and info.value.reason is FailureReason.REMOTE_DISCONNECT
        # NIXL keeps a disconnected agent loaded: the sender tells the receiver why before it
        # drops the link, so the receiver fails the same way, in the sender's words
        assert receiver.result is not None and receiver.result.reason is FailureReason.REMOTE_DISCONNECT
        with pytest.raises(TransferFailed, match=f"failed REMOTE_DISCONNECT \\(peer {prefill.address}\\): "
                           "sender reported: .*endpoint gone") as info2:
            receiver.failure_exception()
        assert info2.value.peer == prefill.address
    fabric.assert_clean()


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_abort_ends_both_sides_and_the_receiver_settles(side: str) -> None:
    fabric = FakeFabric()
    with engines(fabric) as (prefill, decode):
        txd = fabric.door(prefill.agent_name)
        txd.hang()  # the WRITE stays in flight
        receiver = decode.receiver("ab", sender=prefill.address)
        receiver.init([7])
        sender = prefill.sender("ab")
        sender.send([1], last=True)
        until(lambda: sender.poll() is KVPoll.Transferring and len(txd.live_ids()) == 1)
        (xid,) = txd.live_ids()
        (sender if side == "sender" else receiver).abort()
        here = sender if side == "sender" else receiver
        assert here.poll() is KVPoll.Failed  # at once, without a trip to the loop
        assert here.result is not None and here.result.reason is FailureReason.ABORTED
        until(ended(sender, receiver))
        for t in (sender, receiver):
            assert t.result is not None and t.result.reason is FailureReason.ABORTED, t.result
        # the WRITE's handle is let go, not released (a release would not stop it)
        until(lambda: sender.settled)
        assert txd.release_counts[xid] == 0 and xid in txd.live_ids()
        assert not receiver.settled  # its WRITE may still land: the receiver is told once it ended
        txd.complete_immediately()
        # the WRITE ends DONE: the receiver is told it may settle, its pages are free
        until(lambda: txd.finish_hung() >= 0 and receiver.settled)
        until(lambda: txd.release_counts[xid] == 1)
        here.abort()  # ended: a no-op
        assert here.result is not None and here.result.reason is FailureReason.ABORTED
    fabric.assert_clean()


def test_abort_and_clear_before_anything_was_sent() -> None:
    fabric = FakeFabric()
    with engines(fabric) as (prefill, decode):
        receiver = decode.receiver("early", sender=prefill.address)
        receiver.init([3])
        until(lambda: prefill.status()["expects_before_send"] == 1)  # the Expect is there
        sender = prefill.sender("early")
        sender.abort()  # the receiver's expect waits at the sender: it is told at once
        until(ended(receiver), timeout=2.0)
        assert receiver.result is not None and receiver.result.reason is FailureReason.ABORTED
        until(lambda: sender.settled and receiver.settled)
        never = decode.receiver("never", sender=prefill.address)
        never.clear()  # not init-ed: aborted, nothing sent
        assert never.poll() is KVPoll.Failed and never.settled
        with pytest.raises(RuntimeError, match="after clear"):
            never.init([1])
        assert [t.request_id for t in decode.live()] == ["early"]


def test_a_receiver_whose_sender_never_sends_ends_by_the_arrival_deadline() -> None:
    fabric = FakeFabric()
    with engines(fabric, rx=unit_config(arrival_timeout_s=0.3)) as (prefill, decode):
        receiver = decode.receiver("late", sender=prefill.address)
        receiver.init([1])
        t0 = time.monotonic()
        until(ended(receiver), timeout=5.0)  # polled by a scheduler that never gives up
        assert receiver.result is not None and receiver.result.reason is FailureReason.TIMEOUT
        assert time.monotonic() - t0 < 3.0
        unreachable = decode.receiver("gone", sender="127.0.0.1:9")  # nobody listens
        unreachable.init([2])
        until(ended(unreachable), timeout=5.0)
        assert unreachable.result is not None and unreachable.result.reason is FailureReason.PEER_LOST


def test_a_sender_without_a_receiver_ends_by_the_bootstrap_deadline() -> None:
    fabric = FakeFabric()
    with engines(fabric, tx=unit_config(bootstrap_timeout_s=0.3)) as (prefill, _):
        sender = prefill.sender("alone")
        sender.send([1], last=True)
        until(ended(sender), timeout=5.0)
        assert sender.result is not None and sender.result.reason is FailureReason.TIMEOUT


def test_poll_never_waits_for_the_loop() -> None:
    fabric = FakeFabric()
    with engines(fabric) as (prefill, _):
        sender = prefill.sender("busy")
        sender.send([1], last=False)
        until(lambda: sender.poll() is KVPoll.Bootstrapping and EngineInside.sent(sender))
        loop = inside_engine(prefill).loop
        blocked, release = threading.Event(), threading.Event()

        def block() -> None:  # the loop thread is stuck (a long synchronous call)
            blocked.set()
            release.wait(GUARD_S)

        loop.call_soon_threadsafe(block)
        assert blocked.wait(GUARD_S)
        try:
            t0 = time.perf_counter()
            for _ in range(100):
                sender.poll()
            sender.send([2], last=True)  # queues, does not wait either
            sender.abort()
            elapsed = time.perf_counter() - t0
        finally:
            release.set()
        assert elapsed < 0.2, elapsed
        assert sender.poll() is KVPoll.Failed
        until(lambda: sender.settled)


def test_close_ends_every_request_and_later_calls_fail_shutdown() -> None:
    fabric = FakeFabric()
    with engines(fabric) as (prefill, decode):
        txd = fabric.door(prefill.agent_name)
        txd.hang()
        receiver = decode.receiver("c1", sender=prefill.address)
        receiver.init([1])
        sender = prefill.sender("c1")
        sender.send([1], last=True)
        idle = decode.receiver("c2", sender=prefill.address)  # never init-ed
        until(lambda: sender.poll() is KVPoll.Transferring)
        t0 = time.monotonic()
        decode.close()
        assert time.monotonic() - t0 < GUARD_S
        for t in (receiver, idle):
            assert t.poll() is KVPoll.Failed and t.settled
            assert t.result is not None and t.result.reason is FailureReason.SHUTDOWN, t.result
        assert decode.pending() == []
        idle.init([2])  # after close: no exception, it has ended
        late = decode.receiver("c3", sender=prefill.address)
        assert late.poll() is KVPoll.Failed
        assert late.result is not None and late.result.reason is FailureReason.SHUTDOWN
        txd.finish_hung()
        until(ended(sender))
        assert sender.result is not None and not sender.result.ok
    assert prefill.pending() == []
    fabric.assert_clean()


def test_misuse_raises_at_the_call() -> None:
    fabric = FakeFabric()
    with engines(fabric) as (prefill, _):
        sender = prefill.sender("m")
        with pytest.raises(ValueError, match="already has a live KVSender"):
            prefill.sender("m")
        sender.init(2)
        with pytest.raises(RuntimeError, match="twice"):
            sender.init(2)
        with pytest.raises(ValueError, match="3 pages sent"):
            sender.send([1, 2, 3])
        sender.clear()
        again = prefill.sender("m")  # cleared: the id may be used again
        again.clear()
    with pytest.raises(RuntimeError, match="not started"):
        KVTransferEngine(unit_config()).sender("x")


def test_forwarded_keywords_are_the_services_own() -> None:
    """The facade forwards keyword arguments by name: each must exist on the service's
    call, so a renamed or removed one fails here, not in a scheduler."""
    params: dict[str, Any] = {
        "send": inspect.signature(TransferService.send).parameters,
        "expect": inspect.signature(TransferService.expect).parameters,
    }
    facade_send = set(inspect.signature(KVSender.send).parameters) - {"self", "pages"}
    facade_init = set(inspect.signature(KVReceiver.init).parameters) - {"self", "pages"}
    assert facade_send <= set(params["send"]), facade_send - set(params["send"])
    assert facade_init <= set(params["expect"])
    assert "receiver" in params["send"] and "sender" in params["expect"]


def test_the_engine_loop_is_its_own_thread() -> None:
    fabric = FakeFabric()
    with engines(fabric) as (prefill, _):
        loop = inside_engine(prefill).loop
        assert loop.is_running()
        async def ident() -> int:
            return threading.get_ident()

        fut = asyncio.run_coroutine_threadsafe(ident(), loop)
        assert fut.result(GUARD_S) != threading.get_ident()
    assert not loop.is_running()


def test_a_service_that_cannot_start_raises_from_start() -> None:
    def no_door(name: str, c: ServiceConfig) -> Any:
        raise RuntimeError("no NIXL here")

    def broken(cfg: ServiceConfig) -> TransferService:
        return TransferService(cfg, door_factory=no_door)

    engine = KVTransferEngine(unit_config(), service_factory=broken)
    with pytest.raises(RuntimeError, match="no NIXL here"):
        engine.start()
    assert not engine.running
    thread = inside_engine(engine).thread
    assert thread is not None and not thread.is_alive()


def test_an_error_inside_a_watcher_ends_that_request_only() -> None:
    fabric = FakeFabric()
    with engines(fabric) as (prefill, decode):
        svc = inside_engine(prefill).service
        original = svc.completion_future

        def broken(handle: Any) -> Any:
            if handle.request_id == "boom":
                raise TypeError("a bug in the service")
            return original(handle)

        svc.completion_future = broken  # type: ignore[method-assign]
        receiver = decode.receiver("ok", sender=prefill.address)
        receiver.init([1])
        boom, ok = prefill.sender("boom"), prefill.sender("ok")
        boom.send([2], last=True)
        ok.send([3], last=True)
        until(ended(boom, ok, receiver))
        assert boom.result is not None and boom.result.reason is FailureReason.REFUSED
        with pytest.raises(TransferFailed, match=r"failed REFUSED .*TypeError: a bug") as bug:
            boom.failure_exception()
        assert isinstance(bug.value.__cause__, TypeError)
        assert ok.poll() is KVPoll.Success and receiver.poll() is KVPoll.Success
        assert prefill.running


def test_a_waiting_transfer_holds_a_done_callback_not_a_task() -> None:
    """A scheduler keeps thousands of transfers waiting, and the cyclic GC walks every
    object each one holds at every full collection: a transfer's end reaches it by a done
    callback on the service's future for it, not by a task of its own (seven objects)."""
    n = 48
    fabric = FakeFabric()
    with engines(fabric) as (prefill, decode):
        warm = decode.receiver("warm", sender=prefill.address)
        warm.init([0])
        sent = prefill.sender("warm")
        sent.send([0], last=True)
        until(ended(warm, sent))

        def tasks() -> int:
            # tasks still waiting (an ended op runner may wait for a collection to be freed)
            return sum(1 for o in gc.get_objects() if issubclass(type(o), asyncio.Task) and not o.done())

        idle = tasks()
        receivers = [decode.receiver(f"r{i}", sender=prefill.address) for i in range(n)]
        senders = [prefill.sender(f"s{i}") for i in range(n)]
        for i, (receiver, sender) in enumerate(zip(receivers, senders, strict=True)):
            receiver.init([i])  # no sender will come: waits for its arrival
            sender.send([i], last=True)  # no receiver will come: waits for its expect
        # every one handed to its service and watched (its op runner gone)
        until(lambda: all(EngineInside.handed_over(t) for t in (*receivers, *senders)))
        waiting = tasks() - idle
        assert waiting < n // 4, f"{waiting} more tasks with {2 * n} transfers waiting"
        assert all(t.poll() is not KVPoll.Failed for t in (*receivers, *senders))
        for t in (*receivers, *senders):
            t.abort()
        until(lambda: all(t.settled for t in (*receivers, *senders)))
        assert all(t.result is not None and t.result.reason is FailureReason.ABORTED
                   for t in (*receivers, *senders))
        assert prefill.running and decode.running


def test_layer_wise_chunks_and_a_payload_reach_the_receivers_result() -> None:
    """The service's layers= and payload= pass through the facade; the payload is on the
    receiver's result exactly when it polls Success."""
    fabric = FakeFabric()
    with engines(fabric) as (prefill, decode):
        src, dst = [1, 2], [20, 21]
        prefill.kv.write(src, pattern(SMALL, "lw", len(src)))
        receiver = decode.receiver("lw", sender=prefill.address)
        receiver.init(dst)
        sender = prefill.sender("lw")
        sender.init(len(src))  # layer-wise chunks do not count towards it: last is explicit
        for layer in range(SMALL.layers):
            final = layer == SMALL.layers - 1
            sender.send(src, layers=range(layer, layer + 1), last=final, payload=b"token=7" if final else None)
        until(ended(sender, receiver))
        assert sender.poll() is KVPoll.Success and receiver.poll() is KVPoll.Success
        assert receiver.result is not None and receiver.result.payload == b"token=7"
        assert torch.equal(decode.kv.pages(dst), pattern(SMALL, "lw", len(dst)))
