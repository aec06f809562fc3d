"""A hostile client against a real prefill service (real NIXL, a real decode process).

Each attack must get a clear refusal (a ``Reject`` with its kind, or the
connection closed), be counted in ``status()["refused"]``, and disturb no one:
after every attack the service is up and a legitimate request still passes
byte-exact to a real decode process."""

from __future__ import annotations

import functools
import itertools
import os
import resource
import struct
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import structlog

from kvservice import FailureReason, ServiceConfig, TransferService
from kvservice._control.protocol import MAX_REGIONS, Expect, Hello, Join, Ping, Proof, Sealed, frame
from kvservice._nixl.agent import NixlDoor
from kvservice._nixl.door import DoorThread
from kvservice._trust.handshake import DIALER, prove
from kvservice._trust.keys import generate_key, load_key
from kvservice.memory import KVLayout
from kvservice.memory._pool import KVPool
from kvservice.testing import PeerProcess, pattern
from tests.helpers import LOOPBACK_UCX, SMALL, config, eventually, peer_config, peers, register_pool, scaled
from tests.hostile import Raw, authenticate, dial, is_reject, join_for, own_key, wire_memory

pytestmark = pytest.mark.nixl

_rids = itertools.count()


#: a hang guard for a wait on a condition (it comes much sooner), never a timed assertion
WAIT_S = 60.0


def hostile_config(**kw: Any) -> ServiceConfig:
    # short: a stalled handshake or a silent link ends soon; as long as this machine needs
    # for the legitimate peers to meet them
    kw.setdefault("connect_timeout_s", scaled(1.0))
    kw.setdefault("heartbeat_interval_s", 0.25)
    kw.setdefault("peer_timeout_s", scaled(1.5))
    return config(**kw)


def refused(svc: TransferService, kind: str) -> int:
    return int(svc.status()["refused"].get(kind, 0))


async def legit_transfer(svc: TransferService, decode: PeerProcess) -> None:
    """One request, prefill (svc) -> decode process, verified byte for byte there."""
    rid = f"legit-{next(_rids)}"
    src, dst = [3, 4, 5], [40, 41, 42]
    svc.kv.write(src, pattern(SMALL, rid, len(src)))
    await decode.command(op="expect", rid=rid, pages=dst, sender=svc.address)
    await decode.event("expecting", rid)
    handle = await svc.send(rid, src, last=True)
    result = await svc.await_completion(handle, timeout=15)
    assert result.ok, result
    arrived = await decode.event("arrived", rid)
    assert arrived["status"] == "SUCCESS" and arrived["verified"] is True, arrived


async def expect_refusal(svc: TransferService, decode: PeerProcess, kind: str,
                         attack: Callable[[], Awaitable[object]]) -> None:
    before = refused(svc, kind)
    await attack()
    await eventually(lambda: refused(svc, kind) > before, WAIT_S, 0.01, what=f"the refusal counted as {kind!r}")
    await legit_transfer(svc, decode)


async def answered(raw: Raw, kind: str) -> None:
    """The service answered ``raw`` with a Reject of ``kind`` and closed it."""
    msg = await raw.recv()
    assert is_reject(msg, kind), msg
    assert await raw.closed_by_peer()
    await raw.aclose()


# -- attacks before authentication ----------------------------------------------------------------


