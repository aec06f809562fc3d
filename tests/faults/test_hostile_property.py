"""Property tests: random bytes, random Hellos and Joins, random sequences of valid
messages at the wrong time, forged NIXL notifications and claimed addresses, against a
real prefill service (real NIXL).

After every example the service is up and a legitimate request passes
byte-exact to a real decode service.  The two services run on an event loop in
a thread (anyio's blocking portal) for the whole module, so hypothesis drives
plain sockets from the test thread and shrinks failures as usual.
"""

from __future__ import annotations

import functools
import itertools
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import pytest
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvservice import KVPoll, TransferService
from kvservice._control.addresses import split_address
from kvservice._control.protocol import NOTIF_MAGIC, PROTOCOL_VERSION, ChunkNotif, encode_notif, frame
from kvservice._nixl.agent import NixlDoor
from kvservice._nixl.door import DoorThread
from kvservice.memory._pool import KVPool
from kvservice.testing import pattern
from kvservice.testing.inspect import inside
from tests.helpers import LOOPBACK_UCX, SMALL, config, eventually_sync, register_pool, scaled
from tests.hostile import REGION_FIELDS, wire_memory

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
ROGUE = "kv-rogue"
WAIT_S = 60.0  # a hang guard for each wait, never a timed assertion


@dataclass
class Target:
    portal: BlockingPortal
    svc: TransferService
    decode: TransferService
    rogue_metadata: bytes
    rogue_base: int
    rids: Iterator[int]

    @property
    def address(self) -> tuple[str, int]:
        return split_address(self.svc.address)

    def legit_transfer(self) -> None:
        self.portal.call(functools.partial(_transfer, self.svc, self.decode, f"legit-{next(self.rids)}"))

    def peers(self) -> list[str]:
        return self.portal.call(lambda: _status(self.svc))["peers"]  # type: ignore[no-any-return]


async def _status(svc: TransferService) -> dict[str, Any]:
    return svc.status()


async def _transfer(svc: TransferService, decode: TransferService, rid: str) -> None:
    src, dst = [1, 2], [50, 51]
    data = pattern(SMALL, rid, len(src))
    svc.kv.write(src, data)
    await decode.expect(rid, dst, sender=svc.address)
    result = await svc.await_completion(await svc.send(rid, src, last=True), timeout=WAIT_S)
    assert result.ok, result
    arrived = await decode.await_arrival(rid, timeout=WAIT_S)
    assert arrived.ok, arrived
    assert torch.equal(decode.kv.pages(dst), data)


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    # Keyless on purpose: the sequences are written blind (they never read the service's
    # nonce), so they cannot carry a proof; the key itself is tested in test_hostile_peers.
    # short timeouts (a rogue's stalled handshake or silent link ends soon), as long as this
    # machine needs for the legitimate pair to meet them
    cfg = config(connect_timeout_s=scaled(1.0), heartbeat_interval_s=0.1, peer_timeout_s=scaled(1.0),
                 allow_unauthenticated=True)
    thread = DoorThread("rogue-nixl")
    door = thread.call_sync(functools.partial(NixlDoor, ROGUE, progress_thread=False, ucx_env=LOOPBACK_UCX))
    pool = thread.call_sync(KVPool, SMALL)
    try:
        thread.call_sync(register_pool, door, pool)
        metadata = thread.call_sync(door.metadata)
        with (
            start_blocking_portal() as portal,
            portal.wrap_async_context_manager(TransferService(cfg)) as svc,
            portal.wrap_async_context_manager(TransferService(cfg)) as decode,
        ):
            yield Target(portal, svc, decode, metadata, pool.base_addr, itertools.count())
    finally:
        thread.call_sync(door.close)
        thread.shutdown()


def exchange(address: tuple[str, int], data: list[bytes], *, read: bool = True) -> bytes:
    """Send ``data``, half-close, and read what comes back until the service closes."""
    got = b""
    with socket.create_connection(address, timeout=3) as s:
        try:
            for chunk in data:
                s.sendall(chunk)
            s.shutdown(socket.SHUT_WR)
            while read:
                more = s.recv(65536)
                if not more:
                    break
                got += more
        except OSError:  # reset, broken pipe, not connected, timeout: the service hung up first
            pass
    return got


def msg(**fields: Any) -> bytes:
    return frame(msgspec.msgpack.encode(fields))


def join_msg(**fields: Any) -> bytes:
    """A Join as an unkeyed dialer sends it: its encoding inside ``Sealed``."""
    return msg(type="sealed", box=msgspec.msgpack.encode({"type": "join", **fields}))


any_value = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=40) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


@SETTINGS
@given(chunks=st.lists(st.binary(max_size=300), min_size=1, max_size=4))
def test_random_bytes(target: Target, chunks: list[bytes]) -> None:
    exchange(target.address, chunks)
    target.legit_transfer()


