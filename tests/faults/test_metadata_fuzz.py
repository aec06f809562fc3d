"""Peers' NIXL metadata that could abort the process is never loaded.

A real agent's metadata (a live NIXL agent in this process, with a registered
pool) is mutated and sent through a real handshake (``tests.hostile``: the
keyless loopback path, up to a ``Join``) to a real decode process.  UCX unpacks
a worker address with assertions: before vetting, the worker-address version
byte altered ended the decode with SIGABRT inside ``add_remote_agent``.  After
every case here the decode is alive, a refusal was counted (or the mutation was
harmless and NIXL loaded it), and a legitimate request passes byte-exact.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import struct
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from kvservice import FailureReason, TransferService
from kvservice._control.protocol import Join, Message, Reject
from kvservice._nixl.agent import NixlDoor
from kvservice._nixl.door import DoorThread
from kvservice.memory._pool import KVPool
from kvservice.testing import PeerProcess
from kvservice.testing.inspect import inside
from tests.faults.test_hostile_peers import legit_transfer
from tests.helpers import LOOPBACK_UCX, SMALL, config, eventually, peer_config, peers, register_pool
from tests.hostile import authenticate, join_for, own_key, wire_memory

pytestmark = pytest.mark.nixl

_rids = itertools.count()
_ports = itertools.count(21000)
#: the fuzz stops starting cases after this long (a bound, not an assertion on speed)
FUZZ_BUDGET_S = 40.0
FUZZ_SEED = 20261130


def donor_name(i: int) -> str:
    return f"kv-fuzz-donor-{i:06d}"  # one length for every i: renaming keeps the layout


#: the donor's pool as a Join describes it (set with the donor: a harmless mutation then loads)
MEMORY: dict[str, Any] = {}


@asynccontextmanager
async def donor() -> AsyncIterator[bytes]:
    """A live NIXL agent with a registered pool, kept alive (its UCX worker must accept
    the endpoints a trial load creates); yields its real metadata."""
    thread = DoorThread("fuzz-donor")  # a door is used from the thread that made it
    pool = KVPool(SMALL)

    def make() -> NixlDoor:
        door = NixlDoor(donor_name(0), progress_thread=False, ucx_env=LOOPBACK_UCX)
        register_pool(door, pool)
        return door

    try:
        door = await thread.call(make)
        try:
            MEMORY.update(wire_memory(SMALL, base=pool.base_addr))
            yield await thread.call(door.metadata)
        finally:
            MEMORY.clear()
            await thread.call(door.close)
    finally:
        thread.shutdown()


def renamed(md: bytes, i: int) -> bytes:
    """``md`` under another agent name of the same length (each case is a new agent)."""
    return md.replace(donor_name(0).encode(), donor_name(i).encode(), 1)


def ucx_address_span(md: bytes) -> tuple[int, int]:
    """Where the UCX worker address lies in NIXL metadata (found here, not with the code under test)."""
    tag = b"t" + struct.pack("<Q", 3) + b"UCX|c"
    at = md.index(tag) + len(tag)
    (n,) = struct.unpack_from("<Q", md, at)
    return at + 8, n


def rkey_span(md: bytes) -> tuple[int, int]:
    """Where the first descriptor's remote key lies (after its 24-byte address, length, device)."""
    tag = b"n" + struct.pack("<Q", 8)
    at = md.index(tag) + len(tag) + 8 + 1  # the count, its separator
    (n,) = struct.unpack_from("<Q", md, at)
    return at + 8 + 24, n - 24


#: where the forged Joins come from: a source of their own (vetting charges a source whose metadata
#: cost a child, and the legitimate peers here link from 127.0.0.1)
ATTACKER = "127.0.0.2"


async def present(address: str, agent: str, metadata: bytes) -> Message | None:
    """A peer claiming ``agent`` joins with ``metadata`` from ``ATTACKER``; the answer (a Join
    when it loaded)."""
    raw = await authenticate(address, key=own_key(), agent=agent, my_address=f"127.0.0.1:{next(_ports)}",
                             source=ATTACKER)
    try:
        await raw.send(join_for(agent, metadata=metadata, memory=MEMORY or None))
        return await raw.recv()
    finally:
        await raw.aclose()


async def refused(decode: PeerProcess) -> dict[str, int]:
    rid = f"status-{next(_rids)}"
    await decode.command(op="status", id=rid)
    status = await decode.wait_for(lambda e: e["event"] == "status" and e.get("id") == rid, timeout=10)
    return dict(status["refused"])


async def alive(decode: PeerProcess, *, wait: bool) -> None:
    """The decode process is alive (``wait``: it answered nothing, give it a moment to exit)."""
    if wait:
        with anyio.move_on_after(2):
            await decode.proc.wait()
    code = decode.proc.returncode
    assert code is None, f"the decode died: {signal.Signals(-code).name if code and code < 0 else code}"


