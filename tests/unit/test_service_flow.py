"""The request state machine on the happy paths, with fake doors on both sides."""

from __future__ import annotations

import threading

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import torch

from kvservice import KVPoll, TransferService, TransferStatus, UnknownRequestError
from kvservice._control.protocol import ChunkNotif, decode_notif, encode_notif
from kvservice.testing import FakeFabric
from kvservice.testing.inspect import inside
from tests.helpers import SMALL, eventually, plane_indices

from .harness import GUARD_S, door_of, fill, notif_from, two_services, unit_config, untouched


async def test_poll_progression_on_both_sides() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            txd.hang()
            src, dst = [0, 1, 2, 3], [40, 41, 42, 43]
            data = fill(tx, "p", src)

            h = await tx.send("p", src[:2])
            assert h.poll() is KVPoll.Bootstrapping and h.result is None
            await rx.expect("p", dst, sender=tx.address)
            assert rx.poll_arrival("p") is KVPoll.WaitingForInput

            await eventually(lambda: h.poll() is KVPoll.Transferring and txd.live_xfers() == 1, GUARD_S)
            assert rx.poll_arrival("p") is KVPoll.WaitingForInput  # nothing landed yet
            assert txd.finish_hung() == 1
            await eventually(lambda: h.poll() is KVPoll.WaitingForInput, GUARD_S)
            await eventually(lambda: rx.poll_arrival("p") is KVPoll.Transferring, GUARD_S)

            txd.complete_immediately()
            h2 = await tx.send("p", src[2:], last=True)
            sent = await tx.await_completion(h2)
            arrived = await rx.await_arrival("p")

            assert h.poll() is h2.poll() is KVPoll.Success
            assert rx.poll_arrival("p") is KVPoll.Success
            assert sent.status is TransferStatus.SUCCESS and sent.error is None
            assert (sent.bytes, sent.pages) == (4 * SMALL.page_bytes, 4)
            assert arrived.ok and (arrived.bytes, arrived.pages) == (4 * SMALL.page_bytes, 4)
            assert sent.started_at is not None and sent.created_at <= sent.started_at <= sent.finished_at
            assert torch.equal(rx.kv.pages(dst), data)
            assert untouched(rx, dst)
            status = tx.status()
            assert status["outcomes"] == {"send.SUCCESS": 1}
            assert status["bytes_sent"] == 4 * SMALL.page_bytes
            assert rx.status()["outcomes"] == {"recv.SUCCESS": 1}
    fabric.assert_clean()


async def test_chunked_send_posts_paired_descriptors_per_chunk() -> None:
    fabric = FakeFabric()
    src = [5, 6, 7, 20, 21, 30, 31, 32]
    dst = [63, 1, 2, 3, 50, 51, 9, 8]
    chunks = [src[:1], src[1:4], src[4:6], src[6:]]
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            txd.complete_after(3)
            data = fill(tx, "c", src)
            handles = [await tx.send("c", chunks[0]), await tx.send("c", chunks[1])]  # before expect
            await rx.expect("c", dst, sender=tx.address)
            handles.append(await tx.send("c", chunks[2]))
            handles.append(await tx.send("c", chunks[3], last=True))
            results = [await tx.await_completion(h) for h in handles]
            arrived = await rx.await_arrival("c")
            assert all(r is results[0] and r.ok for r in results), results
            assert arrived.ok and arrived.pages == len(dst)
            assert torch.equal(rx.kv.pages(dst), data)
            assert untouched(rx, dst)

    posts = txd.posts
    assert len(posts) == 4
    offset = 0
    for i, (post, chunk) in enumerate(zip(posts, chunks, strict=True)):
        dest = np.array(dst[offset : offset + len(chunk)], dtype=np.int32)
        offset += len(chunk)
        assert post.local_idx.tolist() == plane_indices(SMALL, np.array(chunk, dtype=np.int32)).tolist()
        assert post.remote_idx.tolist() == plane_indices(SMALL, dest).tolist()
        assert decode_notif(post.notif, inside(rx).notif_keys_from(tx.agent_name)) == ChunkNotif(
            "c", i, 4 if i == 3 else 0)
        assert post.xid is not None and txd.check_counts[post.xid] == 3
    fabric.assert_clean()


async def test_whole_request_sent_before_expect_waits_in_bootstrapping() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            data = fill(tx, "early-send", [10, 11])
            h = await tx.send("early-send", [10, 11], last=True)
            rounds = txd.rounds
            await eventually(lambda: txd.rounds >= rounds + 3, GUARD_S)
            assert h.poll() is KVPoll.Bootstrapping and txd.post_count() == 0
            await rx.expect("early-send", [0, 33], sender=tx.address)
            assert (await tx.await_completion(h)).ok
            assert (await rx.await_arrival("early-send")).ok
            assert torch.equal(rx.kv.pages([0, 33]), data)
    fabric.assert_clean()


async def test_expect_before_send() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            data = fill(tx, "early-expect", [1, 2, 3])
            await rx.expect("early-expect", [4, 5, 6], sender=tx.address)
            await eventually(lambda: "early-expect" in inside(tx).early, GUARD_S)
            h = await tx.send("early-expect", [1, 2, 3], last=True)
            assert h.poll() is not KVPoll.Bootstrapping  # the destination was known at send()
            assert (await tx.await_completion(h)).ok
            assert (await rx.await_arrival("early-expect")).ok
            assert torch.equal(rx.kv.pages([4, 5, 6]), data)
    fabric.assert_clean()


