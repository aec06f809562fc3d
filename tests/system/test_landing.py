"""Landing checks (``verify_landing``, ``expect(verify=)``) between real NIXL agents in
two processes: a checked transfer arrives byte-exact; bytes that differ from what the
sender checksummed (a sender whose page changed after its checksum, a receiver's page
overwritten after the WRITE landed) fail the request ``CORRUPTED``, counted and logged,
and the next transfer passes; a sender whose sums vouch for one chunk twice and leave
another unchecked fails it ``INCOMPATIBLE``; ``verify=False`` skips the check; a sender that sends no
checksum (as a version without landing checks) fails it ``INCOMPATIBLE``."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
import structlog
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvservice import FailureReason, TransferService, TransferStatus
from kvservice._control.protocol import ChunkNotif, Expect, LandingSum, encode_notif
from kvservice._transfer import landing
from kvservice._transfer.inbound import Inbound
from kvservice.memory._pairing import Pair
from kvservice.testing import PeerProcess, pattern
from tests.helpers import SMALL, config, peer_config, peers, scaled

pytestmark = pytest.mark.nixl

GUARD_S = scaled(30.0)  # a hang guard for each wait, never a timed assertion


async def _expect(decode: PeerProcess, rid: str, pages: list[int], sender: str, **kw: Any) -> None:
    await decode.command(op="expect", rid=rid, pages=pages, sender=sender, **kw)
    await decode.event("expecting", rid)


async def _status(peer: PeerProcess) -> dict[str, Any]:
    await peer.command(op="status")
    return await peer.event("status", timeout=GUARD_S)


async def _send(svc: TransferService, rid: str, src: list[int], chunks: Sequence[tuple[int, int]]) -> None:
    """Send ``src`` (filled with ``rid``'s pattern) in chunks of pages ``a:b``."""
    svc.kv.write(src, pattern(SMALL, rid, len(src)))
    for i, (a, b) in enumerate(chunks):
        handle = await svc.send(rid, src[a:b], last=i == len(chunks) - 1)
    await svc.await_completion(handle, timeout=GUARD_S)


async def _arrived(decode: PeerProcess, rid: str) -> dict[str, Any]:
    return await decode.event("arrived", rid, timeout=GUARD_S)


async def test_a_sender_whose_page_changed_after_its_checksum_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's pages change between its checksum and its WRITE (on the door thread,
    as a page reused too early would): the receiver holds other bytes than the sum says."""
    changed: list[int] = []
    seal = landing.Seal.__call__

    def then_change(self: landing.Seal) -> None:
        seal(self)  # the sum of the page as it is now ...
        if self._notif.request_id.startswith("bad"):  # ... then its first byte changes before the WRITE
            page, region = int(self._pages[0]), self._out.src.regions[0]
            ctypes.c_uint8.from_address(region.addr + page * region.page_stride).value ^= 0x5A
            changed.append(page)

    monkeypatch.setattr(landing.Seal, "__call__", then_change)
    async with peers(peer_config()) as (decode,), TransferService(config()) as svc:
        # chunked: each chunk carries its own sum
        await _expect(decode, "ok1", [40, 41, 42, 43], svc.address, verify=True)
        await _send(svc, "ok1", [1, 2, 3, 4], [(0, 1), (1, 4)])
        arrived = await _arrived(decode, "ok1")
        assert (arrived["status"], arrived["verified"]) == ("SUCCESS", True), arrived
        assert (await _status(decode))["landings"] == {"checked": 1}

        await _expect(decode, "bad1", [10, 11, 12], svc.address, verify=True)
        await _send(svc, "bad1", [1, 2, 3], [(0, 2), (2, 3)])
        arrived = await _arrived(decode, "bad1")
        assert (arrived["status"], arrived["reason"]) == ("FAILED", "CORRUPTED"), arrived
        assert "landing check failed: 2 of 2 chunks differ" in arrived["message"], arrived
        assert changed == [1, 3]

        # the next transfer, its pages unchanged, passes
        await _expect(decode, "ok2", [20, 21, 22], svc.address, verify=True)
        await _send(svc, "ok2", [5, 6, 7], [(0, 3)])
        arrived = await _arrived(decode, "ok2")
        assert (arrived["status"], arrived["verified"]) == ("SUCCESS", True), arrived
        st = await _status(decode)
        assert st["landings"] == {"checked": 2, "mismatched": 1}
        assert st["outcomes"]["recv.CORRUPTED"] == 1 and st["outcomes"]["recv.SUCCESS"] == 2


async def test_a_sender_whose_second_chunk_carries_the_first_ones_sum_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A hostile sender: chunk 2's notification carries chunk 1's sum (as many cells as
    the request has, so a count of cells is satisfied), and chunk 2's page is not the
    page it claims to send.  The receiver refuses the repeated sum as it comes: the
    request fails ``INCOMPATIBLE`` naming the cells vouched for twice, never a SUCCESS
    over bytes no sum checked; the next honest transfer passes."""
    seal = landing.Seal.__call__
    repeated: list[str] = []

    def repeat_the_first_sum(self: landing.Seal) -> None:
        seal(self)  # as an honest sender would ...
        n, s = self._notif, self._sum
        if not n.request_id.startswith("dup") or s.pos == 0:
            return
        # ... but this chunk's page changes before its WRITE, and its notification carries
        # the sum of chunk 1 (source page 1, the request's page 0) instead of its own
        page, region = int(self._pages[0]), self._out.src.regions[0]
        ctypes.c_uint8.from_address(region.addr + page * region.page_stride).value ^= 0x5A
        first = landing.checksum(self._out.src, self._out.src_views, np.array([1], dtype=np.int32), s.lo, s.hi)
        self._op.notif = encode_notif(
            ChunkNotif(n.request_id, n.chunk, n.total, n.payload, LandingSum(first, 0, 1, s.lo, s.hi)), self._key)
        repeated.append(n.request_id)

    monkeypatch.setattr(landing.Seal, "__call__", repeat_the_first_sum)
    async with peers(peer_config()) as (decode,), TransferService(config()) as svc:
        await _expect(decode, "dup1", [10, 11], svc.address, verify=True)
        await _send(svc, "dup1", [1, 2], [(0, 1), (1, 2)])
        arrived = await _arrived(decode, "dup1")
        assert repeated == ["dup1"]
        assert (arrived["status"], arrived["reason"]) == ("FAILED", "INCOMPATIBLE"), arrived
        assert (f"the sender's landing checksums do not fit: landing sum for pages 0..0, layers 0..{SMALL.layers - 1} "
                f"covers {SMALL.layers} (page, layer) cells another sum covers") in arrived["message"], arrived

        await _expect(decode, "ok4", [20, 21], svc.address, verify=True)
        await _send(svc, "ok4", [3, 4], [(0, 1), (1, 2)])
        arrived = await _arrived(decode, "ok4")
        assert (arrived["status"], arrived["verified"]) == ("SUCCESS", True), arrived
        st = await _status(decode)
        assert st["landings"] == {"checked": 1}
        assert st["outcomes"]["recv.INCOMPATIBLE"] == 1 and st["outcomes"]["recv.SUCCESS"] == 1
        assert st["live_nixl_handles"] == 0


