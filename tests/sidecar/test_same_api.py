"""One scenario, run against the in-process ``TransferService`` and against a
``SidecarClient``: the same calls give the same results and the same errors,
so switching an engine between them is the one line in ``engine()``.  The
scenario is written against ``kvservice.KVTransfer``, the protocol both satisfy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvservice import (
    FailureReason,
    KVPoll,
    KVTransfer,
    ServiceStatus,
    SidecarClient,
    SidecarStatus,
    TransferFailed,
    TransferService,
    TransferStatus,
    UnknownRequestError,
)
from kvservice.sidecar.wire import Status, StatusReply, encode
from kvservice.testing import pattern
from tests.helpers import config, eventually

from .daemons import SMALL_LAYOUT, Sidecar, frame, raw_exchange, sidecars

pytestmark = pytest.mark.nixl

Svc = KVTransfer[Any]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Sidecar, Sidecar]]:
    with sidecars("prefill", "decode") as (p, d):
        yield p, d


def engine(mode: str, sidecar: Sidecar) -> Svc:
    from kvservice import KVLayout

    if mode == "in-process":
        return TransferService(config(KVLayout(**SMALL_LAYOUT)))  # type: ignore[arg-type]
    return SidecarClient(sidecar.socket)


async def scenario(prefill: Svc, decode: Svc, tag: str) -> None:
    layout = prefill.layout
    # 1. bytes arrive, in two chunks; the receiver's poll never blocks, on either face
    rid, src, dst = f"{tag}-ok", [1, 2, 3], [7, 8, 9]
    prefill.kv.write(src, pattern(layout, rid, 3))
    with pytest.raises(UnknownRequestError):
        decode.poll_arrival(rid)
    await decode.expect(rid, dst, sender=prefill.address)
    assert decode.poll_arrival(rid) in (KVPoll.Bootstrapping, KVPoll.WaitingForInput)
    await prefill.send(rid, src[:2], last=False)
    handle = await prefill.send(rid, src[2:], last=True)
    result = await prefill.await_completion(handle, timeout=30)
    assert (result.status, result.reason, result.bytes, result.pages) == (
        TransferStatus.SUCCESS, None, 3 * layout.page_bytes, 3)
    assert result.duration_s >= (result.transfer_s or 0) >= 0
    assert handle.poll() is KVPoll.Success and handle.result == result
    arrived = await decode.await_arrival(rid, timeout=30)
    assert arrived.ok and arrived.bytes == 3 * layout.page_bytes
    assert torch.equal(decode.kv.pages(dst), pattern(layout, rid, 3))
    assert decode.poll_arrival(rid) is KVPoll.Success
    with pytest.raises(UnknownRequestError):
        decode.poll_arrival("")
    with pytest.raises(ValueError, match="already completed"):
        await prefill.send(rid, [4], last=True)

    # 2. bad arguments raise at once, with the same messages
    with pytest.raises(ValueError, match="out of range"):
        await prefill.send(f"{tag}-x", [layout.num_pages], last=True)
    with pytest.raises(ValueError, match="repeat"):
        await prefill.send(f"{tag}-x", [4, 4], last=True)
    with pytest.raises(ValueError, match="request_id"):
        await prefill.send("", [4], last=True)
    with pytest.raises(ValueError, match="host:port"):
        await decode.expect(f"{tag}-y", [1], sender="nowhere")
    with pytest.raises(ValueError, match="duplicate"):
        await decode.expect(rid, [10], sender=prefill.address)
    with pytest.raises(UnknownRequestError):
        await prefill.abort(f"{tag}-never")
    with pytest.raises(UnknownRequestError):
        await decode.await_arrival(f"{tag}-never", timeout=1)

    # 3. a timeout that passes fails the request TIMEOUT (nobody expects it)
    lonely = await prefill.send(f"{tag}-lonely", [5], last=True)
    assert lonely.poll() is KVPoll.Bootstrapping
    timed_out = await prefill.await_completion(lonely, timeout=0.2)
    assert (timed_out.status, timed_out.reason) == (TransferStatus.FAILED, FailureReason.TIMEOUT)
    assert lonely.poll() is KVPoll.Failed
    with pytest.raises(TransferFailed, match="TIMEOUT"):
        lonely.failure_exception()

    # 4. abort: ABORTED here and at the receiver; a later chunk gets the sticky failure
    rid = f"{tag}-abort"
    await decode.expect(rid, [20, 21], sender=prefill.address)
    first = await prefill.send(rid, [6], last=False)
    async def bound() -> bool:
        now = await prefill.fetch_poll(first) if isinstance(prefill, SidecarClient) else first.poll()
        return now is not KVPoll.Bootstrapping

    # let the receiver's expect reach the sender first
    await eventually(bound, 30, 0.01, what=f"{rid}: the sender bound to its receiver")
    aborted = await prefill.abort(rid)
    assert aborted is not None and aborted.reason is FailureReason.ABORTED
    assert first.poll() is KVPoll.Failed
    again = await prefill.send(rid, [7], last=True)
    assert again.result is not None and again.result.reason is FailureReason.ABORTED
    far = await decode.await_arrival(rid, timeout=30)
    assert far.reason is FailureReason.ABORTED and "aborted" in far.message
    # ... and both sides settle: the sender's handles released, its fence landed here
    here_settled = await prefill.await_settled(rid, timeout=30)
    there_settled = await decode.await_settled(rid, timeout=30)
    assert here_settled.settled and there_settled.settled, (here_settled, there_settled)
    assert there_settled.reason is FailureReason.ABORTED
    with pytest.raises(UnknownRequestError):
        await decode.await_settled(f"{tag}-never", timeout=1)

    # 5. layer by layer, with a payload that arrives with the success; the same errors
    rid, src, dst = f"{tag}-layers", [8, 9], [30, 31]
    prefill.kv.write(src, pattern(layout, rid, 2))
    await decode.expect(rid, dst, sender=prefill.address)
    with pytest.raises(ValueError, match="payload goes with the last chunk"):
        await prefill.send(rid, src, layers=range(0, 1), payload=b"early")
    with pytest.raises(ValueError, match="non-empty range"):
        await prefill.send(rid, src, layers=range(2, 1))
    with pytest.raises(ValueError, match="exceeds max_payload_bytes"):
        await prefill.send(rid, src, last=True, payload=b"x" * (64 * 1024))
    await prefill.send(rid, src, layers=range(0, 1))
    with pytest.raises(ValueError, match="sent up to different pages"):
        await prefill.send(rid, src, last=True)
    layered = await prefill.send(rid, src, layers=range(1, layout.layers), last=True, payload=b"tok=42")
    assert (await prefill.await_completion(layered, timeout=30)).ok
    arrived = await decode.await_arrival(rid, timeout=30)
    assert arrived.ok and arrived.payload == b"tok=42" and arrived.bytes == 2 * layout.page_bytes
    assert torch.equal(decode.kv.pages(dst), pattern(layout, rid, 2))

    # 6. fit="tail": every page sent before the receiver asked; it reserved one, gets the last
    rid, src, dst = f"{tag}-fit", [10, 11, 12], [40]
    prefill.kv.write(src[2:], pattern(layout, rid, 1))
    with pytest.raises(ValueError, match="fit must be None or 'tail'"):
        await prefill.send(rid, src, last=True, fit="head")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fit= goes with a request's only chunk"):
        await prefill.send(rid, src, fit="tail")
    fitted = await prefill.send(rid, src, last=True, fit="tail")
    await decode.expect(rid, dst, sender=prefill.address)
    sent = await prefill.await_completion(fitted, timeout=30)
    assert sent.ok and sent.pages == 1, sent
    assert (await decode.await_arrival(rid, timeout=30)).ok
    assert torch.equal(decode.kv.pages(dst), pattern(layout, rid, 1))

    # 7. receiver= pins the request to one decode: the right one gets it, another's Expect
    #    is refused there; a malformed one, or one on a later chunk, raises at once
    rid, src, dst = f"{tag}-pinned", [13, 14], [50, 51]
    prefill.kv.write(src, pattern(layout, rid, 2))
    with pytest.raises(ValueError):
        await prefill.send(rid, src, last=True, receiver="nowhere")
    first = await prefill.send(rid, src[:1], receiver=decode.address)
    with pytest.raises(ValueError, match="receiver= goes with the first chunk only"):
        await prefill.send(rid, src[1:], last=True, receiver=decode.address)
    await decode.expect(rid, dst, sender=prefill.address)
    pinned = await prefill.await_completion(await prefill.send(rid, src[1:], last=True), timeout=30)
    assert pinned.ok and first.poll() is KVPoll.Success, pinned
    assert (await decode.await_arrival(rid, timeout=30)).ok
    assert torch.equal(decode.kv.pages(dst), pattern(layout, rid, 2))
    rid = f"{tag}-pinned-elsewhere"
    elsewhere = await prefill.send(rid, [15], last=True, receiver="127.0.0.1:9")
    await decode.expect(rid, [52], sender=prefill.address)
    refused = await decode.await_arrival(rid, timeout=30)
    assert refused.reason is FailureReason.REFUSED, refused
    assert elsewhere.poll() is KVPoll.Bootstrapping  # still waiting for its own receiver
    assert (await prefill.abort(rid)) is not None

    # 8. verify=True: the receiver checks the landing against the sender's checksums
    rid, src, dst = f"{tag}-verified", [16, 17], [53, 54]
    before = await fresh_status(decode)
    prefill.kv.write(src, pattern(layout, rid, 2))
    await decode.expect(rid, dst, sender=prefill.address, verify=True)
    assert (await prefill.await_completion(await prefill.send(rid, src, last=True), timeout=30)).ok
    assert (await decode.await_arrival(rid, timeout=30)).ok
    after = await fresh_status(decode)
    assert after.landings.get("checked", 0) == before.landings.get("checked", 0) + 1, (before, after)

    # 9. status() is a typed snapshot on both faces (and a read-only mapping of the same names)
    snap = await fresh_status(prefill)
    assert isinstance(snap, ServiceStatus) and snap.outcomes == snap["outcomes"], snap
    assert {"outcomes", "sending", "receiving", "peers", "unsettled_pages"} <= snap.keys()
    snap = await fresh_status(decode)
    assert snap.unsettled_pages == 0, snap
    for face in (prefill, decode):
        if isinstance(face, SidecarClient):
            assert isinstance(face.status(), SidecarStatus) and face.status().workers >= 1
            assert face.status().agent == face.agent_name


async def fresh_status(svc: Svc) -> ServiceStatus:
    """``status()`` now: a sidecar client's is refreshed every ``status_interval``."""
    return await svc.fetch_status() if isinstance(svc, SidecarClient) else svc.status()


