"""A peer is who it proved to be: addresses, notifications and metadata cannot be
claimed, forged or read off the wire (docs/security.md, docs/settle.md).

Each test is an attack that worked before this was built, made against real
services: real NIXL agents, real processes, real SIGSTOP/SIGKILL.  After each one,
legitimate requests still pass byte-exact."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import signal
import struct
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import msgspec
import pytest

from kvservice import FailureReason, KVPoll, TransferService
from kvservice._control.protocol import (
    FENCE,
    ChunkNotif,
    Failed,
    Hello,
    Outcome,
    Sealed,
    decode_body,
    encode_notif,
    negotiate,
)
from kvservice._trust.handshake import ACCEPTOR, DIALER, EXCHANGE_SINCE, MAC_BYTES, LinkSecrets, transcript
from kvservice._trust.keys import load_key
from kvservice.testing import PeerProcess, pattern
from kvservice.testing.inspect import inside
from tests.faults.test_settle import LAYOUT, PAGES, TCP, send_then_stop
from tests.helpers import SMALL, config, eventually, heard_by, peer_config, peers, scaled

pytestmark = [pytest.mark.nixl]

WAIT_S = 60.0  # a hang guard for each wait, never a timed assertion



def refused(svc: TransferService, kind: str) -> int:
    return int(svc.status()["refused"].get(kind, 0))


def claiming(svc: TransferService, address: str) -> None:
    """Make ``svc`` advertise ``address`` in its Hellos: a claim, as a misconfigured or
    hostile service makes it (its own port stays where it is)."""
    inside(svc).advertise(address)


def metadata_of(svc: TransferService) -> bytes:
    """``svc``'s NIXL metadata, as any peer it ever linked with holds it."""
    return inside(svc).metadata


async def forge(name: str, metadata: bytes, peer: str, notifs: list[bytes]) -> None:
    """A separate NIXL agent named ``name`` sends ``notifs`` to agent ``peer`` (``tests.forger``)."""
    spec = {"name": name, "metadata": metadata.hex(), "peer": peer, "notifs": [n.hex() for n in notifs]}
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "UCX_LOG_FILE": "stderr"}
    with anyio.fail_after(WAIT_S):
        done = await anyio.run_process([sys.executable, "-m", "tests.forger"], input=msgspec.json.encode(spec),
                                       env=env, check=False)
    assert done.returncode == 0 and b"sent" in done.stdout, done.stderr.decode()[-2000:]


def forged_notifs(rid: str, chunk: int, total: int, payload: bytes | None = None) -> list[bytes]:
    """What a forger can make: a notification sealed under a key of its own, and one in
    the format from before notifications carried a MAC."""
    n = ChunkNotif(rid, chunk, total, payload)
    return [encode_notif(n, secrets.token_bytes(32)), b"kv1" + msgspec.msgpack.encode(n)]


# -- 1. a claimed address settles nothing --------------------------------------------------------