@SETTINGS
@given(
    header=st.none() | st.integers(min_value=0, max_value=2**32 - 1),
    fields=st.fixed_dictionaries({}, optional={
        "version": st.sampled_from([PROTOCOL_VERSION]) | any_value,
        "agent": st.text(max_size=140) | any_value,
        "address": st.text(max_size=280) | st.sampled_from(["127.0.0.1:9", "0.0.0.0:1", "[::1]:5", "h:0"]),
        "nonce": st.binary(min_size=32, max_size=32) | any_value,
        "proof": st.binary(max_size=40) | any_value,
    }),
)
def test_random_hellos(target: Target, header: int | None, fields: dict[str, Any]) -> None:
    body = msgspec.msgpack.encode({"type": "hello", **fields})
    data = body if header is None else struct.pack(">I", header) + body
    exchange(target.address, [frame(body) if header is None else data])
    target.legit_transfer()


any_int = st.integers(min_value=-(2**63), max_value=2**64 - 1)
region_row = st.lists(any_int | st.sampled_from(["k", "v", "latent", "NHD", "HND", "bfloat16"]) | any_value,
                      min_size=0, max_size=11)
memory_fields = st.fixed_dictionaries({}, optional={
    "num_pages": any_int | any_value,
    "regions": st.lists(region_row, max_size=6) | any_value,
    "mem_type": st.sampled_from(["DRAM", "VRAM", "FILE"]) | any_value,
    "tp_size": any_int | any_value,
    "tp_rank": any_int | any_value,
})
#: a valid pool description with one region field replaced
one_field_off = st.builds(
    lambda key, value: wire_memory(region={key: value}),
    st.sampled_from(REGION_FIELDS), any_int | st.text(max_size=8) | any_value)
join_fields = st.fixed_dictionaries({}, optional={
    "metadata": st.binary(max_size=64) | st.just(b"fake") | any_value,
    "memory": memory_fields | one_field_off | any_value,
})


def handshake(agent: str) -> list[bytes]:
    """An unkeyed dialer's Hello and (empty) proof: enough to reach the Join of a keyless service."""
    return [msg(type="hello", version=PROTOCOL_VERSION, agent=agent, address="127.0.0.1:7", nonce=b"n" * 32),
            msg(type="proof", proof=b"")]


@SETTINGS
@given(fields=join_fields)
def test_random_joins(target: Target, fields: dict[str, Any]) -> None:
    exchange(target.address, [*handshake("kv-joiner"), join_msg(**fields)])
    target.legit_transfer()
    assert "127.0.0.1:7" not in target.peers()


message = st.one_of(
    st.builds(lambda rid, pages: msg(type="expect", request_id=rid, pages=pages),
              st.text(max_size=20), st.lists(st.integers(min_value=-3, max_value=SMALL.num_pages + 3), max_size=6)),
    st.builds(lambda rid, why: msg(type="abort", request_id=rid, reason=why, message="x"),
              st.sampled_from(["legit-0", "r", ""]) | st.text(max_size=8), st.text(max_size=12)),
    st.builds(lambda rid, why: msg(type="failed", request_id=rid, reason=why),
              st.sampled_from(["legit-1", "r"]) | st.text(max_size=8), st.text(max_size=12)),
    st.just(msg(type="ping")),
    st.just(msg(type="bye")),
    st.just(msg(type="hello", version=PROTOCOL_VERSION, agent=ROGUE, address="127.0.0.1:8", nonce=b"n" * 32)),
    st.just(msg(type="proof", proof=b"")),
    st.builds(lambda fields: join_msg(**fields), join_fields),
    st.builds(lambda box: msg(type="sealed", box=box), st.binary(max_size=40)),
    st.builds(lambda text: msg(type="reject", message=text), st.text(max_size=20)),
    st.binary(max_size=50),
)


@SETTINGS
@given(sequence=st.lists(message, max_size=8))
def test_valid_messages_at_the_wrong_time(target: Target, sequence: list[bytes]) -> None:
    """A linked peer (a real NIXL agent) that then sends anything in any order; and
    the same sequences before any handshake."""
    exchange(target.address, sequence)  # before a Hello
    hello = rogue_handshake(target, "127.0.0.1:8")
    exchange(target.address, [*hello, *sequence])
    target.legit_transfer()
    eventually_sync(lambda: "127.0.0.1:8" not in target.peers(), WAIT_S, 0.01,
                    what="the rogue's link dropped once it closed")


async def _sleep(seconds: float) -> None:
    await anyio.sleep(seconds)


def rogue_handshake(target: Target, claim: str) -> list[bytes]:
    """The rogue's Hello (claiming ``claim`` as its address), proof and Join: a real NIXL agent."""
    join = join_msg(metadata=target.rogue_metadata, memory=wire_memory(base=target.rogue_base))
    return [msg(type="hello", version=PROTOCOL_VERSION, agent=ROGUE, address=claim, nonce=b"n" * 32),
            msg(type="proof", proof=b""), join]


def _rogue_gone(target: Target) -> None:
    for _ in range(300):  # bounded: the rogue's link is dropped once it closed
        if not any(p not in (target.decode.address,) for p in target.peers()):
            return
        target.portal.call(functools.partial(_sleep, 0.01))


# -- claimed addresses -------------------------------------------------------------------------


