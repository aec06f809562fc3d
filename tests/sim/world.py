"""The simulated world: one prefill and two decodes (real ``TransferService``s, watchdogs
and control planes) over a ``FakeFabric`` and an in-memory network, on one virtual-time
loop, driven by one seeded scheduler that injects faults and checks invariants after
every step.  ``run_seed(seed)`` is the whole thing; a violation raises ``SimFailure``
naming the seed and the step.
"""

from __future__ import annotations

import collections
import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import numpy as np
import numpy.typing as npt
import structlog
import torch

from kvservice import ServiceConfig, TransferService
from kvservice._control.protocol import FENCE, ChunkNotif, Settled, encode_notif, peek_notif
from kvservice._nixl.door import DoorError, LocalTable
from kvservice._results import FailureReason, KVServiceError, TransferResult, UnknownRequestError
from kvservice._transfer.ends import FENCE_TRIES
from kvservice._transfer.plane import RequestPlane
from kvservice._transfer.requests import RecvRequest, SendRequest
from kvservice.testing import pattern
from kvservice.testing.fake_door import FakeDoor, FakeFabric, Mode, copy
from kvservice.testing.inspect import inside
from tests.helpers import SMALL

from .inline import InlineDoorThread
from .memnet import MemNet
from .vtime import VirtualLoop, patched_clock

PORT = 7000
ROLES = {"p0": "10.0.0.1", "d1": "10.0.0.2", "d2": "10.0.0.3"}
DECODES = ("d1", "d2")
PREFILL = "p0"
NUM_PAGES = SMALL.num_pages
#: how long past its deadline a live request may linger before it counts as stuck
DEADLINE_SLACK_S = 0.1
#: how long an undisturbed failed receiver request may stay unsettled
SETTLE_BOUND_S = 1.0
#: what a step lets pass (virtual seconds) after its action
STEP_DTS = (0.0, 0.0005, 0.002, 0.01, 0.03, 0.1, 0.3)
#: reasons a NIXL post or check may fail with
NIXL_REASONS = (FailureReason.REMOTE_DISCONNECT, FailureReason.BACKEND, FailureReason.CANCELLED)


def _stalled(door: FakeDoor) -> bool:
    """Whether ``door`` is hung (transfers stay in flight until ``finish_hung``)."""
    return door._mode is Mode.HANG or any(x.checks_left is None for x in door._live.values())


