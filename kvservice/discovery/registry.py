"""``Registry``: this service's registration in etcd, and the live view of its peers.

Registration.  ``/kvservice/<cluster>/services/<name>`` holds this service's ``Member``
on a lease (``etcd_ttl_s``), kept alive every ``etcd_keepalive_s``.  A lease found gone
(etcd revoked it: this service was cut off from etcd longer than the TTL, or etcd
resumed after a stop) is replaced: a new lease, the same name and incarnation.  The
value is written again when what it reports (linked peers, requests in flight) changed.

Membership.  The prefix is listed, then watched from the listed revision.  A peer's
key deleted (its lease lapsed, or it left) makes it *lapsed*; one that registers again
with the same incarnation within ``etcd_rejoin_grace_s`` was never lost: every lease
lapses at once when a stopped etcd resumes, and each service then registers again.
A lapse past the grace, or a registration with a new incarnation (the process
restarted), calls ``on_lost``: the service drops what it linked to that member because
the engine named it (``attach.Discovery``), through the control plane's own peer-lost
path; a registration's word about an agent nobody named it for drops nothing.  A
lapse is not proof that the process is gone, so it settles nothing (docs/settle.md).
Lapses are judged only while the watch runs: without etcd this service knows nothing
new, and drops nobody.

etcd is not on the data path.  Losing it stops nothing but this loop, which retries
with backoff (logged, throttled) and lists again when it is back.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import anyio.abc

from .._log import get_logger
from .._stats import DiscoveryStatus, Stats
from .._trust.identity import Identity
from . import member as members
from ._etcd import Etcd, EtcdOptions, EtcdUnavailable, Event
from .member import Ignored, Member
from .settings import DiscoverySettings
from .signing import Verifier, sign

log = get_logger("kvservice.discovery")

#: backoff between attempts to reach etcd again
RETRY_MIN_S = 0.2
RETRY_MAX_S = 5.0


class DiscoveryUnavailable(EtcdUnavailable):
    """etcd could not be reached at start and ``etcd_unreachable = "fail"``.

    Raised out of starting the service (``async with``): start etcd, or set
    ``etcd_unreachable = "wait"`` to start anyway and register once it answers."""


@dataclass
class _Lapse:
    member: Member
    since: float


def options(cfg: DiscoverySettings) -> EtcdOptions:
    password = None
    if cfg.etcd_password_file is not None:
        with open(cfg.etcd_password_file) as f:
            password = f.read().strip()
    return EtcdOptions(cfg.etcd_endpoints, cfg.etcd_connect_timeout_s, ca_file=cfg.etcd_ca_file,
                       cert_file=cfg.etcd_cert_file, key_file=cfg.etcd_key_file,
                       username=cfg.etcd_username, password=password)


class Registry:
    def __init__(self, cfg: DiscoverySettings, me: Callable[[], Member], on_lost: Callable[[Member, str], None],
                 stats: Stats, identity: Identity | None = None, allow_unsigned: bool = False) -> None:
        self._cfg = cfg
        self._identity = identity
        self._verifier = Verifier(identity, cfg.cluster, allow_unsigned)
        self._me = me
        self._on_lost = on_lost
        self._stats = stats
        self._prefix = members.services_prefix(cfg.cluster)
        self.name = me().name
        self._key = self._prefix + self.name
        self.members: dict[str, Member] = {}  # live peers by name (not this service)
        self._lapsed: dict[str, _Lapse] = {}
        self._watching = False
        self._lease: int | None = None
        self._leaving = False  # leave() began: nothing is registered or written from then on
        self._written: bytes | None = None  # the value last written to our key (set before the write)
        self._written_member: Member | None = None  # what that value said, before it was signed
        self._written_at = 0  # the store's revision after that write
        self._overwritten = anyio.Event()  # our key changed under us: the keep-alive writes it again
        self._etcd: Etcd | None = None
        self.registrations = 0  # leases this service registered on (1 + re-registrations)
        self.outages = 0
        self.rewrites = 0  # our key found overwritten or deleted while our lease lived, and written again
        self.ignored: collections.Counter[str] = collections.Counter()  # entries ignored, by why

    # -- what the service asks ------------------------------------------------------
    def member(self, name: str) -> Member | None:
        """The peer registered as ``name``: a live member, or one whose lease lapsed and that
        is not judged lost yet (within the grace: etcd resuming lapses every lease at once)."""
        m = self.members.get(name)
        if m is None and name in self._lapsed:
            m = self._lapsed[name].member
        return m

    def live(self, role: str | None = None) -> list[Member]:
        return sorted((m for m in self.members.values() if role is None or m.role == role), key=lambda m: m.name)

    def status(self) -> DiscoveryStatus:
        return DiscoveryStatus(
            name=self.name, cluster=self._cfg.cluster, registered=self._lease is not None,
            etcd=self._etcd.endpoint if self._etcd is not None else None, members=len(self.members),
            lapsed=sorted(self._lapsed), registrations=self.registrations, outages=self.outages,
            rewrites=self.rewrites, ignored={why: self.ignored[why] for why in members.IGNORED})

    # -- the loop ---------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled.  Returns to ``task_status`` once registered; at start, an
        unreachable etcd raises ``DiscoveryUnavailable`` (``etcd_unreachable = "fail"``) or
        is retried (``"wait"``), each miss logged."""
        started = False
        retry = RETRY_MIN_S
        while True:
            try:
                self._etcd = await Etcd.connect(options(self._cfg))
                try:
                    await self._register()
                    revision = await self._resync()
                    if not started:
                        started = True
                        task_status.started()
                    else:
                        log.info("discovery.etcd_back", endpoint=self._etcd.endpoint, members=len(self.members))
                    retry = RETRY_MIN_S
                    try:
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(self._keepalive)
                            tg.start_soon(self._judge_lapses)
                            await self._watch(revision)
                    except BaseExceptionGroup as group:  # the keep-alive's or the watch's: etcd is gone
                        raise _unavailable(group) from None
                finally:
                    self._watching = False
                    etcd, self._etcd = self._etcd, None
                    await etcd.close()
            except EtcdUnavailable as exc:
                if not started and self._cfg.etcd_unreachable == "fail":
                    raise DiscoveryUnavailable(
                        f"discovery: cannot reach etcd at {', '.join(self._cfg.etcd_endpoints)} ({exc}); "
                        "not starting (etcd_unreachable = \"fail\"; \"wait\" retries instead)") from exc
                self.outages += 1
                if self._stats.refuse("etcd_unreachable") is not None:
                    log.warning("discovery.etcd_unreachable", endpoints=list(self._cfg.etcd_endpoints),
                                error=str(exc), registered=started, retry_in_s=retry,
                                detail="transfers go on; membership is frozen until etcd answers")
                await anyio.sleep(retry)
                retry = min(retry * 2, RETRY_MAX_S)

    async def _register(self) -> bool:
        """Keep the lease when etcd still has it, else a new one; write our member.
        Whether the lease was kept."""
        assert self._etcd is not None
        if self._lease is not None and await self._etcd.keepalive(self._lease) > 0:
            await self._write(force=True)
            return True
        if self._leaving:
            return False
        if self._lease is not None:
            log.warning("discovery.lease_lapsed", name=self.name, detail="registering again on a new lease")
        self._lease = None
        lease = await self._etcd.grant(int(self._cfg.etcd_ttl_s))
        if self._leaving:  # left while the lease was granted: it must not register us again
            with contextlib.suppress(EtcdUnavailable):
                await self._etcd.revoke(lease)
            return False
        self._lease = lease
        await self._write(force=True)
        self.registrations += 1
        log.info("discovery.registered", name=self.name, key=self._key, lease=lease, ttl_s=self._cfg.etcd_ttl_s,
                 endpoint=self._etcd.endpoint)
        return False

    def rotated(self, identity: Identity) -> None:
        """This member's certificate was rotated (``_trust.rotation``): its entry is signed
        under ``identity`` from now on, written again at the next keep-alive."""
        self._identity = identity
        self._written_member = None

    async def _write(self, force: bool = False) -> None:
        assert self._etcd is not None
        if self._lease is None:  # leaving (leave() dropped it while we awaited etcd): nothing to write
            return
        me = self._me()
        if force or me != self._written_member:
            signed = me if self._identity is None else sign(self._identity, self._cfg.cluster, self._key.encode(), me)
            value = members.encode(signed)
            self._written, self._written_member = value, me  # before the write: its watch event may come first
            self._written_at = await self._etcd.put(self._key, value, self._lease)

    async def _keepalive(self) -> None:
        """Every keep-alive, or at once when our key was changed under us (``_mine``).  A
        rewrite is followed by a whole keep-alive interval before the next can happen:
        two services configured with one name take turns at that pace, not faster."""
        assert self._etcd is not None
        while True:
            with anyio.move_on_after(self._cfg.etcd_keepalive_s):
                await self._overwritten.wait()
            if self._lease is not None and self._overwritten.is_set():
                self._overwritten = anyio.Event()
                if await self._register():
                    self.rewrites += 1
                    if self._stats.refuse("discovery_own_key") is not None:
                        log.warning("discovery.own_key_rewritten", name=self.name, key=self._key,
                                    detail="this service's registration was changed or deleted by another "
                                           "writer; written again")
                await anyio.sleep(self._cfg.etcd_keepalive_s)
            if self._lease is None:  # leaving: the lease is revoked (its key's deletion may have woken us)
                return
            if await self._etcd.keepalive(self._lease) > 0:
                await self._write()
            else:
                await self._register()

    async def _resync(self) -> int:
        """List the prefix: the view becomes what etcd holds now."""
        assert self._etcd is not None
        revision, entries = await self._etcd.list(self._prefix)
        mine = self._key.encode()
        self._mine(next((e.value for e in entries if e.key == mine), None), revision=0)
        found, ignored = members.read_listing((e for e in entries if e.key != mine), self._prefix, self._claims(),
                                              self._verifier.check)
        for key, why in ignored:
            self._ignore(key, why)
        seen = {m.name: m for m in found}
        for name in set(self.members) - set(seen):
            self._lapse(name)
        for m in seen.values():
            self._put(m)
        return revision

    async def _watch(self, revision: int) -> None:
        assert self._etcd is not None
        async with self._etcd.watch(self._prefix, revision + 1) as events:
            self._watching = True
            async for ev in events:
                self._apply(ev)

    def _apply(self, ev: Event) -> None:
        name = members.name_of(ev.key, self._prefix)
        if isinstance(name, Ignored):
            if ev.kind == "PUT":  # its deletion was counted when it was put
                self._ignore(ev.key, name)
            return
        if name == self.name:
            self._mine(ev.value if ev.kind == "PUT" else None, ev.revision)
            return
        if ev.kind == "DELETE":
            self._lapse(name)
            return
        m = members.read(ev.key, ev.value, self._prefix)
        if isinstance(m, Member):
            m = self._verifier.check(ev.key, m)
        if isinstance(m, Member) and members.claimed_elsewhere(m, self._claims()):
            m = Ignored("agent_taken", f"agent {m.agent!r} is another member's")
        if isinstance(m, Ignored):
            self._ignore(ev.key, m)
            return
        self._put(m)

    def _claims(self) -> dict[str, str]:
        """Agent -> name of every member known, lapsed ones and this service included."""
        claims = {lapse.member.agent: name for name, lapse in self._lapsed.items()}
        claims.update((m.agent, name) for name, m in self.members.items())
        claims[self._me().agent] = self.name
        return claims

    def _mine(self, value: bytes | None, revision: int) -> None:
        """Our key as etcd now holds it (``None``: deleted), at ``revision`` (0: now).  Not
        what we wrote, and newer than our last write: another writer changed it, or our
        lease lapsed; the keep-alive writes it again (``_keepalive``)."""
        if value is not None and value == self._written:
            return
        if revision and revision <= self._written_at:  # an older event of ours
            return
        other = members.read(self._key.encode(), value, self._prefix) if value is not None else None
        if isinstance(other, Member) and other.agent != self._me().agent:
            if self._stats.refuse("discovery_name_taken") is not None:
                log.error("discovery.name_taken", name=self.name, agent=other.agent,
                          detail="another service registered under this service's name")
        self._overwritten.set()

    def _ignore(self, key: bytes, why: Ignored) -> None:
        """Count an entry ignored for ``why``; logged (throttled), never raised."""
        self.ignored[why.why] += 1
        if self._stats.refuse("discovery_member") is not None:
            log.warning("discovery.member_invalid", key=members.shown(key, self._prefix), why=why.why,
                        error=why.detail, detail="an entry under the services prefix that is no valid member: "
                                                 "ignored (counted in status()['discovery']['ignored'])")

    def _put(self, m: Member) -> None:
        old = self.members.get(m.name)
        lapse = self._lapsed.pop(m.name, None)
        before = old or (lapse.member if lapse is not None else None)
        if before is not None and (before.incarnation != m.incarnation or before.agent != m.agent):
            log.warning("discovery.peer_restarted", peer=m.name, old_agent=before.agent, agent=m.agent,
                        address=m.address)
            self._on_lost(before, f"{m.name} registered again as a new incarnation ({m.agent})")
        elif lapse is not None:
            log.info("discovery.peer_rejoined", peer=m.name, agent=m.agent, after_s=time.monotonic() - lapse.since)
        elif old is None:
            log.info("discovery.peer_joined", peer=m.name, role=m.role, address=m.address, agent=m.agent)
        self.members[m.name] = m

    def _lapse(self, name: str) -> None:
        old = self.members.pop(name, None)
        if old is not None and name not in self._lapsed:
            self._lapsed[name] = _Lapse(old, time.monotonic())

    async def _judge_lapses(self) -> None:
        """A lapse older than the grace, seen while the watch runs, is a loss."""
        grace = self._cfg.etcd_rejoin_grace_s
        while True:
            await anyio.sleep(min(grace / 4, 0.5))
            if not self._watching:
                continue
            now = time.monotonic()
            for name, lapse in list(self._lapsed.items()):
                if now - lapse.since >= grace:
                    del self._lapsed[name]
                    log.warning("discovery.peer_lapsed", peer=name, agent=lapse.member.agent,
                                detail="its lease lapsed and it did not register again: the requests named to "
                                       "it fail PEER_LOST; nothing is settled by this")
                    self._on_lost(lapse.member, f"{name}'s etcd lease lapsed")

    async def leave(self) -> None:
        """Deregister (revoke the lease), bounded by the connect timeout; best effort."""
        etcd, lease = self._etcd, self._lease
        self._leaving = True
        self._lease = None
        if etcd is not None and lease is not None:
            try:
                await etcd.revoke(lease)
            except EtcdUnavailable as exc:
                log.info("discovery.leave_failed", name=self.name, error=str(exc),
                         detail="the lease lapses on its own within the TTL")


def _unavailable(group: BaseExceptionGroup[BaseException]) -> EtcdUnavailable:
    """The first ``EtcdUnavailable`` of ``group``; the group itself when anything else is in it."""
    unavailable, rest = group.split(EtcdUnavailable)
    if rest is not None or unavailable is None:
        raise group
    first: BaseException = unavailable
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    assert isinstance(first, EtcdUnavailable)
    return first


def incarnation() -> int:
    """This start of a service: later starts on a host have larger ones."""
    return time.time_ns()
