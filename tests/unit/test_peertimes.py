"""The per-peer histograms' bookkeeping: the label bound, who keeps a label, the
post call timed on the door's side, and the setting's refusals."""

from __future__ import annotations

import pytest

from kvservice import ConfigError, ServiceConfig
from kvservice._nixl.door import DoorError, PostOp, TickPlan, run_tick
from kvservice._peertimes import OTHER, POST_BUCKETS, XFER_BUCKETS, PeerTimes
from kvservice._results import FailureReason, TransferResult, TransferStatus
from kvservice._stats import Stats
from tests.helpers import SMALL, pool_table

from .test_fake_door import indices, pair


def ok(seconds: float) -> TransferResult:
    return TransferResult(request_id="r", status=TransferStatus.SUCCESS, created_at=0.0, started_at=1.0,
                          finished_at=1.0 + seconds)


FAILED = TransferResult(request_id="f", status=TransferStatus.FAILED, reason=FailureReason.PEER_LOST, message="lost")


def test_each_peer_its_own_series_by_address_both_sides() -> None:
    stats = Stats(peers=PeerTimes(4))
    stats.peers.linked("agent-a", "10.0.0.1:5000")
    stats.peers.linked("agent-b", "10.0.0.2:5000")
    stats.record("send", ok(0.003), "agent-a")
    stats.record("recv", ok(0.0004), "agent-a")
    stats.record("send", FAILED, "agent-b")
    stats.record("send", FAILED)  # never reached a peer: not counted per peer
    times = stats.peers.snapshot()  # what status()["peer_times"] carries
    assert set(times) == {"10.0.0.1:5000", "10.0.0.2:5000"}
    send = times["10.0.0.1:5000"]["xfer_time"]["send"]
    assert send["count"] == 1 and send["sum_s"] == pytest.approx(0.003)
    buckets, total = stats.peers.histograms()["10.0.0.1:5000"]["xfer_time"]["send"]
    assert total == pytest.approx(0.003)
    assert [le for le, _ in buckets] == [*map(repr, XFER_BUCKETS), "+Inf"]
    assert dict(buckets)["0.0025"] == 0 and dict(buckets)["0.005"] == 1 and dict(buckets)["+Inf"] == 1
    assert times["10.0.0.1:5000"]["xfer_time"]["recv"]["count"] == 1
    assert times["10.0.0.2:5000"]["failed"] == {"send": 1, "recv": 0}
    assert times["10.0.0.2:5000"]["xfer_time"]["send"]["count"] == 0  # a failure is not timed


def test_past_the_bound_peers_share_other_and_a_restart_keeps_its_label() -> None:
    times = PeerTimes(1)
    times.linked("a1", "a:1")
    times.linked("b1", "b:1")  # a is still linked: b has no label of its own
    times.transfer("send", "b1", ok(0.01))
    times.lost("a1")
    times.linked("a2", "a:1")  # a restarted (new agent, same address): its label again
    times.transfer("send", "a2", ok(0.01))
    assert set(times.series) == {"a:1", OTHER}
    assert times.series["a:1"].xfer["send"].count == 1
    assert times.series[OTHER].xfer["send"].count == 1


def test_a_gone_peers_series_stay_until_a_new_peer_needs_the_label() -> None:
    times = PeerTimes(2)
    for agent, address in (("a", "a:1"), ("b", "b:1")):
        times.linked(agent, address)
        times.transfer("send", agent, ok(0.01))
    times.lost("a")
    times.lost("b")
    assert set(times.series) == {"a:1", "b:1"}  # gone, still there
    times.linked("c", "c:1")  # both labels taken: the one gone longest (a) makes room
    assert set(times.series) == {"b:1", "c:1", OTHER}
    assert times.series[OTHER].xfer["send"].count == 1  # a's counts, so sums never go down
    times.transfer("send", "c", ok(0.01))
    assert times.series["c:1"].xfer["send"].count == 1
    times.transfer("send", "a", ok(0.01))  # an agent no longer linked: under other
    assert times.series[OTHER].xfer["send"].count == 2
    assert len(times._agents) == 1  # only linked agents are remembered


def test_no_labels_all_other() -> None:
    times = PeerTimes(0)
    times.linked("a", "a:1")
    times.posts([("a", 0.0001)])
    assert set(times.series) == {OTHER} and times.series[OTHER].post.count == 1
    assert times.series[OTHER].post.bounds == POST_BUCKETS


def test_run_tick_times_each_post_call_failed_or_not() -> None:
    _, a, b, pa, _ = pair()
    b.add_peer("a", a.metadata(), pool_table(SMALL, pa.base_addr))
    plan = TickPlan(posts=[PostOp("k1", "a", indices([1]), indices([2]), b"n"),
                           PostOp("k2", "nobody", indices([1]), indices([2]), b"n")])
    out = run_tick(b, plan)
    assert isinstance(out.posted[1][1], DoorError)  # not loaded: the call failed, and was timed
    assert [peer for peer, _ in out.post_times] == ["a", "nobody"]
    assert all(seconds >= 0 for _, seconds in out.post_times)


@pytest.mark.parametrize("value", [-1, 1025, 1.5, True, "8", None])
def test_metrics_peer_labels_refuses_bad_values(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^metrics_peer_labels: must be a whole number 0\.\.1024"):
        ServiceConfig(metrics_peer_labels=value)  # type: ignore[arg-type]


def test_metrics_peer_labels_bounds_accepted() -> None:
    assert ServiceConfig().metrics_peer_labels == 32
    assert ServiceConfig(metrics_peer_labels=0).metrics_peer_labels == 0
    assert ServiceConfig(metrics_peer_labels=1024).metrics_peer_labels == 1024
