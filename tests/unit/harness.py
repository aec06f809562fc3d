"""Two ``TransferService``s in one process over a ``FakeFabric``: the unit-test harness.

Services are entered inside test bodies (``async with two_services(...)``),
never held by a fixture across ``yield``.  The control plane is real loopback
TCP; only NIXL is faked.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch

from kvservice import ServiceConfig, TransferService
from kvservice._control.protocol import ChunkNotif, encode_notif
from kvservice.testing import FakeDoor, FakeFabric, pattern
from kvservice.testing.inspect import inside
from tests.helpers import SMALL, config, eventually, scaled

#: generous bound on any single wait: a hang guard, never a timed assertion
GUARD_S = scaled(10.0)


def unit_config(**kw: Any) -> ServiceConfig:
    kw.setdefault("drain_grace_s", 0.2)
    return config(SMALL, **kw)


@contextlib.asynccontextmanager
async def two_services(
    fabric: FakeFabric, sender: ServiceConfig | None = None, receiver: ServiceConfig | None = None,
) -> AsyncIterator[tuple[TransferService, TransferService]]:
    """A sending and a receiving service on fake doors.  The receiver exits first."""
    async with (
        TransferService(sender or unit_config(), door_factory=fabric.factory) as tx,
        TransferService(receiver or unit_config(), door_factory=fabric.factory) as rx,
    ):
        yield tx, rx


def door_of(fabric: FakeFabric, svc: TransferService) -> FakeDoor:
    return fabric.door(svc.agent_name)


def fill(svc: TransferService, rid: str, pages: Sequence[int]) -> torch.Tensor:
    """Write ``rid``'s payload into ``pages`` of ``svc``'s pool; returns it."""
    data = pattern(SMALL, rid, len(pages))
    svc.kv.write(pages, data)
    return data


def untouched(svc: TransferService, but: Sequence[int]) -> bool:
    """Every page of ``svc``'s pool outside ``but`` is still zero."""
    rest = [p for p in range(SMALL.num_pages) if p not in set(but)]
    return bool((svc.kv.pages(rest) == 0).all())


def notif_from(sender: TransferService, receiver: TransferService, n: ChunkNotif) -> bytes:
    """``n`` as ``sender``'s link to ``receiver`` seals it (what its watchdog posts)."""
    key = inside(sender).notif_key_to(receiver.agent_name)
    assert key is not None, "not linked"
    return encode_notif(n, key)


async def let_go_until_done(door: FakeDoor, xid: int) -> None:
    """The hung WRITE ``xid`` of a request that ended is let go, not released (a release does
    not stop a WRITE under way, so only its end proves it over): it is still live and still
    checked.  Then it completes (and the fence behind it), and the watchdog releases it, once."""
    assert xid in door.live_ids() and door.release_counts[xid] == 0, door.live_ids()
    checks = door.check_counts[xid]
    await eventually(lambda: door.check_counts[xid] > checks, GUARD_S)
    assert door.finish_hung() >= 1  # and the settle fence posted behind it, if any
    await eventually(lambda: door.live_xfers() == 0, GUARD_S)
    assert door.release_counts[xid] == 1