def _scrape(svc: TransferService) -> dict[tuple[str, str], float]:
    """``kvservice_landing_checks_total`` and the CORRUPTED receives, from ``svc.metrics``."""
    registry = CollectorRegistry()
    registry.register(svc.metrics)
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name == "kvservice_landing_checks_total":
                out[("landing", s.labels["result"])] = s.value
            elif s.name == "kvservice_transfers_total" and s.labels["reason"] == "CORRUPTED":
                out[(s.labels["side"], "CORRUPTED")] = s.value
    return out


async def test_a_page_overwritten_after_it_landed_is_caught_counted_and_logged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Here the receiver: a page of the request is overwritten after the WRITE landed and
    before the check reads it (as a page handed out twice would be)."""
    mismatches = landing.mismatches
    overwritten: list[int] = []

    def overwrite_then_check(back: Pair, pages: Any, sums: Sequence[LandingSum]) -> Any:
        if pages.tolist() == [30, 31]:  # the request planted for it: its last page, another request's now
            svc.kv.write([31], pattern(SMALL, "another", 1))
            overwritten.append(31)
        return mismatches(back, pages, sums)

    async with peers(peer_config()) as (prefill,), TransferService(config(verify_landing=True)) as svc:
        await prefill.command(op="fill", rid="bad2", pages=[1, 2])
        await prefill.event("filled", "bad2")
        monkeypatch.setattr(landing, "mismatches", overwrite_then_check)
        with structlog.testing.capture_logs() as logs:
            await svc.expect("bad2", [30, 31], sender=prefill.address)  # verify: the service's setting
            await prefill.command(op="send", rid="bad2", pages=[1, 2])
            result = await svc.await_arrival("bad2", timeout=GUARD_S)
        assert (result.status, result.reason) == (TransferStatus.FAILED, FailureReason.CORRUPTED), result
        assert overwritten == [31]
        assert "landing check failed: 1 of 1 chunks differ" in result.message
        logged = [e for e in logs if e["event"] == "transfer.landing_mismatch"]
        assert len(logged) == 1 and logged[0]["request_id"] == "bad2" and logged[0]["log_level"] == "error"
        monkeypatch.undo()

        await prefill.command(op="fill", rid="ok3", pages=[3, 4])
        await prefill.event("filled", "ok3")
        await svc.expect("ok3", [32, 33], sender=prefill.address)
        await prefill.command(op="send", rid="ok3", pages=[3, 4])
        result = await svc.await_arrival("ok3", timeout=GUARD_S)
        assert result.ok, result
        assert torch.equal(svc.kv.pages([32, 33]), pattern(SMALL, "ok3", 2))
        st = svc.status()
        assert st["landings"] == {"checked": 1, "mismatched": 1}
        assert st["outcomes"]["recv.CORRUPTED"] == 1
        assert _scrape(svc) == {("landing", "checked"): 1, ("landing", "mismatched"): 1,
                                ("landing", "unchecked"): 0, ("send", "CORRUPTED"): 0, ("recv", "CORRUPTED"): 1}


async def test_verify_false_skips_the_check_the_service_setting_asks_it() -> None:
    async with peers(peer_config(verify_landing=True)) as (decode,), TransferService(config()) as svc:
        await _expect(decode, "d1", [5], svc.address)  # the receiver's setting: checked
        await _send(svc, "d1", [1], [(0, 1)])
        assert (await _arrived(decode, "d1"))["verified"] is True
        await _expect(decode, "d2", [6], svc.address, verify=False)
        await _send(svc, "d2", [2], [(0, 1)])
        arrived = await _arrived(decode, "d2")
        assert (arrived["status"], arrived["verified"]) == ("SUCCESS", True), arrived
        assert (await _status(decode))["landings"] == {"checked": 1}  # d2 was not checked


async def test_a_sender_that_sends_no_checksum_fails_the_request_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    """This sender reads Expects as a version without landing checks does (no ``verify``):
    its chunks carry no sum, and the receiver that asked for checks fails the request
    rather than report an unchecked success."""
    on_expect = Inbound._on_expect

    def as_older_version(self: Inbound, agent: str, msg: Expect) -> None:
        on_expect(self, agent, msgspec.structs.replace(msg, verify=False))

    monkeypatch.setattr(Inbound, "_on_expect", as_older_version)
    async with peers(peer_config()) as (decode,), TransferService(config()) as svc:
        await _expect(decode, "old1", [7, 8], svc.address, verify=True)
        await _send(svc, "old1", [1, 2], [(0, 1), (1, 2)])
        arrived = await _arrived(decode, "old1")
        assert (arrived["status"], arrived["reason"]) == ("FAILED", "INCOMPATIBLE"), arrived
        assert "the sender does not check landings: 0 of 2 chunks carried a checksum" in arrived["message"]
        assert (await _status(decode))["landings"] == {"unchecked": 1}
