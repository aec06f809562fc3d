"""``send(fit="tail")`` over real NIXL, the receiver in another process: a prefill sends
every page at once; a decode that reserved fewer gets exactly the last ones, byte-exact;
one that never comes, or dies, ends the send without a WRITE; one that needs none of it
declines it (``decline``), before or after the send, and the send ends at once."""

from __future__ import annotations

import signal

import pytest

from kvservice import FailureReason, TransferService, TransferStatus
from kvservice.testing import pattern
from tests.helpers import SMALL, config, eventually, free_port, peer_config, peers

pytestmark = pytest.mark.nixl


async def test_a_decode_that_reserved_fewer_pages_gets_the_last_ones_byte_exact() -> None:
    async with peers(peer_config()) as (decode,), TransferService(config()) as svc:
        src, dst = [3, 4, 5, 9], [40, 2]
        # the first two pages hold another pattern: had they been sent, the decode's check fails
        svc.kv.write(src[:2], pattern(SMALL, "head", 2))
        svc.kv.write(src[2:], pattern(SMALL, "r1", 2))
        handle = await svc.send("r1", src, last=True, fit="tail")  # before the decode asked
        await decode.command(op="expect", rid="r1", pages=dst, sender=svc.address)
        result = await svc.await_completion(handle, timeout=10)
        assert (result.status, result.pages, result.bytes) == (TransferStatus.SUCCESS, 2, 2 * SMALL.page_bytes)
        arrived = await decode.event("arrived", "r1")
        assert arrived["status"] == "SUCCESS" and arrived["verified"] is True, arrived
        await decode.command(op="untouched", pages=[p for p in range(SMALL.num_pages) if p not in dst])
        assert (await decode.event("untouched"))["ok"] is True


async def test_a_decode_that_never_comes_ends_the_send_at_the_bootstrap_deadline() -> None:
    async with TransferService(config(bootstrap_timeout_s=0.5)) as svc:
        handle = await svc.send("alone", [1, 2, 3], last=True, fit="tail")
        result = await svc.await_completion(handle, timeout=10)
        assert result.reason is FailureReason.TIMEOUT and result.settled, result
        assert svc.status()["live_nixl_handles"] == 0


async def test_a_decode_that_expected_and_died_fails_the_send_at_once() -> None:
    async with peers(peer_config()) as (decode,), TransferService(config()) as svc:
        await decode.command(op="expect", rid="d1", pages=[7], sender=svc.address)
        await decode.event("expecting", "d1")
        await eventually(lambda: svc.expected("d1"), 10)
        decode.signal(signal.SIGKILL)
        await eventually(lambda: svc.expect_dropped("d1"), 10, what="the dead decode's expect dropped")
        handle = await svc.send("d1", [1, 2], last=True, fit="tail")
        result = await svc.await_completion(handle, timeout=10)
        assert result.reason is FailureReason.PEER_LOST and result.settled, result
        assert svc.status()["live_nixl_handles"] == 0


async def test_a_decode_that_declines_ends_the_send_at_once_without_a_write() -> None:
    # the bootstrap deadline is far: only the decline can end the send within the test
    async with peers(peer_config()) as (decode,), TransferService(config(bootstrap_timeout_s=600)) as svc:
        svc.kv.write([1, 2], pattern(SMALL, "c1", 2))
        handle = await svc.send("c1", [1, 2], last=True, fit="tail")
        await decode.command(op="decline", rid="c1", sender=svc.address, message="all cached")
        assert (await decode.event("declined", "c1"))["ok"] is True
        result = await svc.await_completion(handle, timeout=30)
        assert (result.reason, result.settled, result.pages) == (FailureReason.ABORTED, True, 0), result
        assert "declined: all cached" in result.message, result.message
        await decode.command(op="untouched", pages=list(range(SMALL.num_pages)))
        assert (await decode.event("untouched"))["ok"] is True
        assert svc.status()["live_nixl_handles"] == 0

        # declined before the prefill sent it: the send fails at once when it comes
        await decode.command(op="decline", rid="c2", sender=svc.address)
        assert (await decode.event("declined", "c2"))["ok"] is True
        await eventually(lambda: svc.expect_dropped("c2"), 10, what="the declined expect recorded")
        result = await svc.await_completion(await svc.send("c2", [3], last=True, fit="tail"), timeout=30)
        assert (result.reason, result.settled) == (FailureReason.ABORTED, True), result

        # an address nobody listens on: nothing to tell, said so (the decode goes on)
        await decode.command(op="decline", rid="c3", sender=f"127.0.0.1:{free_port()}")
        assert (await decode.event("declined", "c3"))["ok"] is False
        await decode.command(op="status")
        assert (await decode.event("status"))["receiving"] == 0
