"""A vLLM hand-off is bound to the prefill member that will send (docs/vllm.md "Trust"), with
real NIXL agents: the connector's scheduler sides and workers (no vLLM), each worker with its
own service and member identity, the KV in CPU tensors shaped as vLLM's CPU backend's.

prefill-a holds request ``p1``'s KV, its send waiting for the decode.  Mallory, a member
with the cluster's key and a prefill certificate of her own, writes a hand-off for ``p1``
naming prefill-a's address, signed by herself: the decode takes it (it is hers), pins the
load to member mallory, and prefill-a's service, which proves prefill-a, is refused on the
link (``REFUSED``, counted ``identity_member``, the load failed, counted ``load_failed``,
the reason naming both members); before, the decode loaded prefill-a's KV on her word.
Revoked, her next hand-off is refused before anything is reserved.  prefill-a's own
hand-off then loads byte-exact."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvservice._trust.authority import revoke, serial_of
from kvservice._trust.revocation import RevocationWatch
from kvservice.integrations.vllm import scheduler
from kvservice.integrations.vllm.scheduler import SchedulerSide
from kvservice.integrations.vllm.worker import WorkerSide
from tests.faults.test_member_identity import Authority
from tests.helpers import config
from tests.unit.test_handoff_members import cluster_key, identity
from tests.unit.test_vllm_side import Req

pytestmark = [pytest.mark.nixl]

BLOCKS, BLOCK = 8, 32
#: a hang guard for one load over loopback (it costs nothing when the load ends sooner)
GUARD_S = 60.0


def caches() -> dict[str, torch.Tensor]:
    """vLLM's CPU backend's layout: (blocks, kv heads, block size, 2 * head dim), two layers."""
    return {f"layer.{i}": torch.zeros(BLOCKS, 2, BLOCK, 16) for i in range(2)}


@contextlib.contextmanager
def running(files: dict[str, Any]) -> Iterator[tuple[WorkerSide, dict[str, torch.Tensor]]]:
    side, kv = WorkerSide(config(**files)), caches()
    side.register(kv)
    try:
        yield side, kv
    finally:
        assert side.engine is not None
        side.engine.close()


def settled(decode: WorkerSide, rid: str) -> bool:
    """Poll the decode worker (as vLLM's steps do) until ``rid``'s load is reported; whether
    it failed."""
    deadline = time.monotonic() + GUARD_S
    while time.monotonic() < deadline:
        _, recving, failed = decode.finished(set(), idle_wait_s=0.05)
        if rid in recving:
            return rid in failed
    raise AssertionError(f"{rid}: not reported within {GUARD_S} s")


def refused(worker: WorkerSide, kind: str) -> int:
    assert worker.engine is not None
    return int(worker.engine.status()["refused"].get(kind, 0))


def test_a_handoff_loads_only_from_the_member_that_signed_it(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Authority(tmp_path)
    a_files, d_files, m_files = (cluster.member("prefill-a"), cluster.member("decode-0", "decode"),
                                 cluster.member("mallory"))
    me = identity(d_files)
    crl, _ = revoke(cluster.dir, [])
    with running(a_files) as (a, a_kv), running(d_files) as (d, d_kv):
        assert a.engine is not None
        senders = (a.engine.address,)
        prefill = SchedulerSide(block_size=BLOCK, producer=True, consumer=False, senders=senders,
                                key=cluster_key(cluster), identity=identity(a_files))
        mallory = SchedulerSide(block_size=BLOCK, producer=True, consumer=False, senders=senders,
                                key=cluster_key(cluster), identity=identity(m_files))
        decode = SchedulerSide(block_size=BLOCK, producer=False, consumer=True, senders=(),
                               key=cluster_key(cluster), identity=me, revocations=RevocationWatch(crl, me.ca))
        for layer in a_kv.values():
            layer[1:4].copy_(torch.randn(3, *layer.shape[1:]))

        def handoff(side: SchedulerSide, rid: str) -> dict[str, Any]:
            _, params = side.request_finished(Req(rid, {"do_remote_decode": True}, num_computed_tokens=70),
                                              [1, 2, 3])
            assert params is not None
            return params

        # prefill-a hands p1 off: its send waits in its service for the decode's expect
        handoff(prefill, "p1")
        a.save(prefill.build())
        # mallory's hand-off of p1, naming prefill-a's address, signed by herself
        forged = handoff(mallory, "p1")

        def load(rid: str, params: dict[str, Any], blocks: list[int]) -> bool | None:
            req = Req(rid, params)
            if decode.get_num_new_matched_tokens(req, 0) != (70, True):
                return None  # refused by the decode's scheduler: nothing reserved
            decode.update_state_after_alloc(req, blocks, 70)
            d.start(decode.build())
            return settled(d, rid)

        assert load("d-mallory", forged, [4, 5, 6]) is True  # failed: refused on the link
        assert refused(d, "identity_member") == 1 and d.counts["load_failed"] == 1
        assert d.load_errors() == {4, 5, 6}
        assert not a.engine.expected("p1@tp0.0")  # no Expect reached prefill-a
        assert all(not layer[4:7].any() for layer in d_kv.values())

        revoke(cluster.dir, [serial_of(m_files["identity_cert_file"])])
        monkeypatch.setattr(scheduler, "POLL_S", 0.0)
        assert load("d-revoked", handoff(mallory, "p2"), [4, 5, 6]) is None
        assert decode.counts["handoff_revoked"] == 1

        # prefill-a's own hand-off (of another request: this decode rank's failed load holds
        # p1's id among its results) loads from prefill-a byte-exact
        genuine = handoff(prefill, "p3")
        a.save(prefill.build())
        assert load("d-genuine", genuine, [5, 6, 7]) is False  # loaded
        for name, layer in d_kv.items():
            assert torch.equal(layer[5:8], a_kv[name][1:4]), name
        assert d.counts["loads_ok"] == 1