async def test_many_requests_respect_max_posts_per_tick() -> None:
    fabric = FakeFabric()
    n = 6
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric, sender=unit_config(max_posts_per_tick=2)) as (tx, rx):
            txd = door_of(fabric, tx)
            payloads = {i: fill(tx, f"m{i}", [i]) for i in range(n)}
            for i in range(n):
                await rx.expect(f"m{i}", [63 - i], sender=tx.address)
            await eventually(lambda: len(inside(tx).early) == n, GUARD_S)
            # send() never yields, so all n requests are ready for the same watchdog tick
            handles = [await tx.send(f"m{i}", [i], last=True) for i in range(n)]
            for h in handles:
                assert (await tx.await_completion(h)).ok
            for i in range(n):
                assert (await rx.await_arrival(f"m{i}")).ok
                assert torch.equal(rx.kv.pages([63 - i]), payloads[i])
            assert txd.post_count() == n
            assert txd.max_posts_per_round() == 2
            assert tx.status()["outcomes"] == {"send.SUCCESS": n}
    fabric.assert_clean()


async def test_door_calls_all_run_on_one_thread_off_the_loop() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            fill(tx, "t", [1])
            await rx.expect("t", [2], sender=tx.address)
            assert (await tx.await_completion(await tx.send("t", [1], last=True))).ok
            assert (await rx.await_arrival("t")).ok
    for door in fabric.created:
        assert len(door.threads) == 1, door.threads
        assert threading.get_ident() not in door.threads
        assert door.closed
    assert door_of(fabric, tx).threads != door_of(fabric, rx).threads


async def test_stale_and_foreign_notifs_are_counted_and_ignored() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            rxd = door_of(fabric, rx)
            await rx.expect("s", [7], sender=tx.address)
            # not ours; ours for an unknown request; sealed by the sender's link but named
            # as another agent; named as the sender but sealed under another key (forged)
            rxd.inject_notif(tx.agent_name, b"someone else's notification")
            rxd.inject_notif(tx.agent_name, notif_from(tx, rx, ChunkNotif("nobody", 0, 1)))
            rxd.inject_notif("kvservice-intruder", notif_from(tx, rx, ChunkNotif("s", 0, 1)))
            rxd.inject_notif(tx.agent_name, encode_notif(ChunkNotif("s", 0, 1), b"k" * 32))
            await eventually(lambda: rx.status()["refused"].get("notif_forged") == 2, GUARD_S)
            await eventually(lambda: rx.status()["stale_notifs"] == 2, GUARD_S)
            assert rx.poll_arrival("s") is KVPoll.WaitingForInput
            fill(tx, "s", [7])
            assert (await tx.await_completion(await tx.send("s", [7], last=True))).ok
            assert (await rx.await_arrival("s")).ok
            assert rx.status()["stale_notifs"] == 2
    fabric.assert_clean()


async def test_service_without_a_peer_starts_and_stops_cleanly() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with TransferService(unit_config(), door_factory=fabric.factory) as svc:
            host, _, port = svc.address.rpartition(":")
            assert host == "127.0.0.1" and int(port) > 0
            assert svc.status()["sending"] == 0
    (door,) = fabric.created
    assert door.closed and door.post_count() == 0
    fabric.assert_clean()


async def test_a_second_connection_from_the_same_peer_keeps_its_transfers() -> None:
    """The receiver names the sender by another spelling of its address: a
    second link from the same agent must not reload it, which would release its
    in-flight handles behind the watchdog's back."""
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            txd.hang()
            data = fill(tx, "first", [1])
            await rx.expect("first", [11], sender=tx.address)
            h1 = await tx.send("first", [1], last=True)
            await eventually(lambda: h1.poll() is KVPoll.Transferring and txd.live_xfers() == 1, GUARD_S)
            port = tx.address.rpartition(":")[2]
            await rx.expect("second", [12], sender=f"127.1:{port}")  # 127.0.0.1, spelled short
            await eventually(lambda: "second" in inside(tx).early, GUARD_S)
            assert txd.peers_added == [rx.agent_name] and txd.peers_removed == []
            assert txd.finish_hung() == 1
            txd.complete_immediately()
            h2 = await tx.send("second", [2], last=True)
            assert (await tx.await_completion(h1)).ok
            assert (await tx.await_completion(h2)).ok
            assert (await rx.await_arrival("first")).ok and (await rx.await_arrival("second")).ok
            assert torch.equal(rx.kv.pages([11]), data)
    fabric.assert_clean()


async def test_the_ends_as_futures_equal_the_awaited_results_before_and_after_the_end() -> None:
    """``completion_future`` / ``arrival_future``: the no-timeout waits as futures of the running
    loop, for a caller that adds a done callback instead of parking a task per request.  Taken
    while the request runs, they resolve with the result the waits return; taken after its end,
    they are done already; an unknown request is refused as ``await_arrival`` refuses it."""
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            fill(tx, "f", [1, 2])
            await rx.expect("f", [30, 31], sender=tx.address)
            arrival = rx.arrival_future("f")
            handle = await tx.send("f", [1, 2], last=True)
            completion = tx.completion_future(handle)
            called: list[TransferStatus] = []
            arrival.add_done_callback(lambda f: called.append(f.result().status))
            sent, got = await completion, await arrival
            assert sent == await tx.await_completion(handle) and sent.ok
            assert got == await rx.await_arrival("f") and got.ok
            await anyio.lowlevel.checkpoint()  # the callbacks of a future that ended meanwhile
            assert called == [TransferStatus.SUCCESS]
            later = rx.arrival_future("f")  # ended: a kept result, done at once
            assert later.done() and later.result() == got
            assert tx.completion_future(handle).result() == sent
            with pytest.raises(UnknownRequestError):
                rx.arrival_future("nobody")