async def survives(decode: PeerProcess, agent: str, metadata: bytes) -> str | None:
    """Present ``metadata``: the decode lives, and a refusal is counted under the Reject's kind.
    Returns that kind, or None when the mutation was harmless (NIXL loaded it)."""
    before = await refused(decode)
    answer = await present(decode.address, agent, metadata)
    await alive(decode, wait=answer is None)
    if isinstance(answer, Join):
        return None
    assert isinstance(answer, Reject), answer
    after = await refused(decode)
    assert after.get(answer.kind, 0) == before.get(answer.kind, 0) + 1, (answer, before, after)
    return answer.kind


def version_altered(md: bytes, version: int = 5) -> bytes:
    at, _ = ucx_address_span(md)
    b = bytearray(md)
    b[at] = (b[at] & 0xF0) | version  # the measured "addr version 5"
    return bytes(b)


async def test_a_worker_address_of_an_unknown_version_is_refused_and_the_decode_lives() -> None:
    """The finding: real metadata with the UCX worker address's version byte altered passed
    every check and aborted the decode (SIGABRT) in ``add_remote_agent``."""
    async with donor() as md, peers(peer_config()) as (decode,), TransferService(config()) as svc:
        answer = await present(decode.address, donor_name(1), version_altered(renamed(md, 1)))
        await alive(decode, wait=answer is None)
        assert isinstance(answer, Reject) and answer.kind == "metadata_unsafe", answer
        assert "version 5" in answer.message
        assert (await refused(decode)).get("metadata_unsafe") == 1
        await legit_transfer(svc, decode)


def section_type_altered(md: bytes, mem_type: int) -> bytes:
    """The first memory section's type (a 4-byte ``t`` after ``nixlSDList``) set to ``mem_type``."""
    tag = b"nixlSDList|t" + struct.pack("<Q", 4)
    at = md.index(tag) + len(tag)
    return md[:at] + struct.pack("<I", mem_type) + md[at + 4:]


async def test_a_section_type_nixl_reads_out_of_bounds_never_reaches_the_vetting_child() -> None:
    """The finding: a memory section of type 5 (past NIXL's last, FILE_SEG) killed the vetting
    child; Joins with it under fresh names killed it again and again while a legitimate
    peer's first link waited for its restarts.  Refused by structure now: the child that
    started with the service is the only one, and the legitimate peer links beside it."""
    async with (donor() as md, peers(peer_config()) as (decode,),
                TransferService(config()) as svc):
        vetter = inside(svc).vetter
        await vetter.ready()
        first = vetter.pid
        for i in range(1, 8):
            answer = await present(svc.address, donor_name(i), section_type_altered(renamed(md, i), 5))
            assert isinstance(answer, Reject) and answer.kind == "metadata_unsafe", answer
            assert "memory type 5" in answer.message, answer.message
        assert svc.status()["refused"].get("metadata_unsafe") == 7
        await legit_transfer(svc, decode)
        assert vetter.children_started == 1 and vetter.pid == first