@pytest.mark.parametrize("mode", ["in-process", "sidecar"])
async def test_prefill_side_same_api(mode: str, pair: tuple[Sidecar, Sidecar]) -> None:
    prefill_sidecar, decode_sidecar = pair
    async with engine(mode, prefill_sidecar) as prefill, SidecarClient(decode_sidecar.socket) as decode:
        await scenario(prefill, decode, f"p-{mode}")


@pytest.mark.parametrize("mode", ["in-process", "sidecar"])
async def test_decode_side_same_api(mode: str, pair: tuple[Sidecar, Sidecar]) -> None:
    prefill_sidecar, decode_sidecar = pair
    async with SidecarClient(prefill_sidecar.socket) as prefill, engine(mode, decode_sidecar) as decode:
        await scenario(prefill, decode, f"d-{mode}")


async def test_the_daemons_status_names_every_field_of_a_sidecar_status(pair: tuple[Sidecar, Sidecar]) -> None:
    """The wire carries the status as a map (so releases can differ); a name the daemon sends
    that ``SidecarStatus`` lacks would be dropped, one it lacks would read as its default.
    A daemon of this release sends exactly the fields (``discovery`` only with etcd).  The
    malformed frame after the call makes the daemon answer and hang up."""
    replies = await raw_exchange(pair[0].socket, encode(Status(1)) + frame(b"\xc1"))
    sent = next(reply for reply in replies if isinstance(reply, StatusReply)).status
    assert sorted(sent) == sorted(SidecarStatus().keys())
    assert SidecarStatus.from_mapping(sent).workers == 1  # this connection


def test_both_faces_take_the_protocols_arguments() -> None:
    """Every call of ``KVTransfer`` takes the same arguments (names, kinds, defaults) on the
    in-process service, the sidecar client and the protocol: a keyword one face gains and
    the other lacks (``expect(member=)`` was one) is caught here, before an engine is."""
    import inspect

    def shape(fn: Any) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    names = [n for n, v in vars(KVTransfer).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert "expect" in names and "send" in names
    for name in names:
        want = shape(getattr(KVTransfer, name))
        assert shape(getattr(TransferService, name)) == want, name
        assert shape(getattr(SidecarClient, name)) == want, name
