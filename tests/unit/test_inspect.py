"""``kvservice.testing.inspect``: the view tests take of a service's insides reads the
service it was given, and says so when there is nothing to read yet."""

from __future__ import annotations

import anyio
import pytest

from kvservice import KVServiceError, TransferService
from kvservice.testing import FakeFabric
from kvservice.testing.inspect import inside
from tests.helpers import eventually

from .harness import GUARD_S, door_of, fill, two_services, unit_config


def test_a_service_not_started_has_nothing_inside_to_read() -> None:
    view = inside(TransferService(unit_config()))
    for name in ("plane", "control", "early", "door", "vetter", "metadata"):
        with pytest.raises(KVServiceError, match="started"):
            getattr(view, name)


async def test_the_view_reads_the_service_it_was_given() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            assert inside(tx).door is door_of(fabric, tx)
            assert inside(tx).metadata == door_of(fabric, tx).metadata()
            with pytest.raises(KVServiceError, match="vets no metadata"):
                inside(tx).vetter  # noqa: B018  # a fake door's metadata is not NIXL's
            assert inside(tx).link(rx.agent_name) is None and inside(tx).notif_key_to(rx.agent_name) is None
            heard = inside(tx).heard()
            await rx.expect("r", [3], sender=tx.address)
            await eventually(lambda: "r" in inside(tx).early, GUARD_S)
            assert "Expect" in [type(m).__name__ for m in heard] and len(inside(tx).early) == 1
            assert inside(tx).link(rx.agent_name) is not None and inside(tx).notif_key_to(rx.agent_name)
            fill(tx, "r", [1])
            assert (await tx.await_completion(await tx.send("r", [1], last=True))).ok
            assert (await rx.await_arrival("r")).ok
            assert "r" not in inside(tx).early and "r" in inside(tx).plane.sends_done