async def test_malformed_and_out_of_range_frames_are_refused_and_harmless() -> None:
    async with peers(peer_config()) as (decode,), TransferService(hostile_config()) as svc:
        await legit_transfer(svc, decode)

        async def raw_bytes(data: bytes, kind: str) -> None:
            raw = await Raw.connect(svc.address)
            await raw.send_raw(data)
            await answered(raw, kind)

        async def hello(kind: str, words: str = "", **fields: Any) -> None:
            raw, answer, _ = await dial(svc.address, hello=fields)
            assert is_reject(answer, kind) and words in answer.message, answer  # type: ignore[union-attr]
            assert await raw.closed_by_peer()
            await raw.aclose()

        attacks: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("frame", lambda: raw_bytes(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "frame")),  # an HTTP probe
            ("frame", lambda: raw_bytes(struct.pack(">I", 0xFFFFFFFF) + b"x" * 64, "frame")),  # oversized
            ("frame", lambda: raw_bytes(frame(b"\xc1\xc1\xc1"), "frame")),  # not msgpack
            ("frame", lambda: raw_bytes(frame(b"\x93\x01\x02\x03"), "frame")),  # msgpack, no message
            ("frame", lambda: raw_bytes(frame(b"\x82\xa4type\xa6expect\xaarequest_id\xa1r"), "frame")),
            ("version", lambda: hello("version", version=99)),
            ("hello_invalid", lambda: hello("hello_invalid", agent="bad name!")),
            ("frame", lambda: hello("frame", agent="a" * 129)),
            ("hello_invalid", lambda: hello("hello_invalid", nonce=b"short")),
            ("hello_invalid", lambda: hello("hello_invalid", address="0.0.0.0:5000")),
            ("hello_invalid", lambda: hello("hello_invalid", address="no-port")),
            ("hello_invalid", lambda: hello("hello_invalid", agent=svc.agent_name)),  # ourselves
            # a key-exchange share of small order (its shared secret would be all zero)
            ("hello_invalid", lambda: hello("hello_invalid", "the peer's public key is a point of small order",
                                            share=bytes(32))),
            ("hello_invalid", lambda: hello("hello_invalid", "a public key of 5 bytes, not 32", share=b"short")),
            ("frame", lambda: hello("frame", version="2")),
        ]
        for kind, attack in attacks:
            await expect_refusal(svc, decode, kind, attack)

        # a well-formed message, but not a Hello, before the handshake
        async def expect_first() -> None:
            raw = await Raw.connect(svc.address)
            await raw.send(Expect("stolen", [1, 2]))
            await answered(raw, "hello_invalid")

        await expect_refusal(svc, decode, "hello_invalid", expect_first)
        assert svc.status()["peers"] == [decode.address]


async def test_a_flood_of_garbage_is_counted_in_full_and_logged_in_bursts() -> None:
    """40 connections of garbage in a row: every one refused and counted, at most a burst of
    log lines (the next line says how many were held back), and the service serves on."""
    async with peers(peer_config()) as (decode,), TransferService(hostile_config()) as svc:
        before = refused(svc, "frame")
        with structlog.testing.capture_logs() as logs:
            for _ in range(40):
                raw = await Raw.connect(svc.address)
                await raw.send_raw(b"GET / HTTP/1.1\r\n\r\n")
                await answered(raw, "frame")
            await eventually(lambda: refused(svc, "frame") >= before + 40, WAIT_S, 0.01,
                             what="40 garbage frames counted")
        lines = [e for e in logs if e["event"] == "peer.handshake_failed" and e.get("kind") == "frame"]
        assert 1 <= len(lines) <= 10, len(lines)
        assert refused(svc, "frame") == before + 40
        await legit_transfer(svc, decode)


async def test_join_fields_out_of_range_are_refused_before_use() -> None:
    """A holder of the key (this user's own, what a service configured with nothing uses on
    loopback) passes the proof step; its Join is still checked field by field before
    anything reaches arithmetic, an allocation or NIXL."""
    async with peers(peer_config()) as (decode,), TransferService(hostile_config()) as svc:
        await legit_transfer(svc, decode)

        async def join(kind: str, **fields: Any) -> None:
            raw = await authenticate(svc.address, key=own_key(), agent="kv-stranger-2")
            await raw.send(join_for("kv-stranger-2", **fields))
            await answered(raw, kind)

        cases: list[tuple[str, dict[str, Any]]] = [
            ("frame", {"memory": wire_memory(region={"addr": -1})}),  # the Hello that used to end the service
            ("frame", {"memory": wire_memory(num_pages=0)}),
            ("frame", {"memory": wire_memory(num_pages=-5)}),
            ("frame", {"memory": wire_memory(region={"device_id": 70000})}),
            ("frame", {"memory": wire_memory(regions=0)}),
            ("frame", {"memory": wire_memory(regions=MAX_REGIONS + 1)}),
            ("frame", {"memory": wire_memory(region={"kind": "k" * 17})}),
            ("frame", {"memory": wire_memory(tp_size=0)}),
            ("frame", {"memory": {"num_pages": 64}}),
            ("frame", {"metadata": b""}),
            ("incompatible", {"memory": wire_memory(region={"addr": 0})}),
            ("incompatible", {"memory": wire_memory(num_pages=(1 << 31) - 1)}),  # a descriptor table of gigabytes
            ("incompatible", {"memory": wire_memory(region={"addr": (1 << 64) - 4096})}),  # wraps the address space
            ("incompatible", {"memory": wire_memory(region={"page_stride": 1})}),  # pages overlap
            ("incompatible", {"memory": wire_memory(KVLayout(**{**SMALL.wire_shape(), "layers": 3}))}),
            ("incompatible", {"memory": wire_memory(region={"dtype": "float32"})}),
            ("incompatible", {"memory": wire_memory(region={"kind": "bogus"})}),
            ("incompatible", {"memory": wire_memory(region={"layer": 0})}),  # regions out of order
            ("incompatible", {"memory": wire_memory(tp_size=2, tp_rank=5)}),
            ("metadata_mismatch", {"metadata": b"not nixl at all"}),
        ]
        for kind, fields in cases:
            await expect_refusal(svc, decode, kind, lambda kind=kind, fields=fields: join(kind, **fields))
        assert svc.status()["peers"] == [decode.address]