@pytest.mark.slow
async def test_a_claimed_address_or_a_forged_fence_settles_nothing(key_file: str) -> None:
    """Decode R's request from prefill S fails while S is SIGSTOPped mid-copy; its pages
    stay unsettled.  A third service M then links with R claiming S's address, and a
    forger named like S sends R a settle fence: neither settles anything (before, M's
    claim settled the pages and S's late WRITE overwrote them once resumed).  Once S is
    SIGKILLed, R settles: its address refuses."""
    # S's silence is seen soon; R's and M's own links must not be lost for a slow machine
    keyed = {"ucx_env": TCP, "auth_key_file": key_file, "heartbeat_interval_s": 0.2, "peer_timeout_s": scaled(1.0)}
    async with (peers(peer_config(LAYOUT, **keyed), env=TCP) as (prefill,),
                TransferService(config(LAYOUT, **keyed)) as decode,
                TransferService(config(LAYOUT, **keyed)) as mallory):
        await send_then_stop(prefill, decode, "held")
        try:
            failed = await decode.await_arrival("held", timeout=WAIT_S)
            assert failed.reason in (FailureReason.TIMEOUT, FailureReason.PEER_LOST), failed
            await eventually(lambda: decode.status()["peers"] == [], WAIT_S)  # S's link is gone
            # M links with R advertising S's address ("a new incarnation holds it")
            claiming(mallory, prefill.address)
            await mallory.expect("m-1", [1], sender=decode.address)
            await eventually(lambda: len(decode.status()["peers"]) == 1, WAIT_S)
            # ... and a forger named S sends the held request's settle fence
            await forge(prefill.agent, metadata_of(decode), decode.agent_name, forged_notifs("held", FENCE, FENCE))
            # R keeps S's agent loaded while it holds pages for it (so that S's own WRITEs can
            # end once S resumes): NIXL then does not deliver the forger's notifications at all
            # (its connection is refused under S's name); were one delivered, it is refused
            # as forged.  Either way nothing of it may settle the held pages (below).
            with contextlib.suppress(TimeoutError):
                await eventually(lambda: refused(decode, "notif_forged") >= 1, 5.0)
            assert set(decode.status()["refused"]) <= {"notif_forged"}, decode.status()["refused"]
            # R probes S's address with back-off (0.2, 0.4, ... s): M's claim was there to be found
            still = await decode.await_settled("held", timeout=7.0)
            assert not still.settled, still
            assert decode.status()["unsettled_pages"] == len(PAGES)
        finally:
            prefill.signal(signal.SIGKILL)
        with anyio.fail_after(WAIT_S):
            settled = await decode.await_settled("held")
        assert settled.settled and not settled.ok, settled
        assert decode.status()["unsettled_pages"] == 0


# -- 2. a claimed address cannot take a pinned request -------------------------------------------


async def legit(prefill: TransferService, decode: PeerProcess, rid: str, *, pinned: bool = False) -> None:
    """``rid`` from the in-process prefill to the decode process, verified byte for byte there."""
    src, dst = [3, 4, 5], [40, 41, 42]
    prefill.kv.write(src, pattern(SMALL, rid, len(src)))
    handle = await prefill.send(rid, src, last=True, receiver=decode.address if pinned else None)
    await decode.command(op="expect", rid=rid, pages=dst, sender=prefill.address)
    await decode.event("expecting", rid)
    assert (await prefill.await_completion(handle, timeout=WAIT_S)).ok
    arrived = await decode.event("arrived", rid)
    assert arrived["status"] == "SUCCESS" and arrived["verified"] is True, arrived


async def test_a_claimed_address_cannot_take_a_request_pinned_to_it(key_file: str) -> None:
    """Prefill S pins a request to decode R; M, holding the key, links with S claiming
    R's address and expects it: refused (``receiver_mismatch``), M's pages untouched.
    R, linking while M is linked, is not refused, and receives it byte-exact."""
    keyed = {"auth_key_file": key_file}
    async with (peers(peer_config(**keyed)) as (decode,),
                TransferService(config(**keyed)) as prefill,
                TransferService(config(**keyed)) as mallory):
        src = [5, 6]
        prefill.kv.write(src, pattern(SMALL, "pinned", 2))
        handle = await prefill.send("pinned", src, last=True, receiver=decode.address)
        claiming(mallory, decode.address)
        await mallory.expect("pinned", [10, 11], sender=prefill.address)
        stolen = await mallory.await_arrival("pinned", timeout=WAIT_S)
        assert stolen.reason is FailureReason.REFUSED and "pinned" in stolen.message, stolen
        assert bool((mallory.kv.pages([10, 11]) == 0).all())
        assert refused(prefill, "receiver_mismatch") == 1
        assert handle.poll() is KVPoll.Bootstrapping  # still waiting for the real R
        await decode.command(op="expect", rid="pinned", pages=[20, 21], sender=prefill.address)
        assert (await prefill.await_completion(handle, timeout=WAIT_S)).ok
        arrived = await decode.event("arrived", "pinned")
        assert arrived["status"] == "SUCCESS" and arrived["verified"] is True, arrived
        assert refused(prefill, "address_live") == 0
        await legit(prefill, decode, "after-claim", pinned=True)


# -- 3. forged completion notifications --------------------------------------------------------


