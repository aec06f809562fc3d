"""Counters and the event-loop lag monitor behind ``status()`` and ``/metrics``."""

from __future__ import annotations

import bisect
import collections
import functools
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Self, TypedDict

import anyio
import anyio.abc

from ._log import Throttle
from ._peertimes import PEER_LABELS, PeerTimes
from ._results import TransferResult
from ._trust.identity import Member
from ._trust.revocation import expiry_warning

#: upper bounds (seconds) of the transfer-latency histogram buckets
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LAG_INTERVAL_S = 0.01
#: the lag monitor's sleep while no transfer is under way (``RequestPlane.moving``): a lag
#: then holds up no copy
LAG_IDLE_INTERVAL_S = 1.0
#: how landing checks end (``Stats.landings``, ``kvservice_landing_checks_total``)
LANDING_RESULTS = ("checked", "mismatched", "unchecked")


class RequestCounts(TypedDict):
    """What the request plane holds now (``ServiceStatus``'s share of it)."""

    sending: int  #: live sends
    receiving: int  #: live receives
    expects_before_send: int  #: early expects held for a send() not made yet
    unsettled_pages: int  #: pages of failed receives a WRITE may still land in
    inflight_handles: int  #: NIXL transfer handles the watchdog holds
    live_nixl_handles: int  #: handles the door's table holds (released ones leave it)
    staging_held_bytes: int  #: staging buffer bytes held by requests


class DiscoveryStatus(TypedDict):
    """``ServiceStatus.discovery`` with ``discovery = "etcd"``: the registry's own counts."""

    name: str  #: the name this service registers under
    cluster: str
    registered: bool  #: holds a lease now
    etcd: str | None  #: the endpoint it talks to now (None while none answers)
    members: int  #: live peers (this service not counted)
    lapsed: list[str]  #: members whose lease lapsed, not judged lost yet
    registrations: int  #: leases registered on (1 + re-registrations)
    outages: int  #: times etcd was found unreachable
    rewrites: int  #: own key found changed by another writer, and written again
    #: entries under the prefix that are no valid member, by why (every kind, zeros too):
    #: docs/cluster.md "What it reads, and what it ignores"
    ignored: dict[str, int]


@dataclass(frozen=True, slots=True)
class ServiceStatus(Mapping[str, Any]):
    """``status()``: a snapshot for operators, cheap enough to poll; read its attributes.

    It is also a read-only mapping of the same names (``status["outcomes"]``,
    ``{**status}``, ``dict(status)``: what crosses the sidecar's wire and goes into JSON),
    without ``discovery`` when that is None.  ``from_mapping`` reads one back, tolerant of
    a peer release's status (a name it lacks keeps its default, one it adds is dropped)."""

    sending: int = 0  #: live sends
    receiving: int = 0  #: live receives
    expects_before_send: int = 0  #: early expects held for a send() not made yet
    unsettled_pages: int = 0  #: pages of failed receives a WRITE may still land in
    inflight_handles: int = 0  #: NIXL transfer handles the watchdog holds
    live_nixl_handles: int = 0  #: handles the door's table holds (released ones leave it)
    staging_held_bytes: int = 0  #: staging buffer bytes held by requests
    outcomes: dict[str, int] = field(default_factory=dict)  #: "send.SUCCESS", "recv.PEER_LOST", ... -> count
    bytes_sent: int = 0
    bytes_received: int = 0
    stale_notifs: int = 0  #: notifications for no live request of their sender
    forced_releases: int = 0  #: handles the door released when their peer was unloaded
    #: "gathered", "fallback_full", "fallback_too_large" -> count
    staging: dict[str, int] = field(default_factory=dict)
    #: landing checks of received requests (``verify_landing``): "checked" (matched),
    #: "mismatched" (failed CORRUPTED), "unchecked" (the sender sent no checksum: INCOMPATIBLE)
    landings: dict[str, int] = field(default_factory=dict)
    #: what peers and workers tried and was refused, by kind (docs/security.md)
    refused: dict[str, int] = field(default_factory=dict)
    loop_lag_p99_s: float = 0.0
    loop_lag_max_s: float = 0.0
    #: by peer label: time per transfer and to post, counts and sums
    peer_times: dict[str, Any] = field(default_factory=dict)
    peers: list[str] = field(default_factory=list)  #: linked peers' addresses
    #: live links by the protocol version they speak ("5", "6"): how far a rolling upgrade is
    peer_versions: dict[str, int] = field(default_factory=dict)
    #: with ``discovery = "etcd"``: the registry's own
    discovery: DiscoveryStatus | None = None
    #: with an identity: set while this service's own certificate is within 14 days of its
    #: end (``_trust.revocation.expiry_warning``), saying when and what to do; else empty
    identity_warning: str = ""

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Self:
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})

    def __getitem__(self, key: str) -> Any:
        if key not in self._names() or (key == "discovery" and self.discovery is None):
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._names() if name != "discovery" or self.discovery is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def _names(self) -> tuple[str, ...]:
        return _field_names(type(self))


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


