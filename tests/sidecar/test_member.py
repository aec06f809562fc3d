"""``expect(member=)`` through the sidecar, as in process (``TransferService.expect``): a
worker names the member a registry vouched for at the sender, and the daemon's service
takes the sender only if it proves that member.

A real decode daemon with a member identity, a real NIXL agent and a real member
(Mallory, in process, with her own certificate from the same cluster's CA) answering at
the sender's address: an expect naming another member there fails ``REFUSED`` (counted
``identity_member``) and no Expect reaches Mallory; naming Mallory herself, the expect
reaches her.  A client on an older daemon refuses ``member=`` before it sends a frame
(``tests/sidecar/test_wire.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvservice import FailureReason, KVLayout, SidecarClient, TransferService
from tests.faults.test_member_identity import Authority
from tests.helpers import config, eventually

from .daemons import SMALL_LAYOUT, Sidecar, sidecars

pytestmark = pytest.mark.nixl

WAIT_S = 60.0  # a hang guard for each wait, never a timed assertion


@pytest.fixture
def authority(tmp_path: Path) -> Authority:
    return Authority(tmp_path)


@pytest.fixture
def decode(authority: Authority) -> Iterator[Sidecar]:
    """A decode daemon that is member decode-0 of the authority's cluster."""
    files = authority.member("decode-0", "decode")
    env = {f"KVSERVICE_SERVICE_{key.upper()}": value for key, value in files.items()}
    with sidecars("decode", env=env) as (daemon,):
        yield daemon


async def test_an_expect_naming_a_member_is_refused_by_another_member_at_the_sender(
        authority: Authority, decode: Sidecar) -> None:
    layout = KVLayout(**SMALL_LAYOUT)  # type: ignore[arg-type]
    async with (TransferService(config(layout, **authority.member("mallory"))) as mallory,
                SidecarClient(decode.socket) as client):
        await client.expect("named", [1, 2], sender=mallory.address, member="prefill-1")
        result = await client.await_arrival("named", timeout=WAIT_S)
        assert result.reason is FailureReason.REFUSED, result
        assert "named as member 'prefill-1'" in result.message, result
        assert "proves member kvservice://c1/prefill/mallory" in result.message, result
        status = await client.fetch_status()
        assert int(status.refused.get("identity_member", 0)) == 1, status.refused
        assert not await mallory.expected("named")

        # the member who answers there, named: the daemon's Expect reaches her
        await client.expect("mallory", [3], sender=mallory.address, member="mallory")
        await eventually(lambda: mallory.expected("mallory"), timeout=WAIT_S)
        await client.abort("mallory")
