"""``Posted`` (protocol 7): a receiver holds an Expect cold until its sender says it posts.

Real NIXL in real processes: the prefill is a child service, the decode (and a hostile
member, ``mallory``) run in the test's process, where their watchdogs' ticks can be
counted.  A cold Expect costs the decode's NIXL thread nothing but the idle cadence (no
tick lingers to poll); the sender's ``Posted`` wakes it, and the transfer lands byte-exact.
A sender of protocol 6 (the last release that spoke it, taken from the history as the
compat tests take theirs) never sends the frame and is polled as before; a receiver of 6
never gets it.  Frames about requests that are not the speaker's are ignored and counted,
a flood of them wakes nothing, and a cold Expect whose sender dies still ends as before.
"""

from __future__ import annotations

import signal
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from kvservice import FailureReason, TransferService, TransferStatus
from kvservice._control.protocol import MAX_POSTED, POSTED_VERSION, Posted
from kvservice._transfer.cadence import EXPECT_GRACE_S, WARM_GRACE_S
from kvservice.testing import PeerProcess, pattern
from kvservice.testing.inspect import inside
from tests.compat.previous import REPO
from tests.compat.test_mixed_versions import send_to
from tests.helpers import SMALL, config, eventually, heard_by, peer_config, peers, scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

#: the last commit whose control protocol is 6 (the commit before ``Posted``)
SPEAKS_6 = "7de986df991cd744fca03ae57f53ed777c2af9eb"
GUARD_S = scaled(30.0)
#: how long the decode holds a cold Expect while its ticks are counted
HOLD_S = 1.0
#: idle ticks that can fit in HOLD_S: waits doubling from ``cadence.IDLE_FIRST_S`` (50, 100,
#: 200, 400 ms ...), one more for the tick under way, and slack for ticks unrelated wakes started
IDLE_TICKS = 8
#: past the polling that follows the last polled request (``WARM_GRACE_S``) or an Expect
#: (``EXPECT_GRACE_S``), and its last tick
QUIET_S = max(WARM_GRACE_S, EXPECT_GRACE_S) + 0.2
#: hostile frames in the flood
FLOOD = 2000


def ticks_of(svc: TransferService) -> tuple[int, int]:
    """The decode's watchdog: ticks so far, and how many of them lingered (polled NIXL)."""
    w = inside(svc).plane.watchdog
    return w.ticks, w.lingered


async def status_of(peer: PeerProcess) -> dict[str, Any]:
    await peer.command(op="status", id="st")
    return await peer.wait_for(lambda e: e.get("event") == "status" and e.get("id") == "st")


async def hold_and_count(decode: TransferService) -> tuple[int, int]:
    """Ticks and lingering ticks of ``decode`` while it sits HOLD_S with what it holds."""
    ticks, lingered = ticks_of(decode)
    await anyio.sleep(HOLD_S)
    after = ticks_of(decode)
    return after[0] - ticks, after[1] - lingered


async def arrives(decode: TransferService, prefill: PeerProcess, rid: str, src: list[int], dst: list[int]) -> None:
    """The prefill sends ``rid`` (filled already, expected already): byte-exact on the decode."""
    await prefill.command(op="send", rid=rid, pages=src, last=True)
    result = await decode.await_arrival(rid, timeout=GUARD_S)
    assert result.status is TransferStatus.SUCCESS, result
    assert torch.equal(decode.kv.pages(dst), pattern(SMALL, rid, len(dst)))
    assert (await prefill.event("completed", rid, timeout=GUARD_S))["status"] == "SUCCESS"


async def fill(prefill: PeerProcess, rid: str, src: list[int]) -> None:
    await prefill.command(op="fill", rid=rid, pages=src)
    await prefill.event("filled", rid, timeout=GUARD_S)


@pytest.fixture(scope="module")
def speaks_6() -> Iterator[dict[str, str]]:
    """The environment a child runs the protocol-6 release in (its tree from the history)."""
    with tempfile.TemporaryDirectory(prefix="kvservice-6-") as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", SPEAKS_6, "kvservice"],
                                 capture_output=True, check=True, timeout=60).stdout
        tar_path = Path(tmp) / "tree.tar"
        tar_path.write_bytes(archive)
        with tarfile.open(tar_path) as tar:
            tar.extractall(tmp, filter="data")
        yield {"PYTHONPATH": tmp, "PYTHONSAFEPATH": "1"}


async def test_a_cold_expect_idles_until_its_sender_posts() -> None:
    """The decode's Expect waits for a prefill of this release: none of the decode's ticks
    lingers (polls NIXL) until the prefill sends, its ticks are the idle cadence's; then the
    ``Posted`` wakes it and the pages land byte-exact."""
    async with peers(peer_config()) as (prefill,), TransferService(config(connect_timeout_s=GUARD_S)) as decode:
        await fill(prefill, "warm-up", [1])
        await decode.expect("warm-up", [2], sender=prefill.address)
        await arrives(decode, prefill, "warm-up", [1], [2])  # links and NIXL connections up
        assert decode.status()["peer_versions"] == {str(POSTED_VERSION): 1}

        src, dst = [3, 4, 5, 9], [40, 41, 50, 2]
        await fill(prefill, "r1", src)
        await decode.expect("r1", dst, sender=prefill.address)
        assert inside(decode).plane.recvs["r1"].cold
        await anyio.sleep(QUIET_S)  # the polling after the warm-up ends
        ticks, lingered = await hold_and_count(decode)
        assert lingered == 0 and ticks <= IDLE_TICKS, (ticks, lingered)
        before = ticks_of(decode)[1]
        heard = heard_by(decode)
        await arrives(decode, prefill, "r1", src, dst)
        assert any(isinstance(m, Posted) and "r1" in m.request_ids for m in heard), heard  # the first after a pause
        assert ticks_of(decode)[1] > before  # and it polled for it
        assert inside(decode).plane.cold == 0
        await eventually(lambda: not inside(decode).plane.busy(), timeout=GUARD_S, what="polling ends")