async def test_forged_completions_complete_nothing(key_file: str) -> None:
    """A forger named like prefill S, holding decode R's metadata, sends the completion
    of a request S never sent, with a payload: R ignores it and counts it
    (``notif_forged``); S's real send then completes byte-exact with its own payload."""
    keyed = {"auth_key_file": key_file}
    async with (peers(peer_config(**keyed)) as (prefill,),
                TransferService(config(**keyed)) as decode):
        dst = [30, 31]
        await decode.expect("forged", dst, sender=prefill.address)
        await forge(prefill.agent, metadata_of(decode), decode.agent_name,
                    forged_notifs("forged", 0, 1, b"FORGED-PAYLOAD"))
        await eventually(lambda: refused(decode, "notif_forged") >= 1, WAIT_S)
        await anyio.sleep(0.2)  # the old-format one is ignored as not ours, not acted on
        assert decode.poll_arrival("forged") is KVPoll.WaitingForInput
        await prefill.command(op="fill", rid="forged", pages=[1, 2])
        await prefill.event("filled", "forged")
        await prefill.command(op="send", rid="forged", pages=[1, 2], last=True, payload="real")
        result = await decode.await_arrival("forged", timeout=WAIT_S)
        assert result.ok and result.payload == b"real", result
        assert bool((decode.kv.pages(dst) == pattern(SMALL, "forged", 2)).all())


# -- 4. the Join is confidential when keyed ----------------------------------------------------


@contextlib.asynccontextmanager
async def relay(target: str) -> AsyncIterator[tuple[str, list[bytes], dict[str, bytearray]]]:
    """A TCP relay on the path to ``target``: its address, every byte it carried, and
    the bytes by direction ("up": towards ``target``, "down": back)."""
    host, port = target.rsplit(":", 1)
    seen: list[bytes] = []
    ways = {"up": bytearray(), "down": bytearray()}
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)

    async def pipe(src: anyio.abc.ByteStream, dst: anyio.abc.ByteStream, way: str) -> None:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            async for data in src:
                seen.append(data)
                ways[way] += data
                await dst.send(data)
        with contextlib.suppress(Exception):
            await dst.aclose()

    async def serve(client: anyio.abc.SocketStream) -> None:
        server = await anyio.connect_tcp(host, int(port))
        async with client, server, anyio.create_task_group() as tg:
            tg.start_soon(pipe, client, server, "up")
            tg.start_soon(pipe, server, client, "down")

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        port_ = listener.extra(anyio.abc.SocketAttribute.local_port)
        try:
            yield f"127.0.0.1:{port_}", seen, ways
        finally:
            tg.cancel_scope.cancel()


def leaks(metadata: bytes, wire: bytes, window: int = 48) -> bool:
    """Whether any ``window`` bytes of ``metadata`` crossed the wire in clear."""
    return any(metadata[i:i + window] in wire for i in range(0, max(1, len(metadata) - window), 8))


@pytest.mark.parametrize("keyed", [True, False])
async def test_the_join_crosses_the_wire_encrypted_when_keyed(key_file: str, keyed: bool) -> None:
    """A relay on the path records the handshake: with a key, neither side's NIXL
    metadata is in what it saw (before, both were, in clear); without one (the explicit
    ``allow_unauthenticated``), they are, as docs/security.md says.  The transfer through the
    relayed link passes byte-exact either way."""
    trust: dict[str, Any] = {"auth_key_file": key_file} if keyed else {"allow_unauthenticated": True}
    async with (TransferService(config(**trust)) as prefill, TransferService(config(**trust)) as decode,
                relay(prefill.address) as (via, seen, _)):
        await relayed_transfer(prefill, decode, via, "relayed")
        assert bool((decode.kv.pages([7, 8]) == pattern(SMALL, "relayed", 2)).all())
        wire = b"".join(seen)
        assert len(wire) > 1000  # the handshake went through the relay
        for svc in (prefill, decode):
            assert leaks(metadata_of(svc), wire) is not keyed


async def relayed_transfer(prefill: TransferService, decode: TransferService, via: str, rid: str) -> None:
    """``rid``: prefill pages 1-2 into the decode's 7-8, the decode dialling through ``via``."""
    prefill.kv.write([1, 2], pattern(SMALL, rid, 2))
    await decode.expect(rid, [7, 8], sender=via)
    sent = await prefill.await_completion(await prefill.send(rid, [1, 2], last=True), timeout=WAIT_S)
    assert sent.ok and (await decode.await_arrival(rid, timeout=WAIT_S)).ok


