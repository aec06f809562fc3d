"""Property tests: random bytes, random Hellos and Joins, and random sequences of
valid messages at the wrong time, against a real prefill service (real NIXL).

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

from kvservice import TransferService
from kvservice._addresses import split_address
from kvservice._door import DoorThread
from kvservice._nixl import NixlDoor
from kvservice._peerproc import pattern
from kvservice._protocol import PROTOCOL_VERSION, frame
from kvservice.memory._pool import KVPool
from tests.helpers import LOOPBACK_UCX, SMALL, config, register_pool
from tests.hostile import REGION_FIELDS, wire_memory

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
ROGUE = "kv-rogue"


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
    result = await svc.await_completion(await svc.send(rid, src, last=True), timeout=10)
    assert result.ok, result
    arrived = await decode.await_arrival(rid, timeout=10)
    assert arrived.ok, arrived
    assert torch.equal(decode.kv.pages(dst), data)


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    # Keyless on purpose: the sequences are written blind (they never read the service's
    # nonce), so they cannot carry a proof; the key itself is tested in test_hostile_peers.
    cfg = config(connect_timeout_s=1.0, heartbeat_interval_s=0.1, peer_timeout_s=1.0, allow_unauthenticated=True)
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
    exchange(target.address, [*handshake("kv-joiner"), msg(type="join", **fields)])
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
    st.builds(lambda fields: msg(type="join", **fields), join_fields),
    st.builds(lambda text: msg(type="reject", message=text), st.text(max_size=20)),
    st.binary(max_size=50),
)


@SETTINGS
@given(sequence=st.lists(message, max_size=8))
def test_valid_messages_at_the_wrong_time(target: Target, sequence: list[bytes]) -> None:
    """A linked peer (a real NIXL agent) that then sends anything in any order; and
    the same sequences before any handshake."""
    exchange(target.address, sequence)  # before a Hello
    join = msg(type="join", metadata=target.rogue_metadata, memory=wire_memory(base=target.rogue_base))
    hello = [msg(type="hello", version=PROTOCOL_VERSION, agent=ROGUE, address="127.0.0.1:8", nonce=b"n" * 32),
             msg(type="proof", proof=b""), join]
    exchange(target.address, [*hello, *sequence])
    target.legit_transfer()
    for _ in range(200):  # the rogue's link is dropped once it closed (bounded wait)
        if "127.0.0.1:8" not in target.peers():
            break
        target.portal.call(functools.partial(_sleep, 0.01))
    assert "127.0.0.1:8" not in target.peers()


async def _sleep(seconds: float) -> None:
    await anyio.sleep(seconds)
