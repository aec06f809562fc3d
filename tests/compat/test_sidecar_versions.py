"""The sidecar's wire across releases: engines' workers and their sidecars are upgraded
separately, so a worker's client of the previous release drives a daemon of this one,
and a client of this release drives a daemon of the previous one.  Each moves bytes to a
decode of this release, verified; the daemon's Welcome names the version both speak, and a
call the previous daemon has no message for is refused by this client before it is sent."""

from __future__ import annotations

import pytest
import torch

from kvservice import KVLayout, KVServiceError, SidecarClient, TransferService
from kvservice._control.protocol import PROTOCOL_VERSION
from kvservice.testing import pattern
from tests.compat.previous import PREVIOUS_PROTOCOL, PREVIOUS_SIDECAR, previous_env
from tests.helpers import config, peers, scaled
from tests.sidecar.daemons import SMALL_LAYOUT, sidecars

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

GUARD_S = scaled(30.0)
LAYOUT = KVLayout(**SMALL_LAYOUT)


async def test_a_previous_client_drives_this_releases_daemon() -> None:
    with sidecars("prefill") as (daemon,):
        async with TransferService(config(LAYOUT)) as decode:
            await decode.expect("old-client", [7, 8], sender=daemon.address)
            async with peers({"layout": SMALL_LAYOUT, "sidecar": daemon.socket}, env=previous_env()) as (worker,):
                await worker.command(op="fill", rid="old-client", pages=[1, 2])
                await worker.event("filled", timeout=GUARD_S)
                await worker.command(op="send", rid="old-client", pages=[1, 2], last=True)
                assert (await worker.event("completed", "old-client", timeout=GUARD_S))["status"] == "SUCCESS"
            assert (await decode.await_arrival("old-client", timeout=GUARD_S)).ok
            assert torch.equal(decode.kv.pages([7, 8]), pattern(LAYOUT, "old-client", 2))
            assert decode.status()["peer_versions"] == {str(PROTOCOL_VERSION): 1}  # the daemon is this release's


async def test_this_releases_client_drives_a_previous_daemon() -> None:
    with sidecars("prefill", env=previous_env()) as (daemon,):
        async with TransferService(config(LAYOUT)) as decode, SidecarClient(daemon.socket) as prefill:
            assert prefill.welcome is not None and prefill.welcome.version == PREVIOUS_SIDECAR
            # calls newer than the daemon: refused here, no frame sent, the connection goes on
            for call in (lambda: prefill.decline("new-client", sender=decode.address),
                         lambda: prefill.expected("new-client"), lambda: prefill.expected_pages("new-client"),
                         lambda: prefill.expect_dropped("new-client")):
                with pytest.raises(KVServiceError, match=f"speaks {PREVIOUS_SIDECAR}: upgrade the daemon"):
                    await call()
            prefill.kv.write([3, 4], pattern(LAYOUT, "new-client", 2))
            await decode.expect("new-client", [9, 10], sender=prefill.address)
            sent = await prefill.await_completion(await prefill.send("new-client", [3, 4], last=True),
                                                  timeout=GUARD_S)
            assert sent.ok, sent
            assert (await decode.await_arrival("new-client", timeout=GUARD_S)).ok
            assert torch.equal(decode.kv.pages([9, 10]), pattern(LAYOUT, "new-client", 2))
            assert decode.status()["peer_versions"] == {str(PREVIOUS_PROTOCOL): 1}  # the previous release's