async def test_a_live_agents_name_cannot_be_taken_over() -> None:
    """A second connection claiming a live agent's name is refused.  (A live peer's
    *address* is not taken over either: a claim binds nothing, tests/faults/test_identity.py.)"""
    async with peers(peer_config()) as (decode,), TransferService(hostile_config()) as svc:
        await legit_transfer(svc, decode)  # the decode is linked now

        async def impersonate() -> None:  # claims the decode's agent name
            raw = await authenticate(svc.address, key=own_key(), agent=decode.agent, my_address="127.0.0.1:2")
            await raw.send(join_for(decode.agent))
            await answered(raw, "agent_live")

        await expect_refusal(svc, decode, "agent_live", impersonate)
        assert svc.status()["peers"] == [decode.address]
        assert svc.status()["outcomes"].get("send.PEER_LOST", 0) == 0


# -- the key --------------------------------------------------------------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, str]:
    paths = {}
    for name in ("cluster", "wrong"):
        paths[name] = str(tmp_path / f"{name}.key")
        generate_key(paths[name])
    return paths


async def test_without_the_key_nothing_is_learnt_and_nothing_is_accepted(keys: dict[str, str]) -> None:
    key, wrong = load_key(keys["cluster"]), load_key(keys["wrong"])
    cfg = hostile_config(auth_key_file=keys["cluster"])
    async with (peers(peer_config(auth_key_file=keys["cluster"])) as (decode,), TransferService(cfg) as svc):
        await legit_transfer(svc, decode)

        async def with_key(k: bytes | None) -> None:
            raw, answer, script = await dial(svc.address, agent="kv-stranger-3")
            assert isinstance(answer, Hello)  # the service proves itself first: that reveals nothing
            await raw.send(Proof(prove(k, DIALER, script)))
            await raw.send(join_for("kv-stranger-3"))
            msg = await raw.recv()
            assert is_reject(msg, "auth"), msg  # never the service's Join (its NIXL metadata)
            assert await raw.closed_by_peer()
            await raw.aclose()

        async def replay() -> None:
            """Record a genuine handshake (made with the key), replay its bytes on a new connection."""
            genuine = await authenticate(svc.address, key=key, agent="kv-recorded")
            recorded = list(genuine.sent)
            await genuine.aclose()
            raw = await Raw.connect(svc.address)
            for data in recorded:
                await raw.send_raw(data)
            first = await raw.recv()
            assert isinstance(first, Hello)  # a fresh nonce: the recorded proof no longer fits
            msg = await raw.recv()
            assert is_reject(msg, "auth"), msg
            await raw.aclose()

        async def tampered() -> None:
            """A key holder whose frames fail their MAC loses its link, nobody else's."""
            raw = await authenticate(svc.address, key=key, agent="kv-insider")
            raw.mac = None  # from now on its frames carry no MAC
            await raw.send(join_for("kv-insider"))
            assert await raw.closed_by_peer()  # after a (sealed) Reject it cannot read
            await raw.aclose()

        async def clear_join() -> None:
            """A key holder whose Join is not encrypted under its link's Join key is refused
            (as a dialer refuses such an acceptor: test_hostile_acceptor.py)."""
            raw = await authenticate(svc.address, key=key, agent="kv-insider-2")
            await raw.send(Sealed(msgspec.msgpack.encode(join_for("kv-insider-2"))))  # the box in clear
            msg = await raw.recv()
            assert is_reject(msg, "frame") and "the join failed decryption" in msg.message, msg  # type: ignore[union-attr]
            assert await raw.closed_by_peer()
            await raw.aclose()

        await expect_refusal(svc, decode, "auth", lambda: with_key(wrong))
        await expect_refusal(svc, decode, "frame", clear_join)
        await expect_refusal(svc, decode, "auth", lambda: with_key(None))
        await expect_refusal(svc, decode, "auth", replay)
        await expect_refusal(svc, decode, "frame", tampered)
        assert svc.status()["peers"] == [decode.address]


