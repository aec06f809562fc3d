"""Bad input against a real service: it raises at once, names the problem, and
leaves another in-flight request untouched."""

from __future__ import annotations

import pytest

from kvservice import KVPoll, KVServiceError, TransferService, UnknownRequestError
from kvservice.testing import pattern
from tests.helpers import SMALL, config, eventually, peer_config, peers

pytestmark = pytest.mark.nixl


async def test_bad_calls_raise_and_disturb_nothing() -> None:
    async with peers(peer_config()) as (decode,), TransferService(config()) as svc:
        # an innocent request, in the middle of its life (first chunk sent, more to come)
        svc.kv.write([1, 2, 3], pattern(SMALL, "ok", 3))
        await decode.command(op="expect", rid="ok", pages=[10, 11, 12], sender=svc.address)
        await decode.event("expecting", "ok")
        handle = await svc.send("ok", [1], last=False)
        await eventually(lambda: handle.poll() is not KVPoll.Bootstrapping)  # the expect has arrived

        with pytest.raises(ValueError, match="out of range"):
            await svc.send("x", [SMALL.num_pages], last=True)
        with pytest.raises(ValueError, match="out of range"):
            await svc.send("x", [-1], last=True)
        with pytest.raises(ValueError, match="repeat"):
            await svc.send("x", [4, 4], last=True)
        with pytest.raises(ValueError, match="non-empty"):
            await svc.send("x", [], last=True)
        with pytest.raises(ValueError, match="receiver expects 3"):
            await svc.send("ok", [4, 5, 6], last=True)  # 1 + 3 pages > the 3 expected
        with pytest.raises(ValueError, match="request_id"):
            await svc.send("", [4], last=True)
        with pytest.raises(ValueError, match="host:port"):
            await svc.expect("y", [1], sender="nowhere")
        await svc.expect("dup", [30], sender=decode.address)
        with pytest.raises(ValueError, match="duplicate"):
            await svc.expect("dup", [31], sender=decode.address)
        with pytest.raises(UnknownRequestError, match="unknown request"):
            await svc.await_arrival("never-expected", timeout=1)
        with pytest.raises(UnknownRequestError):
            await svc.abort("never-heard-of")

        # the innocent request finishes as if nothing happened
        handle = await svc.send("ok", [2, 3], last=True)
        result = await svc.await_completion(handle, timeout=10)
        assert result.ok, result
        assert (await decode.event("arrived", "ok"))["verified"] is True
        with pytest.raises(ValueError, match="send after last"):
            await svc.send("ok", [4], last=True)
        with pytest.raises(RuntimeError, match="has not failed"):
            handle.failure_exception()
        assert await svc.abort("dup") is not None


async def test_service_used_outside_its_lifetime_raises() -> None:
    svc = TransferService(config())
    with pytest.raises(KVServiceError, match="not running"):
        await svc.send("r", [1], last=True)
    with pytest.raises(KVServiceError, match="has started"):
        svc.kv  # noqa: B018
    async with svc:
        pass
    with pytest.raises(KVServiceError, match="shutting down"):
        await svc.send("r", [1], last=True)