def frames(wire: bytes, count: int) -> list[bytes]:
    """The first ``count`` frame bodies in one direction's bytes (MACs left on)."""
    bodies, at = [], 0
    for _ in range(count):
        (n,) = struct.unpack(">I", wire[at:at + 4])
        bodies.append(wire[at + 4:at + 4 + n])
        at += 4 + n
    return bodies


async def test_a_key_holder_who_recorded_the_handshake_opens_nothing(key_file: str) -> None:
    """A member holding the cluster key records a link's handshake (a relay on the path)
    and derives every secret the transcript gives: neither Join opens (each side's NIXL
    metadata stays unknown to it), and its forged completion under the notification key
    it derives is refused.  Before the key exchange of protocol version 6, the transcript
    and the key were all a link's secrets came from, and both Joins opened."""
    key = load_key(key_file)
    keyed = {"auth_key_file": key_file}
    async with (TransferService(config(**keyed)) as prefill, TransferService(config(**keyed)) as decode,
                relay(prefill.address) as (via, _, ways)):
        await relayed_transfer(prefill, decode, via, "recorded")
        hello_d, _proof, join_d = frames(bytes(ways["up"]), 3)
        hello_a, join_a = frames(bytes(ways["down"]), 2)
        d, a = decode_body(hello_d), decode_body(hello_a)
        assert isinstance(d, Hello) and isinstance(a, Hello) and len(d.share) == len(a.share) == 32
        boxes = [decode_body(body[:-MAC_BYTES]) for body in (join_d, join_a)]
        assert all(isinstance(box, Sealed) for box in boxes)
        version = negotiate(d)
        assert version >= EXCHANGE_SINCE
        scripts = [  # what a key holder can compute from the recording
            transcript((d.agent, d.address, d.nonce), (a.agent, a.address, a.nonce)),
            transcript((d.agent, d.address, d.nonce), (a.agent, a.address, a.nonce), version, (d.share, a.share)),
        ]
        for script in scripts:
            for box, role in zip(boxes, (ACCEPTOR, DIALER), strict=True):  # each side opens its peer's
                assert LinkSecrets(key, script, role).open_join(box.box) is None  # type: ignore[union-attr]
        # its forged completion of a request the decode expects from the prefill
        await decode.expect("forged", [9], sender=via)
        forger = LinkSecrets(key, scripts[1], ACCEPTOR)
        refused_before = refused(decode, "notif_forged")
        inside(decode).plane.inbound.on_notifs({prefill.agent_name: [
            encode_notif(ChunkNotif("forged", 0, 1, b"forged payload"), forger.notif_out)]})
        assert refused(decode, "notif_forged") == refused_before + 1
        assert decode.status()["receiving"] == 1  # "forged" still waits for the real sender
        prefill.kv.write([3], pattern(SMALL, "forged", 1))
        sent = await prefill.await_completion(await prefill.send("forged", [3], last=True), timeout=WAIT_S)
        assert sent.ok and (await decode.await_arrival("forged", timeout=WAIT_S)).ok
        assert bool((decode.kv.pages([9]) == pattern(SMALL, "forged", 1)).all())


# -- 5. a request answers only to its peer -------------------------------------------------------