def mutations(md: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    """Targeted mutations first, then random ones; each under its own agent name."""
    a_at, a_len = ucx_address_span(md)
    r_at, r_len = rkey_span(md)
    name_at = md.index(b"Agent") + len(b"Agent")

    def put(b: bytes, at: int, value: bytes) -> bytes:
        return b[:at] + value + b[at + len(value):]

    def flip(b: bytes, at: int, bit: int) -> bytes:
        return put(b, at, bytes([b[at] ^ (1 << bit)]))

    cases: list[tuple[str, Callable[[bytes], bytes]]] = [
        ("address version 2", lambda b: version_altered(b, 2)),
        ("address version 15", lambda b: version_altered(b, 15)),
        ("address length +1", lambda b: put(b, a_at - 8, struct.pack("<Q", a_len + 1))),
        ("address length -1", lambda b: put(b, a_at - 8, struct.pack("<Q", a_len - 1))),
        ("address length 2^63", lambda b: put(b, a_at - 8, struct.pack("<Q", 1 << 63))),
        ("agent name length +1", lambda b: put(b, name_at, struct.pack("<Q", len(donor_name(0)) + 1))),
        ("agent name length 2^64-1", lambda b: put(b, name_at, struct.pack("<Q", (1 << 64) - 1))),
        ("truncated in the address", lambda b: b[: a_at + a_len // 2]),
        ("truncated in the remote key", lambda b: b[: r_at + 2]),
        ("truncated by one byte", lambda b: b[:-1]),
        ("garbage appended", lambda b: b + b"\x00garbage"),
        ("remote key MD map all ones", lambda b: put(b, r_at, b"\xff" * 8)),
        ("remote key memory type 127", lambda b: put(b, r_at + 8, b"\x7f")),
        ("remote key length -1", lambda b: put(b, r_at - 24 - 8, struct.pack("<Q", r_len + 24 - 1))),
    ]
    for _ in range(30):
        at, bit = a_at + 1 + rng.randrange(a_len - 1), rng.randrange(8)
        cases.append((f"address bit {at - a_at}.{bit} flipped", lambda b, at=at, bit=bit: flip(b, at, bit)))
    for _ in range(10):
        at, value = r_at + rng.randrange(r_len), bytes([rng.randrange(256)])
        cases.append((f"remote key byte {at - r_at} = {value[0]}", lambda b, at=at, value=value: put(b, at, value)))
    for _ in range(6):
        cut = rng.randrange(len(md))
        cases.append((f"truncated at {cut}", lambda b, cut=cut: b[:cut]))
    for _ in range(4):
        junk = rng.randbytes(rng.randrange(1, 64))
        cases.append((f"{len(junk)} random bytes appended", lambda b, junk=junk: b + junk))
    return [(what, mutate(renamed(md, i + 1))) for i, (what, mutate) in enumerate(cases)]


async def test_mutated_real_metadata_never_takes_the_decode_down() -> None:
    """Bounded: a fixed seed, 64 cases, a time budget; the targeted cases come first."""
    rng = random.Random(FUZZ_SEED)
    async with donor() as md, peers(peer_config()) as (decode,), TransferService(config()) as svc:
        await legit_transfer(svc, decode)
        outcomes: dict[str, str | None] = {}
        started = time.monotonic()
        cases = mutations(md, rng)
        for i, (what, bad) in enumerate(cases, start=1):
            if time.monotonic() - started > FUZZ_BUDGET_S:
                break
            outcomes[what] = await survives(decode, donor_name(i), bad)
        assert len(outcomes) >= 14, outcomes  # at least every targeted case ran
        for what in list(outcomes)[:14]:  # none of the targeted ones reaches NIXL
            assert outcomes[what] in ("metadata_unsafe", "metadata_mismatch"), (what, outcomes[what])
        assert list(outcomes.values()).count("metadata_unsafe") >= 10, outcomes
        await legit_transfer(svc, decode)
        await alive(decode, wait=False)


# -- the vetting child: the gate behind the parser ----------------------------------------------------


@pytest.fixture
def parser_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the vetting child stands between NIXL and the metadata: what the parser would
    refuse reaches it (in this process's services)."""
    import kvservice._trust.vetting as vetting  # here: the module collects on code without vetting

    monkeypatch.setattr(vetting, "check_metadata", lambda data: None)


@pytest.mark.usefixtures("parser_off")
async def test_metadata_that_kills_the_vetting_child_is_refused_and_the_service_serves_on() -> None:
    """The service here is this test's own process: without the child, the load would abort it."""
    async with (donor() as md, peers(peer_config()) as (decode,),
                TransferService(config(connect_timeout_s=10.0)) as svc):
        await legit_transfer(svc, decode)
        vetter = inside(svc).vetter
        assert vetter.pid is not None
        first = vetter.pid
        answer = await present(svc.address, donor_name(1), version_altered(renamed(md, 1)))
        assert isinstance(answer, Reject) and answer.kind == "metadata_unsafe", answer
        assert "SIGABRT" in answer.message, answer.message
        assert svc.status()["refused"].get("metadata_unsafe") == 1
        # the same bytes again: refused from memory, no child dies for them twice
        answer = await present(svc.address, donor_name(1), version_altered(renamed(md, 1)))
        assert isinstance(answer, Reject) and answer.kind == "metadata_unsafe", answer
        assert vetter.children_started == 2
        # a good agent's metadata from that source loads, on the child its source is vetted on now
        assert isinstance(await present(svc.address, donor_name(2), renamed(md, 2)), Join)
        assert vetter.pid not in (None, first)
        await legit_transfer(svc, decode)
        assert svc.status()["refused"].get("metadata_unsafe") == 2


async def test_a_dialer_refuses_an_acceptors_unsafe_metadata_and_tells_it() -> None:
    """The decode dials a prefill whose Join carries unsafe metadata: its expect() ends
    INCOMPATIBLE with the reason, the refusal is counted there, and the prefill hears why."""
    async with TransferService(config()) as tx, TransferService(config()) as rx:
        # the prefill lies: its own metadata, with a worker address UCX cannot unpack
        inside(tx).join_with(metadata=version_altered(inside(tx).metadata))
        await rx.expect("r1", [1, 2], sender=tx.address)
        result = await rx.await_arrival("r1", timeout=15)
        assert result.reason is FailureReason.INCOMPATIBLE, result
        assert "version 5" in result.message, result.message
        assert rx.status()["refused"].get("metadata_unsafe") == 1
        assert rx.status()["peers"] == []


# -- the child's life: one per service, reaped with it ---------------------------------------------


def gone(pid: int) -> bool:
    """``pid`` was reaped: no such process (not even a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_the_vetting_child_is_reaped_with_the_service_however_it_ends() -> None:
    # left with no peer ever linked
    async with TransferService(config()) as idle:
        await eventually(lambda: inside(idle).vetter.pid is not None)
        pid = inside(idle).vetter.pid
    assert pid is not None and gone(pid)
    async with peers(peer_config()) as (decode,):
        # left after serving a peer
        async with TransferService(config()) as svc:
            await legit_transfer(svc, decode)
            pid = inside(svc).vetter.pid
            assert pid is not None and not gone(pid)
        assert gone(pid)
        # cancelled, not left
        with anyio.CancelScope() as scope:
            async with TransferService(config()) as svc:
                await legit_transfer(svc, decode)
                pid = inside(svc).vetter.pid
                assert pid is not None
                scope.cancel()
                await anyio.sleep(5)
        assert pid is not None and gone(pid)


def vetting_children() -> set[int]:
    """This process's vetting children, live or zombie (``/proc``: parent pid and command line)."""
    import kvservice._trust.vetting as vetting

    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == os.getpid() and vetting.CHILD.encode() in cmdline:
            found.add(int(entry))
    return found


async def test_a_services_vetting_child_boots_as_it_starts() -> None:
    """The child boots (~0.3 s of CPU) from the start of the service's start, while the pool and
    the agent are made, not at a peer's first handshake (inside that peer's
    connect_timeout_s); one child, serving without a peer ever asking, reaped at the end.
    The port opens without waiting for the spawn itself (a thread's ``Popen``, which a loaded
    machine may still be in when the service is up), so the child's pid is read once it serves."""
    before = vetting_children()
    async with TransferService(config()) as svc:
        vetter = inside(svc).vetter
        assert vetter.children_started == 1, "up without a vetting child started"
        with anyio.fail_after(60):
            await vetter.ready()
        assert vetter.serving and vetter.children_started == 1
        pid = vetter.pid
        assert pid is not None and vetting_children() - before == {pid}
    assert gone(pid) and vetting_children() == before


async def test_a_failed_start_leaves_no_vetting_child() -> None:
    """A start that fails after the child was started (here: etcd unreachable) reaps it."""
    pytest.importorskip("aetcd")
    from kvservice.discovery.registry import DiscoveryUnavailable

    before = vetting_children()
    cfg = config(discovery="etcd", etcd_endpoints=["127.0.0.1:9"], etcd_connect_timeout_s=0.5,
                 discovery_name="decode-0", discovery_role="decode")
    with pytest.raises(DiscoveryUnavailable):
        async with TransferService(cfg):
            pytest.fail("started without etcd")
    assert vetting_children() == before


async def test_a_sidecar_daemon_refuses_it_too() -> None:
    """``kvservice serve`` runs the same service: the finding's metadata is refused, counted in
    its metrics, and the daemon serves on."""
    from tests.sidecar.daemons import metrics, sidecars

    async with donor() as md:
        with sidecars("decode") as (daemon,):
            answer = await present(daemon.address, donor_name(1), version_altered(renamed(md, 1)))
            assert isinstance(answer, Reject) and answer.kind == "metadata_unsafe", answer
            assert daemon.proc is not None and daemon.proc.poll() is None
            got = await metrics(daemon.http)
            assert got['kvservice_refused_total{where="service",kind="metadata_unsafe"}'] == 1
            # and a harmless agent's metadata still loads there
            assert isinstance(await present(daemon.address, donor_name(2), renamed(md, 2)), Join)


async def test_without_a_vetting_child_nobody_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that cannot start (here: its file is missing) leaves the service refusing
    every peer (``vetting_unavailable``) rather than loading unvetted metadata."""
    import kvservice._trust.vetting as vetting

    monkeypatch.setattr(vetting, "CHILD", vetting.CHILD.replace("vetchild.py", "no_such_file.py"))
    async with peers(peer_config()) as (decode,), TransferService(config()) as svc:
        rid = f"refused-{next(_rids)}"
        await decode.command(op="expect", rid=rid, pages=[1, 2], sender=svc.address)
        arrived = await decode.event("arrived", rid)
        assert arrived["reason"] == "INCOMPATIBLE" and "cannot vet" in arrived["message"], arrived
        assert svc.status()["refused"].get("vetting_unavailable") == 1
        assert svc.status()["peers"] == []