async def test_a_cold_expect_ends_when_its_sender_dies() -> None:
    """Nothing but the link says a cold Expect's sender is gone: killed before it posts,
    the decode's request still fails as it always did (the link's loss)."""
    lost = {FailureReason.PEER_LOST, FailureReason.REMOTE_DISCONNECT, FailureReason.SHUTDOWN}
    async with peers(peer_config()) as (prefill,), \
            TransferService(config(connect_timeout_s=GUARD_S, heartbeat_interval_s=0.2, peer_timeout_s=1.0)) as decode:
        await fill(prefill, "r1", [1, 2])
        await decode.expect("r1", [3, 4], sender=prefill.address)
        assert inside(decode).plane.recvs["r1"].cold
        prefill.signal(signal.SIGKILL)
        result = await decode.await_arrival("r1", timeout=GUARD_S)
        assert result.status is TransferStatus.FAILED and result.reason in lost, result
        assert inside(decode).plane.cold == 0


async def test_a_sender_of_protocol_6_is_polled_as_before(speaks_6: dict[str, str]) -> None:
    """A prefill of protocol 6 never says ``Posted``: the decode's Expect is not cold, its
    watchdog polls from the Expect on, and the transfer is byte-exact."""
    async with peers(peer_config(), env=speaks_6) as (prefill,), \
            TransferService(config(connect_timeout_s=GUARD_S)) as decode:
        src, dst = [3, 4, 5], [10, 11, 12]
        await fill(prefill, "r1", src)
        await decode.expect("r1", dst, sender=prefill.address)
        assert decode.status()["peer_versions"] == {"6": 1}
        assert not inside(decode).plane.recvs["r1"].cold
        _, lingered = await hold_and_count(decode)
        assert lingered > 0
        await arrives(decode, prefill, "r1", src, dst)


async def test_a_receiver_of_protocol_6_never_gets_the_frame(speaks_6: dict[str, str]) -> None:
    """This release sends to a decode of protocol 6: no ``Posted`` goes out (the decode would
    close the link on its tag: ``frame``), every byte arrives, the link stays up."""
    async with TransferService(config()) as svc, \
            peers(peer_config(connect_timeout_s=GUARD_S), env=speaks_6) as (decode,):
        for i, (src, dst) in enumerate((([3, 4, 5, 9], [40, 41, 50, 2]), ([10, 11], [12, 13]))):
            await send_to(svc, decode, f"down-{i}", src, dst)
        assert svc.status()["peer_versions"] == {"6": 1}
        st = await status_of(decode)
        assert "frame" not in st["refused"] and len(st["peers"]) == 1, st


async def test_hostile_posted_frames_are_counted_and_wake_nothing() -> None:
    """A linked member (``mallory``) says ``Posted`` for a request the decode holds from the
    prefill (``foreign_request``), for ids the decode never heard of (``posted_unknown``), and
    floods both: counted, the held request stays cold, the flood starts no tick that polls,
    and the prefill's transfer lands byte-exact after it."""
    async with peers(peer_config()) as (prefill,), \
            TransferService(config(connect_timeout_s=GUARD_S)) as decode, \
            TransferService(config(connect_timeout_s=GUARD_S)) as mallory:
        src, dst = [3, 4, 5, 9], [40, 41, 50, 2]
        await fill(prefill, "legit", src)
        await decode.expect("legit", dst, sender=prefill.address)
        await inside(mallory).control.link_to(decode.address)
        agent = decode.agent_name
        await anyio.sleep(QUIET_S)  # a tick that lingered while the links came up ends
        ticks, lingered = ticks_of(decode)
        say = inside(mallory).control.send_to
        say(agent, Posted(["legit"]))
        say(agent, Posted(["never-expected"]))
        for i in range(FLOOD):
            say(agent, Posted(["legit" if i % 2 else f"flood-{i}"]))
        say(agent, Posted(["legit"] * MAX_POSTED))  # the most a frame may name, all of them foreign

        def counted() -> bool:
            refused = decode.status()["refused"]
            return (refused.get("foreign_request", 0) >= 1 + FLOOD // 2 + MAX_POSTED
                    and refused.get("posted_unknown", 0) >= 1 + FLOOD // 2)

        await eventually(counted, timeout=GUARD_S, what=lambda: f"refusals counted: {decode.status()['refused']}")
        assert inside(decode).plane.recvs["legit"].cold
        after = ticks_of(decode)
        assert after[1] == lingered and after[0] - ticks <= IDLE_TICKS, (ticks, lingered, after)
        assert len(mallory.status()["peers"]) == 1  # nothing was dropped: each frame cost a lookup
        await arrives(decode, prefill, "legit", src, dst)
        assert decode.status()["refused"].get("foreign_request", 0) == 1 + FLOOD // 2 + MAX_POSTED
