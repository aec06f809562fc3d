"""The door thread -> loop hand-over of a lingering tick's notifications (``_transfer.delivery``)."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import anyio

from kvservice._transfer.delivery import Delivery
from tests.helpers import eventually

from .harness import GUARD_S


async def test_batches_put_from_another_thread_reach_the_owner_in_order_once_each() -> None:
    taken: list[Mapping[str, list[bytes]]] = []
    delivery = Delivery(taken.append)
    assert not delivery.running  # no loop to hand to yet: the watchdog plans no deliver then
    batches = [{"peer": [str(i).encode()]} for i in range(200)]
    with anyio.fail_after(GUARD_S):
        async with anyio.create_task_group() as tg:
            await tg.start(delivery.run)
            assert delivery.running

            def door_thread() -> None:
                for batch in batches:
                    delivery.put(batch)

            thread = threading.Thread(target=door_thread)
            thread.start()
            await eventually(lambda: len(taken) == len(batches), GUARD_S, what="every batch taken")
            thread.join()
            tg.cancel_scope.cancel()
    assert taken == batches and delivery.count == len(batches)


async def test_a_digest_takes_what_the_pump_has_not_yet_and_nothing_twice() -> None:
    taken: list[Mapping[str, list[bytes]]] = []
    delivery = Delivery(taken.append)
    with anyio.fail_after(GUARD_S):
        async with anyio.create_task_group() as tg:
            await tg.start(delivery.run)
            delivery.put({"p": [b"1"]})
            delivery.put({"p": [b"2"]})
            delivery.take()  # as a tick's digest does, before the pump's turn
            assert taken == [{"p": [b"1"]}, {"p": [b"2"]}]
            await anyio.sleep(0.01)  # the pump's wake-ups find nothing left
            assert len(taken) == 2 and delivery.count == 2
            tg.cancel_scope.cancel()


def test_a_put_after_the_loop_closed_is_dropped_quietly() -> None:
    delivery = Delivery(lambda notifs: None)

    async def start_and_leave() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(delivery.run)
            tg.cancel_scope.cancel()

    anyio.run(start_and_leave)  # its loop is closed now
    delivery.put({"p": [b"late"]})  # a door thread's last batch: no exception escapes