@dataclass
class Stats:
    #: (side, status or reason) -> count; side is "send" or "recv"
    outcomes: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    bytes: collections.Counter[str] = field(default_factory=collections.Counter)
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0
    latency_count: int = 0
    stale_notifs: int = 0
    #: what a peer or a worker tried and was refused, by kind ("auth", "hello_invalid",
    #: "frame", "outbox_overflow", "accept_error", ...): see docs/security.md
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    forced_releases: int = 0
    #: sends through the staging buffer ("gathered") and those that could not ("fallback_full":
    #: no free range; "fallback_too_large": more than the buffer): _transfer.staging
    staging: collections.Counter[str] = field(default_factory=collections.Counter)
    #: landing checks: "checked", "mismatched", "unchecked" (``_transfer.landing``)
    landings: collections.Counter[str] = field(default_factory=collections.Counter)
    #: refusals are all counted, but logged at most ``Throttle``'s burst per kind and window
    log_throttle: Throttle = field(default_factory=Throttle)
    lag_samples: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=3000))
    max_lag_s: float = 0.0
    #: time per transfer and time to post, by peer (``_peertimes``)
    peers: PeerTimes = field(default_factory=lambda: PeerTimes(PEER_LABELS))
    #: this service's own member (its certificate's end: ``identity_warning``), if it has one
    identity: Member | None = None

    def record(self, side: str, result: TransferResult, peer: str | None = None) -> None:
        """Count how ``result`` ended; ``peer``: the agent it went to or came from, if known."""
        key = "SUCCESS" if result.ok else (result.reason.value if result.reason else "UNKNOWN")
        self.outcomes[(side, key)] += 1
        if result.ok:
            self.bytes[side] += result.bytes
            if side == "send":
                d = result.duration_s
                self.latency_sum += d
                self.latency_count += 1
                self.latency_buckets[bisect.bisect_left(LATENCY_BUCKETS, d)] += 1
        if peer is not None:
            self.peers.transfer(side, peer, result)

    def refuse(self, what: str) -> int | None:
        """Count one refusal of kind ``what``.  Returns whether to log it (``Throttle``):
        ``None`` not, else how many of that kind went unlogged before it."""
        self.refused[what] += 1
        return self.log_throttle.allow(what)

    async def monitor_loop_lag(self, busy: Callable[[], bool] = lambda: True, *,
                               task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Sleep ``LAG_INTERVAL_S`` again and again (``LAG_IDLE_INTERVAL_S`` while ``busy()``
        says no transfer is under way); how late each wake-up is, is the lag."""
        task_status.started()
        while True:
            interval = LAG_INTERVAL_S if busy() else LAG_IDLE_INTERVAL_S
            t0 = time.perf_counter()
            await anyio.sleep(interval)
            lag = max(0.0, time.perf_counter() - t0 - interval)
            self.lag_samples.append(lag)
            self.max_lag_s = max(self.max_lag_s, lag)

    def lag_quantile(self, q: float) -> float:
        if not self.lag_samples:
            return 0.0
        ordered = sorted(self.lag_samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def snapshot(self, requests: RequestCounts, peers: list[str], peer_versions: dict[str, int],
                 discovery: DiscoveryStatus | None = None) -> ServiceStatus:
        return ServiceStatus(
            outcomes={f"{side}.{key}": n for (side, key), n in sorted(self.outcomes.items())},
            bytes_sent=self.bytes["send"],
            bytes_received=self.bytes["recv"],
            stale_notifs=self.stale_notifs,
            forced_releases=self.forced_releases,
            staging=dict(sorted(self.staging.items())),
            landings=dict(sorted(self.landings.items())),
            refused=dict(sorted(self.refused.items())),
            loop_lag_p99_s=self.lag_quantile(0.99),
            loop_lag_max_s=self.max_lag_s,
            peer_times=self.peers.snapshot(),
            peers=peers,
            peer_versions=peer_versions,
            sending=requests["sending"],
            receiving=requests["receiving"],
            expects_before_send=requests["expects_before_send"],
            unsettled_pages=requests["unsettled_pages"],
            inflight_handles=requests["inflight_handles"],
            live_nixl_handles=requests["live_nixl_handles"],
            staging_held_bytes=requests["staging_held_bytes"],
            discovery=discovery,
            identity_warning=(expiry_warning(self.identity) or "") if self.identity is not None else "",
        )