async def _no_lag_monitor(busy: Callable[[], bool] | None = None, *,
                          task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    task_status.started()


class SimFailure(AssertionError):
    pass


def _resumed_at(proc: Proc | None) -> float:
    """When ``proc``'s hung NIXL last resumed: its hung WRITEs finished, or landed before a
    later WRITE's notification."""
    if proc is None:
        return 0.0
    door = proc.door
    return max(proc.resumed_at, door.resumed_at if isinstance(door, SimDoor) else 0.0)


def sim_config(host: str) -> ServiceConfig:
    return ServiceConfig(
        layout=SMALL, host=host, port=PORT, allow_unauthenticated=True,
        bootstrap_timeout_s=1.0, transfer_timeout_s=1.0, arrival_timeout_s=1.5,
        connect_timeout_s=0.3, heartbeat_interval_s=0.1, peer_timeout_s=0.35,
        idle_poll_interval_s=0.05, drain_grace_s=0.2, unknown_expect_ttl_s=1.0,
    )



def plane_of(svc: TransferService) -> RequestPlane | None:
    """``svc``'s request plane, or None before it ever started."""
    return inside(svc).plane if inside(svc).started else None

@dataclass(eq=False)
class _Zombie:
    """A released WRITE that keeps copying (NIXL's release does not stop one under way)."""

    xfer: Any  # its descriptor tables are the ones of when it was posted
    endpoint: int  # which load of the peer (a later load is a new endpoint)


class SimDoor(FakeDoor):
    """A ``FakeDoor`` that reports every byte copy to the world before making it, and
    models what the real door cannot prevent: a WRITE released while under way may still
    land later (a *zombie*), until a later notification on the same endpoint (NIXL
    flushes the endpoint before delivering one) or the end of this process."""

    def __init__(self, fabric: SimFabric, agent_name: str) -> None:
        super().__init__(fabric, agent_name)
        self._sim = fabric.world
        self.zombies: list[_Zombie] = []
        self.endpoints: collections.Counter[str] = collections.Counter()
        self._endpoint_of: dict[Any, int] = {}  # xid -> the load of its peer it was posted on
        self.resumed_at = 0.0  # when a later WRITE's flush last landed a hung one

    def add_peer(self, name: str, metadata: bytes, table: npt.NDArray[np.uint64],
                 local: LocalTable | None = None) -> None:
        super().add_peer(name, metadata, table, local)
        self.endpoints[name] += 1

    def release(self, xfer: Any) -> bool:
        live = self._live.get(xfer)
        if live is not None:
            self._maybe_zombie(live)
        return super().release(xfer)

    def remove_peer(self, name: str, *, keep_loaded: bool = False) -> list[Any]:
        for live in [x for x in self._live.values() if x.peer == name]:
            self._maybe_zombie(live)
        return super().remove_peer(name, keep_loaded=keep_loaded)

    def _maybe_zombie(self, xfer: Any) -> None:
        if xfer.peer in self._peers and self._sim.zombies and self._sim.rng.random() < 0.5:
            self.zombies.append(_Zombie(xfer, self.endpoints[xfer.peer]))
            self._sim.log(f"zombie {self.agent_name} xfer {xfer.xid}")

    def _land(self, z: _Zombie) -> None:
        target = self._fabric.lookup(z.xfer.peer)
        if target is None or target._pool is None or self._pool is None or self._closed:
            return  # the receiver's agent (its registration) is gone, or ours
        self._sim.on_write(self.agent_name, z.xfer.peer, z.xfer.notif, z.xfer.remote_idx, zombie=True)
        copy(*z.xfer.tables, z.xfer.local_idx.tolist(), z.xfer.remote_idx.tolist())

    def _flush(self, peer: str) -> None:
        """A notification to ``peer`` is about to be delivered: every earlier WRITE on
        this endpoint lands first."""
        keep = []
        for z in self.zombies:
            if z.xfer.peer == peer and z.endpoint == self.endpoints[peer]:
                self._land(z)
            else:
                keep.append(z)
        self.zombies = keep

    def notifs(self) -> Any:
        if self.zombies and self._sim.rng.random() < 0.3:
            self._land(self.zombies.pop(0))  # one lands, some time later
        return super().notifs()

    def close(self) -> None:
        self.zombies.clear()  # the process is gone: its WRITEs with it
        super().close()

    def post(self, peer: str, local_idx: Any, remote_idx: Any, notif: bytes) -> Any:
        if self._post_errors:
            self._sim.on_door_error(self.agent_name, notif, "post")
        got = super().post(peer, local_idx, remote_idx, notif)
        self._endpoint_of[got[0]] = self.endpoints[peer]
        n = peek_notif(notif)
        if n is not None and n.chunk != FENCE:
            self._sim.posted.add(n.request_id)  # a WRITE of it exists
        return got

    def check(self, xfer: Any) -> Any:
        live = self._live.get(xfer)
        if live is not None and self._check_errors and not live.landed:
            self._sim.on_door_error(self.agent_name, live.notif, "check")
        return super().check(xfer)

    def _complete(self, xfer: Any) -> None:
        target = self._fabric.lookup(xfer.peer)
        if target is not None and target._pool is not None and not xfer.landed:
            self._flush(xfer.peer)
            # the flush before this notification waits for every WRITE posted before it on
            # this endpoint, still in flight or not: each lands (bytes, then its own notif)
            # first, and its handle says DONE when next checked
            endpoint = self._endpoint_of.get(xfer.xid, self.endpoints[xfer.peer])  # (posted just now)
            for early in sorted(self._live.values(), key=lambda x: x.xid):
                if early.xid >= xfer.xid:
                    break
                if early.peer == xfer.peer and not early.landed and self._endpoint_of.get(early.xid) == endpoint:
                    if early.checks_left is None:  # it was hung: the stall ends here
                        self.resumed_at = self._sim.now
                    self._sim.on_write(self.agent_name, early.peer, early.notif, early.remote_idx)
                    copy(*early.tables, early.local_idx.tolist(), early.remote_idx.tolist())
                    target._inbox[self.agent_name].append(early.notif)
                    early.landed, early.checks_left = True, 1
            self._sim.on_write(self.agent_name, xfer.peer, xfer.notif, xfer.remote_idx)
        super()._complete(xfer)


class SimFabric(FakeFabric):
    door_class = SimDoor  # type: ignore[assignment]  # SimDoor takes a SimFabric

    def __init__(self, world: World) -> None:
        super().__init__()
        self.world = world


@dataclass(eq=False)
class Proc:
    """One incarnation of a service process."""

    role: str
    inc: int
    svc: TransferService
    thread: InlineDoorThread
    free: list[int] = field(default_factory=lambda: list(range(NUM_PAGES)))
    state: str = "starting"  # starting, up, stopping, down, crashed, failed
    crashed: bool = False
    resumed_at: float = 0.0  # when its hung NIXL last resumed (finish_hung)
    stop: anyio.Event = field(default_factory=anyio.Event)
    tg: anyio.abc.TaskGroup | None = None

    @property
    def agent(self) -> str:
        return self.svc.agent_name

    @property
    def address(self) -> str:
        return f"{ROLES[self.role]}:{PORT}"

    @property
    def door(self) -> FakeDoor | None:
        door = inside(self.svc).door if inside(self.svc).started else None
        assert door is None or isinstance(door, FakeDoor)
        return door

    @property
    def running(self) -> bool:
        return self.state in ("up", "stopping")


@dataclass(eq=False)
class Req:
    rid: str
    npages: int
    chunks: list[int]
    sender: Proc | None
    receiver: Proc | None
    src: list[int]
    dst: list[int]
    pinned: bool
    #: a link or process fault touched its sender and receiver while it ran: the two may
    #: end disagreeing (the receiver cannot learn the sender's outcome; see the report)
    disturbed: bool = False


class World:
    def __init__(self, seed: int, steps: int, burst: bool = False) -> None:
        self.seed = seed
        self.steps = steps
        #: several actions per step, no time between them (more in flight when faults hit)
        self.burst = burst
        self.rng = random.Random(seed)
        self.loop: VirtualLoop | None = None
        self.trace: list[str] = []
        self.violations: list[str] = []
        self.fabric = SimFabric(self)
        self.net = MemNet()
        self.procs: dict[str, Proc] = {}
        self.all_procs: list[Proc] = []
        self.incarnations: collections.Counter[str] = collections.Counter()
        self.reqs: dict[str, Req] = {}
        self.finishes: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.settled_at: dict[tuple[str, str], float] = {}
        #: receiver requests that failed unsettled: (receiver agent, rid) -> (request, when)
        self.unsettled: dict[tuple[str, str], tuple[Req, float]] = {}
        #: unsettled requests whose sender's NIXL was last seen stalled (the bound restarts when it is not)
        self.stalled_keys: set[tuple[str, str]] = set()
        self.step = -1
        #: settle fences a NIXL error ate, by request: after FENCE_TRIES of them kvservice
        #: posts no other, and the receiver holds the pages until the sender exits
        self.fence_failures: collections.Counter[str] = collections.Counter()
        #: requests a post returned a handle for (a Settled(ok=False) for one is logged)
        self.posted: set[str] = set()
        #: released WRITEs may land later (SimDoor)
        self.zombies = True
        self._tg: anyio.abc.TaskGroup | None = None
        self._rid = 0

    # -- bookkeeping ------------------------------------------------------------------
    @property
    def replay(self) -> str:
        return f"pytest tests/sim --seed {self.seed}" + (" --burst" if self.burst else "")

    @property
    def now(self) -> float:
        assert self.loop is not None
        return self.loop.clock.now

    def log(self, what: str) -> None:
        self.trace.append(f"{self.now:.6f} {what}")

    def violation(self, what: str) -> None:
        self.violations.append(f"step {self.step} t={self.now:.6f}: {what}")
        self.log(f"VIOLATION {what}")

    def disturb(self, *agents: str) -> None:
        """A fault hit ``agents`` (or the link between two): mark the requests they carry."""
        for r in self.reqs.values():
            ends = {p.agent for p in (r.sender, r.receiver) if p is not None}
            if ends & set(agents):
                r.disturbed = True

    # -- instrumentation ---------------------------------------------------------------
    def _instrument(self, proc: Proc) -> None:
        plane = inside(proc.svc).plane  # instrumented once started: the plane exists from then on
        finish = plane.finish
        settlement = plane.settlement
        settle_recv = settlement.settle_recv

        def hooked_finish(req: SendRequest | RecvRequest, result: TransferResult) -> None:
            finish(req, result)
            self.on_finish(proc, req)

        def hooked_settle(request_id: str, agent: str | None = None, *, sender_ok: bool = False) -> bool:
            done = settle_recv(request_id, agent, sender_ok=sender_ok)
            if done:
                self.settled_at.setdefault((proc.agent, request_id), self.now)
                self.log(f"settle {proc.agent} {request_id} ok={sender_ok}")
            return done

        on_peer_lost = plane.inbound.on_peer_lost

        def hooked_peer_lost(agent: str, *args: Any) -> None:
            self.log(f"peer lost {proc.agent}: {agent} graceful={args[2]} gone={args[3]}")
            self.disturb(proc.agent, agent)
            on_peer_lost(agent, *args)

        send_to = plane.send_to

        def hooked_send_to(agent: str, msg: Any) -> None:
            if isinstance(msg, Settled) and not msg.ok and msg.request_id in self.posted:
                self.log(f"settled-after-post {proc.agent}->{agent} {msg.request_id}")
            send_to(agent, msg)

        plane.send_to = hooked_send_to  # type: ignore[method-assign]
        plane.inbound.on_peer_lost = hooked_peer_lost  # type: ignore[method-assign]
        plane.finish = hooked_finish  # type: ignore[method-assign]
        settlement.settle_recv = hooked_settle  # type: ignore[method-assign]

    def on_finish(self, proc: Proc, req: SendRequest | RecvRequest) -> None:
        result = req.result
        assert result is not None
        side = "send" if isinstance(req, SendRequest) else "recv"
        rid = req.request_id
        key = (proc.agent, side, rid)
        self.finishes[key] += 1
        reason = result.reason.value if result.reason else ""
        self.log(f"finish {proc.agent} {side} {rid} {result.status.value} {reason}")
        if self.finishes[key] > 1:
            self.violation(f"{rid} ended {self.finishes[key]} times on {proc.agent} ({side})")
        if isinstance(req, RecvRequest):
            if result.ok:
                assert req.pages is not None
                pages = req.pages.tolist()
                if not torch.equal(proc.svc.kv.pages(pages), pattern(SMALL, rid, len(pages))):
                    self.violation(f"{rid} SUCCESS on {proc.agent} but its pages {pages} do not hold its bytes")
            if result.settled:
                self.settled_at.setdefault((proc.agent, rid), self.now)
            elif rid in self.reqs:
                self.unsettled[(proc.agent, rid)] = (self.reqs[rid], self.now)
        elif result.ok:
            if not (req.last and req.dest is not None and req.pages_queued == req.dest.size
                    and req.chunks_done == req.chunks_posted and not req.pending and not req.inflight):
                self.violation(f"{rid} SUCCESS on sender {proc.agent} with chunks missing "
                               f"({req.chunks_done}/{req.chunks_posted} done, {len(req.pending)} pending)")

    def on_door_error(self, agent: str, notif: bytes, op: str) -> None:
        n = peek_notif(notif)
        if n is not None and n.chunk == FENCE:
            self.log(f"fence of {n.request_id} fails ({op})")
            self.fence_failures[n.request_id] += 1

    def on_write(self, src: str, dst: str, notif: bytes, remote_idx: npt.NDArray[np.int32], *,
                 zombie: bool = False) -> None:
        n = peek_notif(notif)
        pages = sorted(set((remote_idx % NUM_PAGES).tolist()))
        if n is None:
            self.violation(f"a WRITE from {src} to {dst} without a request's notification")
            return
        rid = n.request_id
        self.log(f"write {src}->{dst} {rid} chunk={n.chunk} pages={pages}{' (zombie)' if zombie else ''}")
        settled = self.settled_at.get((dst, rid))
        if settled is not None:
            self.violation(f"WRITE of {rid} (chunk {n.chunk}) from {src} landed in {dst} pages {pages} "
                           f"after the request settled there at t={settled:.6f}")
        r = self.reqs.get(rid)
        if r is None or r.receiver is None or r.receiver.agent != dst:
            self.violation(f"WRITE of {rid} from {src} into {dst}, which is not its receiver")
        elif not set(pages) <= set(r.dst):
            self.violation(f"WRITE of {rid} from {src} into {dst} pages {pages}, outside its pages {r.dst}")

    def _capture_log(self, logger: Any, method: str, event: dict[str, Any]) -> Any:
        if event.get("event") == "transfer.settled_by_loss" and "refuses" in str(event.get("why")):
            agent = str(event.get("agent"))
            if self.fabric.lookup(agent) is not None:  # its NIXL agent (its process) still lives
                self.log(f"settled-by-refusal while {agent} lives")
        if method in ("error", "critical", "exception") or event.get("exc_info"):
            self.violation(f"kvservice logged an error: {event}")
        self.log(f"log {event.get('event')}")
        raise structlog.DropEvent

    # -- processes ---------------------------------------------------------------------
    async def start_proc(self, role: str) -> Proc:
        assert self._tg is not None
        self.incarnations[role] += 1
        inc = self.incarnations[role]
        agent = f"{role}-i{inc}"
        thread = InlineDoorThread()
        svc = TransferService(sim_config(ROLES[role]), door_factory=self.fabric.factory,
                              thread_factory=lambda: thread, transport=self.net.transport(agent))
        svc.agent_name = agent  # deterministic names, for the trace
        svc.stats.monitor_loop_lag = _no_lag_monitor  # type: ignore[method-assign]  # no loop lag in virtual time
        proc = Proc(role, inc, svc, thread)
        self.procs[role] = proc
        self.all_procs.append(proc)
        self.log(f"start {agent}")
        await self._tg.start(self._host, proc)
        return proc

    async def _host(self, proc: Proc, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        svc = proc.svc
        async with anyio.create_task_group() as tg:
            proc.tg = tg
            try:
                await svc.__aenter__()
            except Exception as exc:  # noqa: BLE001 - reported as a violation
                self.violation(f"{proc.agent} failed to start: {exc!r}")
                proc.state = "failed"
                task_status.started()
                return
            self._instrument(proc)  # its plane exists once started; it holds no request before
            proc.state = "up"
            task_status.started()
            cancelled: BaseException | None = None
            try:
                await proc.stop.wait()
            except BaseException as exc:  # noqa: BLE001 - the service's own group cancelled (a crash)
                cancelled = exc
            group = inside(svc).task_group
            if proc.crashed or cancelled is not None:
                if not proc.crashed and not (self._tg and self._tg.cancel_scope.cancel_called):
                    self.violation(f"{proc.agent}'s task group ended by itself: {cancelled!r}")
                group.cancel_scope.cancel()
                info = (type(cancelled), cancelled, cancelled.__traceback__) if cancelled else (None, None, None)
                try:
                    swallowed = await group.__aexit__(*info)
                except BaseException as exc:  # noqa: BLE001
                    if not isinstance(exc, anyio.get_cancelled_exc_class()):
                        self.violation(f"{proc.agent} crashed with {exc!r}")
                    swallowed = True
                if cancelled is not None and not swallowed:
                    raise cancelled
            else:
                try:
                    await svc.__aexit__(None, None, None)
                except Exception as exc:  # noqa: BLE001
                    self.violation(f"{proc.agent} shutdown raised {exc!r}")
            tg.cancel_scope.cancel()
        if proc.state != "crashed":
            proc.state = "down"
        self.log(f"down {proc.agent}")

    def crash(self, proc: Proc) -> None:
        """SIGKILL: the door closes (NIXL releases everything, the agent leaves the fabric),
        the kernel closes the sockets, and the process's code never runs again."""
        self.log(f"crash {proc.agent}")
        self.disturb(proc.agent)
        proc.crashed = True
        proc.state = "crashed"
        proc.thread.kill()
        if proc.door is not None:
            proc.door.close()
        self.net.kill(proc.agent)
        proc.stop.set()
        if proc.tg is not None:
            proc.tg.cancel_scope.cancel()

    def shutdown(self, proc: Proc) -> None:
        self.log(f"shutdown {proc.agent}")
        self.disturb(proc.agent)
        proc.state = "stopping"
        proc.stop.set()

    # -- engine ------------------------------------------------------------------------
    def new_request(self) -> None:
        p = self.procs[PREFILL]
        ups = [self.procs[d] for d in DECODES if self.procs[d].state == "up"]
        sender = p if p.state == "up" else None
        receiver = self.rng.choice(ups) if ups else None
        shape = self.rng.random()
        if shape < 0.05:
            receiver = None  # nobody expects it: bootstrap timeout
        elif shape < 0.1:
            sender = None  # nobody sends it: the early expect expires, the arrival times out
        if sender is None and receiver is None:
            return
        npages = self.rng.randint(1, 8)
        if (sender and len(sender.free) < npages) or (receiver and len(receiver.free) < npages):
            return
        self._rid += 1
        rid = f"r{self._rid}"
        src = self._take(sender, npages)
        dst = self._take(receiver, npages)
        cuts = sorted(self.rng.sample(range(1, npages), self.rng.randint(0, min(2, npages - 1))))
        chunks = [b - a for a, b in zip([0, *cuts], [*cuts, npages], strict=True)]
        r = Req(rid, npages, chunks, sender, receiver, src, dst, pinned=self.rng.random() < 0.3)
        self.reqs[rid] = r
        self.log(f"request {rid} {npages}p chunks={chunks} {sender and sender.agent}->{receiver and receiver.agent}")
        first = self.rng.random() < 0.5
        delay = self.rng.choice((0.0, 0.0, 0.001, 0.01, 0.2))
        if sender is not None and sender.tg is not None:
            sender.tg.start_soon(self._sender, r, 0.0 if first else delay)
        if receiver is not None and receiver.tg is not None:
            receiver.tg.start_soon(self._receiver, r, delay if first else 0.0)

    def _take(self, proc: Proc | None, n: int) -> list[int]:
        if proc is None:
            return []
        pages = sorted(self.rng.sample(proc.free, n))
        for page in pages:
            proc.free.remove(page)
        return pages

    async def _sender(self, r: Req, delay: float) -> None:
        proc = r.sender
        assert proc is not None
        svc = proc.svc
        await anyio.sleep(delay)
        svc.kv.write(r.src, pattern(SMALL, r.rid, r.npages))
        handle = None
        off = 0
        try:
            for i, n in enumerate(r.chunks):
                if i:
                    await anyio.sleep(self.rng.choice((0.0, 0.001, 0.02)))
                receiver = r.receiver.address if r.pinned and r.receiver is not None and i == 0 else None
                handle = await svc.send(r.rid, r.src[off:off + n], last=i == len(r.chunks) - 1, receiver=receiver)
                off += n
        except KVServiceError as exc:
            self.log(f"send {r.rid} refused: {exc}")
        if handle is not None:
            result = await svc.await_completion(handle)
            if not result.ok and not result.settled:
                self.violation(f"await_completion({r.rid}) returned {result.reason} unsettled")
        proc.free.extend(r.src)

    async def _receiver(self, r: Req, delay: float) -> None:
        proc = r.receiver
        assert proc is not None
        svc = proc.svc
        await anyio.sleep(delay)
        try:
            await svc.expect(r.rid, r.dst, sender=f"{ROLES[PREFILL]}:{PORT}")
        except KVServiceError as exc:
            self.log(f"expect {r.rid} refused: {exc}")
            plane = plane_of(svc)
            if plane is None or (r.rid not in plane.recvs and r.rid not in plane.recvs_done):
                proc.free.extend(r.dst)
                return
        await svc.await_arrival(r.rid)
        result = await svc.await_settled(r.rid)
        if not result.settled:
            self.violation(f"await_settled({r.rid}) returned unsettled")
        proc.free.extend(r.dst)

    # -- the scheduler -----------------------------------------------------------------
    async def act(self) -> None:
        rng = self.rng
        roll = rng.random()
        up = [p for p in self.procs.values() if p.state == "up"]
        if roll < 0.40:
            self.new_request()
        elif roll < 0.50:
            await self._abort()
        elif roll < 0.55:
            dt = rng.choice((0.4, 1.0, 2.0))
            self.log(f"pass {dt}")
            await anyio.sleep(dt)
        elif roll < 0.70:
            self._door_fault()
        elif roll < 0.75:
            self._link_fault()
        elif roll < 0.79 and up:
            self.crash(rng.choice(up))
        elif roll < 0.82 and up:
            self.shutdown(rng.choice(up))
        elif roll < 0.90:
            down = [role for role, p in self.procs.items() if p.state in ("down", "crashed")]
            if down:
                await self.start_proc(rng.choice(sorted(down)))
        else:
            self._late_notif()

    async def _abort(self) -> None:
        live = [r for r in self.reqs.values() if (r.sender and r.sender.state == "up")
                or (r.receiver and r.receiver.state == "up")]
        if not live:
            return
        r = self.rng.choice(live[-8:])
        procs = [p for p in (r.sender, r.receiver) if p is not None and p.state == "up"]
        proc = self.rng.choice(procs)
        self.log(f"abort {r.rid} on {proc.agent}")
        with contextlib.suppress(UnknownRequestError, KVServiceError):
            await proc.svc.abort(r.rid)

    def _door_fault(self) -> None:
        rng = self.rng
        procs = [p for p in self.procs.values() if p.state == "up" and p.door is not None]
        if not procs:
            return
        proc = self.procs[PREFILL] if self.procs[PREFILL] in procs and rng.random() < 0.8 else rng.choice(procs)
        door = proc.door
        assert door is not None
        kind = rng.randrange(6)
        reason = rng.choice(NIXL_REASONS)
        if reason is FailureReason.REMOTE_DISCONNECT and kind in (0, 1):
            self.disturb(proc.agent)  # the service drops the peer's link
        if kind == 0:
            door.fail_next_post(reason, RuntimeError("injected post failure"))
            self.log(f"fault {proc.agent} next post fails {reason.value}")
        elif kind == 1:
            door.fail_next_check(reason, RuntimeError("injected check failure"))
            self.log(f"fault {proc.agent} next check fails {reason.value}")
        elif kind == 2:
            door.hang()
            self.log(f"fault {proc.agent} hangs")
        elif kind == 3:
            n = door.finish_hung()
            proc.resumed_at = self.now  # the bound on settling runs from here
            door.complete_immediately()
            self.log(f"fault {proc.agent} finishes {n} hung")
        elif kind == 4:
            checks = rng.randint(1, 4)
            door.complete_after(checks)
            self.log(f"fault {proc.agent} completes after {checks} checks")
        else:
            door.complete_immediately()
            self.log(f"fault {proc.agent} completes immediately")

    def _link_fault(self) -> None:
        conns = self.net.live_conns()
        if not conns:
            return
        conn = self.rng.choice(conns)
        self.disturb(conn.client, conn.server)
        if self.rng.random() < 0.5:
            self.log(f"cut conn {conn.number} {conn.client}<->{conn.server}")
            conn.cut()
        else:
            self.log(f"silence conn {conn.number} {conn.client}<->{conn.server}")
            conn.silence()

    def _late_notif(self) -> None:
        rng = self.rng
        receivers = [self.procs[d] for d in DECODES if self.procs[d].state == "up" and self.procs[d].door]
        old = [p.agent for p in self.all_procs if p.role == PREFILL and p is not self.procs[PREFILL]]
        if not receivers or not self.reqs:
            return
        proc = rng.choice(receivers)
        r = rng.choice(list(self.reqs.values())[-8:])
        sender = rng.choice(old) if old else "stranger-agent"
        kind = rng.randrange(3)
        # Forged: sealed under a key no link of ours holds, even when named as the bound
        # sender (NIXL lets any agent holding our metadata choose the name).
        key = rng.randbytes(32)
        if kind == 0:
            msg = encode_notif(ChunkNotif(r.rid, 0, len(r.chunks)), key)
        elif kind == 1:
            msg = encode_notif(ChunkNotif(r.rid, FENCE, FENCE), key)
        else:
            msg = b"kv2\xff garbage"
        self.log(f"inject notif {sender}->{proc.agent} {r.rid} kind={kind}")
        door = proc.door
        assert door is not None
        door.inject_notif(sender, msg)

    # -- invariants --------------------------------------------------------------------
    def check(self) -> None:
        now = self.now
        for proc in self.procs.values():
            if not proc.running:
                continue
            plane = plane_of(proc.svc)
            if plane is None:
                continue
            for req in [*plane.sends.values(), *plane.recvs.values()]:
                if now > req.due_at() + DEADLINE_SLACK_S:
                    self.violation(f"{req.request_id} on {proc.agent} still live {now - req.due_at():.3f}s "
                                   "past its deadline")
        for key, (r, since) in list(self.unsettled.items()):
            if key in self.settled_at or r.disturbed or self._fence_excused(r):
                del self.unsettled[key]
            elif r.sender is not None and r.sender.door is not None and _stalled(r.sender.door):
                self.unsettled[key] = (r, now)  # a stalled NIXL settles nothing: the bound runs from its resumption
                self.stalled_keys.add(key)
            elif key in self.stalled_keys:
                # The stall ended since the last step, not necessarily by ``finishes hung`` (an
                # injected check failure ends a hung handle too): the bound runs from here.
                self.stalled_keys.discard(key)
                self.unsettled[key] = (r, now)
            elif now - max(since, _resumed_at(r.sender)) > SETTLE_BOUND_S:
                del self.unsettled[key]
                self.violation(f"{key[1]} failed on {key[0]} at t={since:.6f} and is not settled "
                               f"{SETTLE_BOUND_S}s later, though no link or process fault touched it")
        problems = self._door_violations()
        if problems:
            self.violation(f"door violations: {problems}")
        if self.violations:
            raise SimFailure(self.failure_message())

    def _door_violations(self) -> list[str]:
        """Every fake door's violations (a check or release after release, ...)."""
        with self.fabric.lock:
            return [f"{door.agent_name}: {v}" for door in self.fabric.created for v in door.violations]

    def failure_message(self) -> str:
        tail = "\n  ".join(self.trace[-60:])
        return (f"seed {self.seed}: {self.violations[0]}\n(all: {self.violations})\n"
                f"replay: {self.replay}\nlast trace lines:\n  {tail}")

    def check_settled_undisturbed(self) -> None:
        """Settling is prompt when nothing went wrong with the link or the processes: a
        failed receiver request whose sender stayed linked settles without waiting for
        the sender to exit (by fence, or by ``Settled``)."""
        for r in self.reqs.values():
            if r.disturbed or r.receiver is None or not r.receiver.running or self._fence_excused(r):
                continue
            plane = plane_of(r.receiver.svc)
            result = plane.recvs_done.get(r.rid) if plane is not None else None
            if result is not None and not result.settled:
                self.violation(f"{r.rid} failed on {r.receiver.agent} ({result.reason}) and never settled, "
                               "though no link or process fault touched it")

    def _fence_excused(self, r: Req) -> bool:
        return self.fence_failures[r.rid] >= FENCE_TRIES

    def check_end(self) -> None:
        for proc in self.all_procs:
            if proc.crashed:
                continue
            plane = plane_of(proc.svc)
            if plane is None:  # never started
                continue
            if plane.sends or plane.recvs:
                self.violation(f"{proc.agent} ended with live requests {list(plane.sends)} {list(plane.recvs)}")
            for side, done in (("send", plane.sends_done), ("recv", plane.recvs_done)):
                for rid in list(done):
                    result = done.get(rid)
                    assert result is not None
                    if self.finishes[(proc.agent, side, rid)] != 1:
                        self.violation(f"{rid} ({side}) on {proc.agent} ended "
                                       f"{self.finishes[(proc.agent, side, rid)]} times")
                    if not result.settled:
                        self.violation(f"{rid} ({side}) on {proc.agent} never settled: {result}")
            if plane.settlement.unsettled_pages:
                self.violation(f"{proc.agent}: {plane.settlement.unsettled_pages} unsettled pages at the end")
        for r in self.reqs.values():
            if r.sender is None or r.receiver is None or r.disturbed:
                continue
            sp, rp = plane_of(r.sender.svc), plane_of(r.receiver.svc)
            s = sp.sends_done.get(r.rid) if sp is not None else None
            d = rp.recvs_done.get(r.rid) if rp is not None else None
            if s is None or d is None:
                continue
            if s.ok != d.ok:
                self.violation(f"{r.rid}: sender {s.status.value} {s.reason}, receiver {d.status.value} {d.reason}"
                               " after both settled")
        problems = self._door_violations()
        for door in self.fabric.created:
            if door.live_xfers():
                problems.append(f"{door.agent_name}: {door.live_xfers()} live handles at the end")
            for xid in door.posted_ids():
                if door.release_counts[xid] != 1:
                    problems.append(f"{door.agent_name}: xfer {xid} released {door.release_counts[xid]} times")
        if problems:
            self.violation(f"doors not clean at the end: {problems}")
        if self.violations:
            raise SimFailure(self.failure_message())

    # -- the run -----------------------------------------------------------------------
    async def quiesce(self) -> None:
        self.step = self.steps
        self.log("quiesce")
        for proc in self.procs.values():
            if proc.running and proc.door is not None:
                proc.door.finish_hung()
                proc.door.complete_immediately()
                proc.door._post_errors.clear()
                proc.door._check_errors.clear()
        await anyio.sleep(2.5)  # every deadline passes (the longest is 2 s)
        self.check_settled_undisturbed()
        self.check()
        for role in sorted(self.procs):
            proc = self.procs[role]
            if proc.state == "up":
                self.shutdown(proc)
        with anyio.move_on_after(30.0):
            while any(p.state in ("up", "stopping", "starting") for p in self.all_procs):  # noqa: ASYNC110
                await anyio.sleep(0.1)
        stuck = [p.agent for p in self.all_procs if p.state in ("up", "stopping", "starting")]
        if stuck:
            self.violation(f"shutdown hung: {stuck}")
        await anyio.sleep(6.0)  # probes and settle-by-loss run out
        self.check()

    async def main(self) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for role in sorted(ROLES):
                await self.start_proc(role)
            for step in range(self.steps):
                self.step = step
                for _ in range(self.rng.choice((1, 2, 4)) if self.burst else 1):
                    await self.act()
                await anyio.sleep(self.rng.choice(STEP_DTS))
                self.check()
            await self.quiesce()
            self.check_end()
            tg.cancel_scope.cancel()


@contextlib.contextmanager
def _quiet_logs(world: World) -> Iterator[None]:
    saved = structlog.get_config()
    structlog.configure(processors=[world._capture_log], cache_logger_on_first_use=False)
    try:
        yield
    finally:
        structlog.configure(**saved)


def _first_sim_failure(exc: BaseException) -> SimFailure | None:
    if isinstance(exc, SimFailure):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = _first_sim_failure(sub)
            if found is not None:
                return found
    return None


def run_seed(seed: int, steps: int = 40, *, burst: bool = False,
             world_hook: Callable[[World], None] | None = None) -> World:
    """Run one seed; raise ``SimFailure`` (with the seed, the step and the trace) on a violation."""
    world = World(seed, steps, burst)
    if world_hook is not None:
        world_hook(world)
    loop = VirtualLoop()
    world.loop = loop
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: torch's thread pool only costs here
    try:
        with patched_clock(), _quiet_logs(world):
            loop.run_until_complete(world.main())
    except BaseException as exc:
        found = _first_sim_failure(exc)
        if found is not None:
            raise found from None
        if world.violations:
            raise SimFailure(world.failure_message()) from exc
        raise SimFailure(f"seed {seed}: the simulation raised {exc!r} at step {world.step}\n"
                         f"replay: {world.replay}") from exc
    finally:
        torch.set_num_threads(threads)
        _close(loop)
    return world


def _close(loop: VirtualLoop) -> None:
    try:
        pending = [t for t in __import__("asyncio").all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(__import__("asyncio").gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()


__all__ = ["DoorError", "SimFailure", "World", "run_seed"]