@settings(SETTINGS, max_examples=40)
@given(claim=st.sampled_from(["decode", "prefill", "127.0.0.1:1", "localhost:{decode_port}"])
       | st.builds(lambda port: f"127.0.0.1:{port}", st.integers(min_value=1, max_value=65535)))
def test_a_claimed_address_takes_no_pinned_request(target: Target, claim: str) -> None:
    """A linked peer (a real NIXL agent) claiming any address, the pinned decode's
    included, expects a request the prefill pinned to that decode: the request still
    goes to the decode, byte-exact, and nowhere else."""
    decode_port = split_address(target.decode.address)[1]
    claim = {"decode": target.decode.address, "prefill": target.svc.address}.get(
        claim, claim.replace("{decode_port}", str(decode_port)))
    rid = f"pinned-{next(target.rids)}"
    handle = target.portal.call(functools.partial(_send_pinned, target, rid))
    exchange(target.address, [*rogue_handshake(target, claim),
                              msg(type="expect", request_id=rid, pages=[7, 8])])
    target.portal.call(functools.partial(_receive, target, rid, handle))
    _rogue_gone(target)


async def _send_pinned(target: Target, rid: str) -> Any:
    target.svc.kv.write([1, 2], pattern(SMALL, rid, 2))
    return await target.svc.send(rid, [1, 2], last=True, receiver=target.decode.address)


async def _receive(target: Target, rid: str, handle: Any) -> None:
    await target.decode.expect(rid, [50, 51], sender=target.svc.address)
    sent = await target.svc.await_completion(handle, timeout=WAIT_S)
    assert sent.ok, sent
    arrived = await target.decode.await_arrival(rid, timeout=WAIT_S)
    assert arrived.ok, arrived
    assert torch.equal(target.decode.kv.pages([50, 51]), pattern(SMALL, rid, 2))


# -- forged notifications ------------------------------------------------------------------------


@dataclass
class Forger:
    """A NIXL agent named like the prefill, holding the decode's metadata."""

    thread: DoorThread
    door: NixlDoor

    def send(self, peer: str, notifs: list[bytes]) -> None:
        for n in notifs:
            self.thread.call_sync(self.door.send_notif, peer, n)
        self.progress()

    def progress(self) -> None:
        """UCX sends asynchronously: progress the forger's worker."""
        self.thread.call_sync(self.door.notifs)


@pytest.fixture(scope="module")
def forger(target: Target) -> Iterator[Forger]:
    thread = DoorThread("forger-nixl")
    door = thread.call_sync(functools.partial(NixlDoor, target.svc.agent_name, progress_thread=False,
                                              ucx_env=LOOPBACK_UCX))
    try:
        thread.call_sync(door._agent.add_remote_agent, inside(target.decode).metadata)
        target.portal.call(functools.partial(_expect_victim, target))
        yield Forger(thread, door)
    finally:
        thread.call_sync(door.close)
        thread.shutdown()


async def _expect_victim(target: Target) -> None:
    await target.decode.expect("victim", [60, 61], sender=target.svc.address, timeout=3600)


async def _victim(target: Target) -> tuple[KVPoll, int, int]:
    st_ = target.decode.status()
    return target.decode.poll_arrival("victim"), st_["refused"].get("notif_forged", 0), st_["unsettled_pages"]


forged_notif = st.one_of(
    st.builds(lambda rid, chunk, total, payload, key: encode_notif(ChunkNotif(rid, chunk, total, payload), key),
              st.just("victim") | st.text(max_size=8), st.integers(min_value=-2, max_value=4),
              st.integers(min_value=0, max_value=4), st.none() | st.binary(max_size=64),
              st.binary(max_size=40)),
    st.builds(lambda body: NOTIF_MAGIC + body, st.binary(max_size=80)),
    st.builds(lambda rid, total: b"kv1" + msgspec.msgpack.encode([rid, 0, total, b"FORGED"]),
              st.just("victim"), st.integers(min_value=0, max_value=2)),
    st.binary(min_size=1, max_size=80),
)


@settings(SETTINGS, max_examples=60)
@given(notifs=st.lists(forged_notif, min_size=1, max_size=4))
def test_forged_notifications_complete_and_settle_nothing(target: Target, forger: Forger,
                                                          notifs: list[bytes]) -> None:
    """Notifications under the prefill's name, sealed under any other key, or in any
    other shape: the decode's pending request from that prefill neither completes nor
    fails, the forged ones of ours are counted, and transfers go on."""
    before = target.portal.call(functools.partial(_victim, target))[1]
    forger.send(target.decode.agent_name, notifs)
    ours = sum(n.startswith(NOTIF_MAGIC) for n in notifs)
    deadline = time.monotonic() + WAIT_S
    while True:  # bounded: until every forged one of ours is counted
        state, forged, unsettled = target.portal.call(functools.partial(_victim, target))
        if forged >= before + ours or time.monotonic() > deadline:
            break
        forger.progress()  # the first one waits for UCX's wire-up
        target.portal.call(functools.partial(_sleep, 0.01))
    assert state is KVPoll.WaitingForInput
    assert forged == before + ours and unsettled == 0
    target.legit_transfer()