async def test_decodes_without_the_key_receive_no_byte(keys: dict[str, str]) -> None:
    """A decode with no key (``allow_unauthenticated``) and one with a wrong key expect the
    very ids the prefill sends: neither gets a byte (their pages stay zero), the prefill's
    requests time out at bootstrap and it stays up; then the keyed decode gets the same ids
    byte-exact."""
    cfg = hostile_config(auth_key_file=keys["cluster"], bootstrap_timeout_s=2.0)
    async with (
        peers(peer_config(allow_unauthenticated=True), peer_config(auth_key_file=keys["wrong"]),
              peer_config(auth_key_file=keys["cluster"])) as (nokey, wrongkey, keyed),
        TransferService(cfg) as svc,
    ):
        pages = [10, 11, 12, 13]
        for thief in (nokey, wrongkey):
            await thief.command(op="expect", rid="secret-a", pages=pages, sender=svc.address)
            arrived = await thief.event("arrived", "secret-a")
            assert arrived["status"] == "FAILED" and arrived["reason"] == FailureReason.REFUSED.value, arrived
            assert "auth" in arrived["message"] or "authenticat" in arrived["message"], arrived
            await thief.command(op="untouched", pages=pages)
            assert (await thief.event("untouched"))["ok"] is True
        svc.kv.write(pages, pattern(SMALL, "secret-a", len(pages)))
        handle = await svc.send("secret-a", pages, last=True)
        result = await svc.await_completion(handle, timeout=15)
        assert not result.ok and result.reason is FailureReason.TIMEOUT, result
        assert svc.status()["peers"] == []
        assert svc.status()["refused"].get("auth", 0) >= 2

        svc.kv.write(pages, pattern(SMALL, "secret-b", len(pages)))
        await keyed.command(op="expect", rid="secret-b", pages=pages, sender=svc.address)
        await keyed.event("expecting", "secret-b")
        result = await svc.await_completion(await svc.send("secret-b", pages, last=True), timeout=15)
        assert result.ok, result
        assert (await keyed.event("arrived", "secret-b"))["verified"] is True
        for thief in (nokey, wrongkey):
            await thief.command(op="untouched", pages=pages)
            assert (await thief.event("untouched"))["ok"] is True


# -- floods ---------------------------------------------------------------------------------------


async def test_idle_and_trickling_connections_are_bounded_and_time_out() -> None:
    """300 idle connections and one that sends its header a byte at a time, all from one
    address: beyond its share of the handshake slots (``max_handshakes_per_source``) they
    are refused at once, the rest closed at ``connect_timeout_s``; a new peer connects
    normally afterwards."""
    async with TransferService(hostile_config(max_handshakes=64)) as svc:
        trickle = await Raw.connect(svc.address)
        idle = [await Raw.connect(svc.address) for _ in range(300)]

        async def drip() -> None:
            """A valid header, one byte every 0.4 s: the handshake's deadline cuts it off."""
            try:
                for byte in struct.pack(">I", 40):
                    await trickle.send_raw(bytes([byte]))
                    await anyio.sleep(0.4)
            except (anyio.BrokenResourceError, OSError):
                pass

        with structlog.testing.capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                tg.start_soon(drip)
            await eventually(lambda: refused(svc, "handshake_source_limit") + refused(svc, "handshake_timeout") >= 301,
                             WAIT_S, 0.05, what="the idle and trickling connections refused or timed out")
        timeouts = [e for e in logs if e["event"] == "peer.handshake_failed" and e["kind"] == "handshake_timeout"]
        assert timeouts and timeouts[0]["error"] == "the handshake did not complete within connect_timeout_s", timeouts
        assert refused(svc, "handshake_source_limit") >= 300 - svc.config.max_handshakes_per_source
        assert refused(svc, "handshake_timeout") >= 1
        for raw in [*idle, trickle]:
            assert await raw.closed_by_peer(timeout=5)
            await raw.aclose()
        async with peers(peer_config()) as (decode,):
            await legit_transfer(svc, decode)


@asynccontextmanager
async def nixl_agent(name: str) -> AsyncIterator[dict[str, Any]]:
    """A real NIXL agent ``name`` with a registered pool: the Join a raw client sends for it."""
    thread = DoorThread("hostile-nixl")
    door = await thread.call(functools.partial(NixlDoor, name, progress_thread=False, ucx_env=LOOPBACK_UCX))
    pool = await thread.call(KVPool, SMALL)
    try:
        await thread.call(register_pool, door, pool)
        yield join_for(name, metadata=await thread.call(door.metadata), memory=wire_memory(base=pool.base_addr))
    finally:
        await thread.call(door.close)
        thread.shutdown()


