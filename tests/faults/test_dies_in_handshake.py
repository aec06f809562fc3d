"""A peer that dies between its Join and the service loading its NIXL agent.

NIXL's load connects to the peer's UCX listener at once.  Where that connect is refused on
the spot (the dead peer's host is this one, or a namespace of it), UCX never closes the
socket it made: one file held for as long as the service's agent lives, per such load.  The
long soak, killing decodes every few seconds, lost one file to it every minute or so.  The
service asks the kernel whether the peer's link is still there just before the load
(``ControlStream.hung_up``) and refuses a peer that hung up, loading nothing.

Real NIXL: the peer's agent is made in a child process that is SIGKILLed after handing over
its metadata; a raw client sends that metadata in its Join and closes the connection."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from kvservice import TransferService
from kvservice.testing.inspect import inside
from tests.faults.test_hostile_peers import hostile_config, legit_transfer, refused
from tests.helpers import eventually, peer_config, peers
from tests.hostile import authenticate, join_for, own_key, wire_memory

pytestmark = pytest.mark.nixl

#: a hang guard (the child boots Python, torch and NIXL), never a timed assertion
BOOT_S = 120.0
#: loopback addresses of their own for the raw clients, one each: the vetting child's strike
#: for a dead agent's metadata (NIXL's load fails there too) lands on it, not on the decode's
SOURCES = [f"127.0.0.{30 + i}" for i in range(8)]
#: peers that die in the handshake after the first (which warms whatever the path opens once)
DEATHS = 3

ROOT = Path(__file__).resolve().parents[2]  # the repository: the child imports kvservice and tests

_AGENT = """
import sys
from kvservice._nixl.agent import NixlDoor
from kvservice.memory._pool import KVPool
from tests.helpers import LOOPBACK_UCX, SMALL, register_pool

door = NixlDoor(sys.argv[1], progress_thread=False, ucx_env=LOOPBACK_UCX)
pool = KVPool(SMALL)
register_pool(door, pool)
print(pool.base_addr, door.metadata().hex(), flush=True)
sys.stdin.read()  # until SIGKILLed
"""


async def dead_agent(name: str) -> tuple[bytes, int]:
    """The metadata and pool address of a real NIXL agent ``name`` whose process is dead
    (SIGKILLed once it handed them over): its UCX listener's port refuses connections."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with anyio.fail_after(BOOT_S):
        async with await anyio.open_process([sys.executable, "-c", _AGENT, name], env=env,
                                            stdin=subprocess.PIPE, stderr=None) as proc:
            assert proc.stdout is not None
            line = b""
            async for chunk in proc.stdout:
                line += chunk
                if line.endswith(b"\n"):
                    break
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
    base, metadata = line.split()
    return bytes.fromhex(metadata.decode()), int(base)


async def join_and_die(svc: TransferService, agent: str, source: str) -> None:
    """Authenticate from ``source``, send a Join carrying a dead agent's metadata, close at once."""
    metadata, base = await dead_agent(agent)
    raw = await authenticate(svc.address, key=own_key(), agent=agent, my_address=f"{source}:9", source=source)
    await raw.send(join_for(agent, metadata=metadata, memory=wire_memory(base=base)))
    await raw.stream.aclose()


def open_sockets() -> set[str]:
    """This process's open sockets (``socket:[inode]``): what a load of a dead agent leaks.
    Only sockets: this runs in a test worker whose other open files (a pipe, a log) may come
    and go with other tests' leftovers."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing (the listing's own descriptor among them)
            continue
        if target.startswith("socket:"):
            out.add(target)
    return out


async def test_a_peer_dead_before_its_load_is_refused_and_costs_the_service_no_socket() -> None:
    async with peers(peer_config()) as (decode,), TransferService(hostile_config()) as svc:
        await legit_transfer(svc, decode)
        await join_and_die(svc, "kv-dies-0", SOURCES[0])
        await eventually(lambda: refused(svc, "handshake_incomplete") == 1, timeout=30,
                         what=lambda: f"refused {svc.status()['refused']}")
        before = open_sockets()
        for i in range(1, 1 + DEATHS):
            await join_and_die(svc, f"kv-dies-{i}", SOURCES[i])
        await eventually(lambda: refused(svc, "handshake_incomplete") == 1 + DEATHS, timeout=30,
                         what=lambda: f"refused {svc.status()['refused']}")
        assert refused(svc, "nixl_refused") == 0  # NIXL was never asked to load a dead agent
        held = inside(svc).agents_remembered()
        assert not {a for a in held if a.startswith("kv-dies-")}, held
        # The vetting child that failed to load the dead agents is replaced (its sockets go
        # with it); nothing of the service's own stays open for them.
        await eventually(lambda: len(open_sockets()) <= len(before), timeout=30,
                         what=lambda: f"{len(open_sockets())} sockets open, {len(before)} before; "
                                      f"new: {sorted(open_sockets() - before)}")
        await legit_transfer(svc, decode)  # up, and byte-exact