async def test_only_the_requests_peer_can_end_it_or_learn_its_outcome(key_file: str) -> None:
    """M (holding the key) expects and aborts an id the prefill has not sent yet, and M2
    expects it and disconnects: the prefill's later send pinned to R is not failed, and
    R receives it byte-exact.  M then asks R, with a ``Failed``, how a request R received
    from the prefill ended: R does not answer, and counts it (``foreign_request``)."""
    keyed = {"auth_key_file": key_file}
    async with (peers(peer_config(**keyed)) as (decode,),
                TransferService(config(**keyed)) as prefill,
                TransferService(config(**keyed)) as mallory):
        async with TransferService(config(**keyed)) as mallory2:
            await mallory2.expect("early", [9], sender=prefill.address)
            await mallory.expect("early", [1], sender=prefill.address)
            await eventually(lambda: prefill.status()["expects_before_send"] == 2, WAIT_S)
            await mallory.abort("early")
        await eventually(lambda: prefill.status()["expects_before_send"] == 0, WAIT_S)  # dropped: both
        prefill.kv.write([5], pattern(SMALL, "early", 1))
        handle = await prefill.send("early", [5], last=True, receiver=decode.address)
        await anyio.sleep(0.2)
        assert handle.result is None, handle.result  # not ABORTED by M, not failed by M2's loss
        await decode.command(op="expect", rid="early", pages=[44], sender=prefill.address)
        assert (await prefill.await_completion(handle, timeout=WAIT_S)).ok
        arrived = await decode.event("arrived", "early")
        assert arrived["status"] == "SUCCESS" and arrived["verified"] is True, arrived

        # M links with R (any request will do) and asks about "early"
        heard = heard_by(mallory)
        await decode.command(op="fill", rid="m-probe", pages=[1])
        await mallory.expect("m-probe", [2], sender=decode.address)
        inside(mallory).control.send_to(decode.agent, Failed("early", FailureReason.TIMEOUT.value, "did it arrive?"))

        async def refused_foreign() -> bool:
            await decode.command(op="status", rid="s")
            status = await decode.event("status", "s")
            return bool(status["refused"].get("foreign_request", 0) >= 1)

        await eventually(refused_foreign, WAIT_S, 0.05, what="the decode refusing the foreign request")
        assert not [m for m in heard if isinstance(m, Outcome)], heard
        await legit(prefill, decode, "after-foreign")


# -- 7. Expects for ids not sent yet are bounded in pages ----------------------------------------


async def test_early_expects_are_bounded_in_pages(key_file: str) -> None:
    """A peer announcing whole-pool requests the prefill has not sent is refused past
    ``max_unknown_expect_pages`` (before, only their count was bounded: 10,000 of them
    held gigabytes); the refusal is counted and another peer is not disturbed."""
    keyed = {"auth_key_file": key_file}
    async with (peers(peer_config(**keyed)) as (decode,),
                TransferService(config(max_unknown_expect_pages=100, **keyed)) as prefill,
                TransferService(config(**keyed)) as flooder):
        everything = list(range(SMALL.num_pages))
        for i in range(3):
            await flooder.expect(f"flood-{i}", everything, sender=prefill.address)
        refused_ = await flooder.await_arrival("flood-2", timeout=WAIT_S)
        assert refused_.reason is FailureReason.REFUSED and "max_unknown_expect_pages" in refused_.message
        assert refused(prefill, "unknown_expect_limit") == 2  # 64 pages held, 64 more would pass 100
        await legit(prefill, decode, "after-flood")


# -- both sides hear a mismatch ------------------------------------------------------------------


async def test_an_incompatible_decode_fails_the_sends_pinned_to_it_at_once(key_file: str) -> None:
    """A decode of another model (head_dim 32, not 64) expects a request the prefill
    pinned to it: the decode fails ``INCOMPATIBLE`` saying it from its side, and so does
    the prefill's send at once (before, it waited ``bootstrap_timeout_s`` and ended
    ``TIMEOUT``)."""
    other = dataclasses.replace(SMALL, head_dim=32)
    keyed = {"auth_key_file": key_file}
    async with (peers(peer_config(other, **keyed)) as (decode,),
                TransferService(config(bootstrap_timeout_s=30, **keyed)) as prefill):
        handle = await prefill.send("mismatch", [1], last=True, receiver=decode.address)
        await decode.command(op="expect", rid="mismatch", pages=[2], sender=prefill.address)
        arrived = await decode.event("arrived", "mismatch")
        assert arrived["reason"] == "INCOMPATIBLE", arrived
        assert "head_dim 32 here, 64 there" in arrived["message"], arrived
        with anyio.fail_after(10):
            sent = await prefill.await_completion(handle)
        assert sent.reason is FailureReason.INCOMPATIBLE, sent
        assert "head_dim 64 here, 32 there" in sent.message, sent
