"""A worker behind a sidecar declines a request and reads the early expects as an
in-process engine does (``decline``, ``expected``, ``expected_pages``,
``expect_dropped``), with real daemons, real NIXL and real shared memory; bad
arguments and hostile frames for these calls are refused and the daemons go on
moving bytes exactly.

The daemons' bootstrap deadline is far (600 s): only a decline can end an
unexpected send within a test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import anyio
import msgspec
import pytest
import torch

from kvservice import FailureReason, KVServiceError, SidecarClient
from kvservice._control.protocol import MAX_TEXT
from kvservice.sidecar.frames import frame_stream
from kvservice.sidecar.wire import (
    SIDECAR_OLDEST_VERSION,
    SINCE,
    Decline,
    Error,
    Expected,
    Hello,
    ServerMessage,
    Status,
    StatusReply,
    Welcome,
    decode_server,
    encode,
)
from kvservice.testing import pattern
from tests.helpers import eventually, free_port, scaled

from .daemons import Sidecar, frame, metrics, raw_exchange, sidecars

pytestmark = pytest.mark.nixl

GUARD_S = scaled(30.0)
FAR = {"KVSERVICE_SERVICE_BOOTSTRAP_TIMEOUT_S": "600"}
FRAMES_REJECTED = "kvservice_sidecar_frames_rejected_total"
CALL_VERSION = 'kvservice_refused_total{where="workers",kind="call_version"}'


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Sidecar, Sidecar]]:
    with sidecars("prefill", "decode", env=FAR) as (p, d):
        yield p, d


async def transfer(w: SidecarClient, d: SidecarClient, rid: str, src: list[int], dst: list[int]) -> None:
    """One request worker to worker through both daemons, checked byte for byte."""
    w.kv.write(src, pattern(w.layout, rid, len(src)))
    await d.expect(rid, dst, sender=w.address)
    sent = await w.await_completion(await w.send(rid, src, last=True), timeout=GUARD_S)
    assert sent.ok, sent
    assert (await d.await_arrival(rid, timeout=GUARD_S)).ok
    assert torch.equal(d.kv.pages(dst), pattern(d.layout, rid, len(src)))


async def test_expected_and_expected_pages_follow_a_real_expect(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = pair
    async with SidecarClient(prefill.socket) as w, SidecarClient(decode.socket) as d:
        rid, src, dst = "early-1", [1, 2, 3], [40, 41, 42]
        assert (await w.expected(rid), await w.expected_pages(rid), await w.expect_dropped(rid)) == (False, None, None)
        w.kv.write(src, pattern(w.layout, rid, 3))
        await d.expect(rid, dst, sender=w.address)
        await eventually(lambda: w.expected(rid), GUARD_S, 0.01, what=f"{rid}: the expect reaching the sender")
        assert await w.expected_pages(rid) == 3 and await w.expect_dropped(rid) is None
        sent = await w.await_completion(await w.send(rid, src, last=True), timeout=GUARD_S)
        assert sent.ok, sent
        assert (await w.expected(rid), await w.expected_pages(rid)) == (False, None)  # bound: no longer waiting
        assert (await d.await_arrival(rid, timeout=GUARD_S)).ok
        assert torch.equal(d.kv.pages(dst), pattern(d.layout, rid, 3))

        # an expect the receiver aborts before any send: dropped, and the send fails at once
        rid = "early-2"
        await d.expect(rid, [43], sender=w.address)
        await eventually(lambda: w.expected(rid), GUARD_S, 0.01, what=f"{rid}: the expect reaching the sender")
        await d.abort(rid)

        async def dropped() -> bool:
            return await w.expect_dropped(rid) is not None

        await eventually(dropped, GUARD_S, 0.01, what=f"{rid}: the dropped expect recorded")
        reason, whose = await w.expect_dropped(rid) or (None, "")
        assert reason is FailureReason.ABORTED and whose, (reason, whose)
        assert (await w.expected(rid), await w.expected_pages(rid)) == (False, None)
        failed = await w.await_completion(await w.send(rid, [4], last=True), timeout=GUARD_S)
        assert failed.reason is FailureReason.ABORTED, failed


async def test_decline_ends_the_senders_send_at_once_and_frees_its_pages(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = pair
    async with SidecarClient(prefill.socket) as w, SidecarClient(decode.socket) as d:
        rid = "declined-1"
        w.kv.write([5, 6], pattern(w.layout, rid, 2))
        handle = await w.send(rid, [5, 6], last=True, fit="tail")
        t0 = time.monotonic()
        assert await d.decline(rid, sender=w.address, message="all cached") is True
        result = await w.await_completion(handle, timeout=GUARD_S)
        assert time.monotonic() - t0 < 10, "the decline, not the 600 s bootstrap deadline, ended it"
        assert (result.reason, result.settled, result.pages) == (FailureReason.ABORTED, True, 0), result
        assert "declined: all cached" in result.message, result.message
        assert (await w.fetch_status())["live_nixl_handles"] == 0

        # declined before the send: recorded as a dropped expect, the send fails at once
        rid = "declined-2"
        assert await d.decline(rid, sender=w.address) is True

        async def dropped() -> bool:
            return await w.expect_dropped(rid) is not None

        await eventually(dropped, GUARD_S, 0.01, what=f"{rid}: the declined expect recorded")
        assert (await w.expect_dropped(rid) or (None,))[0] is FailureReason.ABORTED
        result = await w.await_completion(await w.send(rid, [7], last=True, fit="tail"), timeout=GUARD_S)
        assert (result.reason, result.settled) == (FailureReason.ABORTED, True), result

        # a message longer than the control channel carries is cut as in-process
        rid = "declined-3"
        handle = await w.send(rid, [8], last=True)
        assert await d.decline(rid, sender=w.address, message="x" * (3 * MAX_TEXT)) is True
        result = await w.await_completion(handle, timeout=GUARD_S)
        assert result.reason is FailureReason.ABORTED and len(result.message) <= MAX_TEXT + 64, len(result.message)

        # nobody listens there: nothing to tell, said so; a request expected here: abort it instead
        assert await d.decline("declined-4", sender=f"127.0.0.1:{free_port()}") is False
        await d.expect("declined-5", [44], sender=w.address)
        with pytest.raises(ValueError, match="expected here: abort"):
            await d.decline("declined-5", sender=w.address)
        assert (await d.abort("declined-5")) is not None


async def test_bad_arguments_are_refused_and_the_daemons_go_on(pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = pair
    async with SidecarClient(prefill.socket) as w, SidecarClient(decode.socket) as d:
        with pytest.raises(ValueError, match="request_id"):
            await d.decline("", sender=w.address)
        with pytest.raises(ValueError, match="request_id"):
            await d.decline("r" * 257, sender=w.address)
        with pytest.raises(ValueError, match="host:port"):
            await d.decline("bad-1", sender="nowhere")
        with pytest.raises(ValueError, match="host:port"):
            await d.decline("bad-1", sender=f"{'h' * 600}:1")
        with pytest.raises(ValueError, match="message must be a str"):
            await d.decline("bad-1", sender=w.address, message=b"bytes")  # type: ignore[arg-type]
        for call in (w.expected, w.expected_pages, w.expect_dropped, w.abort, w.await_settled, d.await_arrival,
                     d.fetch_poll_arrival):
            with pytest.raises(ValueError, match="request_id"):
                await call("")
            with pytest.raises(ValueError, match="request_id"):
                await call(["not", "an", "id"])  # type: ignore[arg-type]
        with pytest.raises(KVServiceError, match="does not serve the decode role"):
            await w.decline("bad-2", sender=d.address)
        # ids nobody used: the service's answers, as in-process
        assert (await w.expected("never"), await w.expected_pages("never"), await w.expect_dropped("never")) == (
            False, None, None)
        await transfer(w, d, "after-bad-arguments", [9, 10], [45, 46])  # the same connections go on


async def test_hostile_frames_for_the_new_calls_are_refused_and_bytes_still_move(
        pair: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = pair
    before = await metrics(decode.http)
    cases = [  # each a frame the schema refuses: Error call 0, that connection closed
        encode(Decline(1, "h1", "127.0.0.1:1", "x" * (MAX_TEXT + 1))),
        encode(Decline(1, "h1", "127.0.0.1:1" * 60)),
        encode(Decline(1, "h1", "")),
        encode(Expected(1, "r" * 257)),
        frame(msgspec.msgpack.encode({"type": "decline", "call": 1, "request_id": "h1", "sender": 7})),
        frame(msgspec.msgpack.encode({"type": "expected", "call": 1, "request_id": "h1", "pages": [1]})),
        frame(msgspec.msgpack.encode({"type": "expected", "call": 0, "request_id": "h1"})),
    ]
    for payload in cases:
        replies = await raw_exchange(decode.socket, payload)
        errors = [r for r in replies if isinstance(r, Error)]
        assert errors and errors[-1].call == 0 and "malformed frame" in errors[-1].message, (payload[:60], replies)
    after = await metrics(decode.http)
    assert after.get(FRAMES_REJECTED, 0) - before.get(FRAMES_REJECTED, 0) == len(cases)

    # a connection agreed at the oldest version: a newer call is refused, the connection stays
    with anyio.fail_after(GUARD_S):
        async with await anyio.connect_unix(decode.socket) as stream:
            framed = frame_stream(stream, 1 << 20, decode_server)
            await framed.send(Hello(SIDECAR_OLDEST_VERSION, "old"))
            welcome: ServerMessage = await framed.recv()
            assert isinstance(welcome, Welcome) and welcome.version == SIDECAR_OLDEST_VERSION
            await framed.send(Expected(1, "h2"))
            refused = await framed.recv()
            assert isinstance(refused, Error) and refused.call == 1 and refused.kind == "ProtocolError", refused
            assert f"protocol version {SINCE[Expected]}" in refused.message, refused
            await framed.send(Status(2))
            assert isinstance(await framed.recv(), StatusReply)
    assert (await metrics(decode.http)).get(CALL_VERSION, 0) - before.get(CALL_VERSION, 0) == 1

    async with SidecarClient(prefill.socket) as w, SidecarClient(decode.socket) as d:
        await transfer(w, d, "after-hostile-frames", [11, 12, 13], [47, 48, 49])
    assert prefill.proc is not None and prefill.proc.poll() is None
    assert decode.proc is not None and decode.proc.poll() is None