async def test_an_agent_linking_again_replaces_its_dead_link_and_never_a_live_one() -> None:
    """An agent whose old link died without its close reaching the service (a network cut
    between them) links again: the service waits for the old link to end by its own rule
    (silent ``peer_timeout_s``) and admits the new one; while the old link is heard from,
    a second link for the same agent is refused (``agent_live``)."""
    cfg = hostile_config(connect_timeout_s=scaled(6.0))  # room for the old link's peer_timeout_s
    async with (nixl_agent("kv-again") as join, peers(peer_config()) as (decode,),
                TransferService(cfg) as svc):
        await legit_transfer(svc, decode)
        first = await authenticate(svc.address, key=own_key(), agent="kv-again", my_address="127.0.0.1:4")
        await first.send(join)
        assert isinstance(await first.recv(), Join)
        await first.send(Ping())  # heard once, then silent and never closed: a cut link
        live = refused(svc, "agent_live")

        again = await authenticate(svc.address, key=own_key(), agent="kv-again", my_address="127.0.0.1:4")
        await again.send(join)
        assert isinstance(await again.recv(timeout=WAIT_S), Join)  # admitted once the old link ended
        assert await first.closed_by_peer()
        assert refused(svc, "agent_live") == live
        assert sorted(svc.status()["peers"]) == sorted([decode.address, "127.0.0.1:4"])

        async def heartbeat() -> None:  # the new link is live: it is heard from
            for _ in range(int(WAIT_S / 0.05)):
                await again.send(Ping())
                await anyio.sleep(0.05)

        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat)
            third = await authenticate(svc.address, key=own_key(), agent="kv-again", my_address="127.0.0.1:4")
            await third.send(join)
            await answered(third, "agent_live")
            tg.cancel_scope.cancel()
        assert refused(svc, "agent_live") == live + 1
        assert "127.0.0.1:4" in svc.status()["peers"]  # the live link stayed
        await again.aclose()
        await first.aclose()
        await legit_transfer(svc, decode)


async def test_a_peer_that_never_reads_is_dropped_not_buffered() -> None:
    """A key holder with a real NIXL agent floods Expects the service must answer
    (pages out of range) and never reads: its link is dropped as lost once the
    service's writes stall, counted; the legitimate decode goes on."""
    async with nixl_agent("kv-silent") as join:
        cfg = hostile_config(max_outbox_bytes=256 * 1024)
        async with peers(peer_config()) as (decode,), TransferService(cfg) as svc:
            await legit_transfer(svc, decode)
            raw = await authenticate(svc.address, key=own_key(), agent="kv-silent", my_address="127.0.0.1:3",
                                     rcvbuf=4096)
            await raw.send(join)
            assert isinstance(await raw.recv(), Join)  # the service's Join; from here on it never reads
            before = refused(svc, "outbox_overflow")
            with anyio.move_on_after(20):
                for i in range(100_000):
                    if refused(svc, "outbox_overflow") > before:
                        break
                    await raw.send(Expect(f"flood-{i}", [SMALL.num_pages + 1]))
                    if i % 50 == 0:
                        await raw.send(Ping())
            assert refused(svc, "outbox_overflow") > before
            await eventually(lambda: "127.0.0.1:3" not in svc.status()["peers"], WAIT_S, 0.02,
                             what="the peer that never reads dropped")
            await raw.aclose()
            await legit_transfer(svc, decode)
            assert svc.status()["peers"] == [decode.address]


_CONNECTOR = """
import socket, sys, time
conns = [socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) for _ in range(int(sys.argv[3]))]
print("connected", flush=True)
time.sleep(30)
"""


async def test_accept_errors_back_off_and_the_service_goes_on() -> None:
    """The service runs out of file descriptors while another process opens 40
    connections: ``accept()`` fails with EMFILE, which is counted and backed off from
    (anyio's own ``serve()`` would end the service); with descriptors back, the same
    service serves a legitimate transfer."""
    async with peers(peer_config()) as (decode,), TransferService(hostile_config(max_handshakes=1000)) as svc:
        await legit_transfer(svc, decode)
        host, port = svc.address.rsplit(":", 1)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        used = len(os.listdir("/proc/self/fd"))
        async with await anyio.open_process([sys.executable, "-c", _CONNECTOR, host, port, "40"]) as proc:
            resource.setrlimit(resource.RLIMIT_NOFILE, (used + 6, hard))
            try:
                await eventually(lambda: refused(svc, "accept_error") >= 3, WAIT_S, 0.05,
                                 what="3 accept errors counted")
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            proc.kill()
        await legit_transfer(svc, decode)
        errors = refused(svc, "accept_error")
        await anyio.sleep(0.5)
        assert refused(svc, "accept_error") == errors  # descriptors are back: no more errors
        assert svc.status()["peers"] == [decode.address]
