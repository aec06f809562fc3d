"""The soak itself: one prefill and some decodes (real processes), many requests,
faults at random, and the accounting that says whether any promise broke."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import anyio
import anyio.abc
import numpy as np

from .._trust.keys import generate_key
from ..memory._layout import KVLayout
from ..sidecar.local import LocalDaemon, short_tmpdir
from ..testing.netns import CUTS, Hub
from ..testing.peer_process import stray_output
from ._leaks import Ledger
from ._nodes import Node, PrefixedDaemon
from ._sampling import sample
from ._summary import Summary, disagreement_cause

# 16 KiB pages (2 layers x K/V x 4 KiB planes), 512 per process: small enough that
# 2 shared cores move ~1000 requests in a couple of minutes, faults included.
LAYOUT = KVLayout(layers=2, page_tokens=16, kv_heads=2, head_dim=64, dtype="bfloat16", num_pages=512)
UCX_ENV = {"UCX_NET_DEVICES": "lo"}
BOOTSTRAP_S, TRANSFER_S, ARRIVAL_S = 3.0, 5.0, 8.0  # the services' own deadlines
STOP_MAX_S = 2.5  # longest SIGSTOP; longer than peer_timeout_s, so some stops lose the link
CUT_MIN_S, CUT_MAX_S = 0.1, 3.0  # how long a network cut holds; past peer_timeout_s for some
HEARTBEAT_S, PEER_TIMEOUT_S = 0.2, 1.5  # the services' liveness
#: after a cut is restored, its effects still land this long: a link silent since before the
#: restore (TCP's retransmissions back off while the packets are dropped) ends up to a
#: ``peer_timeout_s`` later; a request that began within it was touched by the cut
CUT_AFTERMATH_S = PEER_TIMEOUT_S + HEARTBEAT_S
#: a loop held this long can end a link: its peer hears nothing for ``PEER_TIMEOUT_S`` once a
#: heartbeat's gap is added, or its own pings stop (``_summary.disagreement_cause``)
LINK_STALL_S = PEER_TIMEOUT_S - HEARTBEAT_S
BOUND_S = 10.0  # past a request's own deadline (and any stop): no end by then is a hang
CALL_S = BOUND_S + STOP_MAX_S  # an answer to a command
SETTLE_S = 15.0  # a failed request with a live, running sender must settle within this
#: waits of SETTLE_S for one request, each after one its decode's network cuts or stops touched
SETTLE_TRIES = 4
TAKE_S = 30.0  # waiting for free pages
LATE_WRITE_WAIT_S = 1.0  # before the final canary check: long past any WRITE on the wire
#: leak accounting: about this many samples per run, never more often than every SAMPLE_MIN_S
SAMPLES_PER_RUN, SAMPLE_MIN_S = 600, 1.0
FAULT_KINDS = ("none", "abort_recv", "abort_send", "recv_deadline", "send_deadline")
FAULT_P = (0.8, 0.05, 0.05, 0.05, 0.05)
ABORTS_OR_DEADLINES = frozenset(FAULT_KINDS[1:])
#: the process faults, with equal odds (``process_fault``); ``cut`` only with ``network_cuts``
PROCESS_FAULTS = ("kill", "stop")
PROCESS_FAULTS_WITH_CUTS = ("kill", "stop", "cut")


def process_fault(rng: np.random.Generator, network_cuts: bool) -> str:
    """The next process fault: kill or stop at even odds, or, with ``network_cuts``, kill,
    stop or cut at one in three each (a run without cuts draws the schedule it always did)."""
    if not network_cuts:
        return "kill" if rng.random() < 0.5 else "stop"
    return PROCESS_FAULTS_WITH_CUTS[int(rng.integers(len(PROCESS_FAULTS_WITH_CUTS)))]


def daemon_settings() -> dict[str, str]:
    """A sidecar decode's daemon: the same service settings as ``child_config``."""
    return {
        **UCX_ENV, "KVSERVICE_SERVICE_DRAIN_GRACE_S": "1.0", "KVSERVICE_SERVICE_BOOTSTRAP_TIMEOUT_S": str(BOOTSTRAP_S),
        "KVSERVICE_SERVICE_TRANSFER_TIMEOUT_S": str(TRANSFER_S), "KVSERVICE_SERVICE_ARRIVAL_TIMEOUT_S": str(ARRIVAL_S),
        "KVSERVICE_SERVICE_CONNECT_TIMEOUT_S": "2.0", "KVSERVICE_SERVICE_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S),
        "KVSERVICE_SERVICE_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S), "KVSERVICE_LOG_LEVEL": "warning",
    }


def child_config() -> dict[str, Any]:
    lay = LAYOUT
    return {
        "layout": {"layers": lay.layers, "page_tokens": lay.page_tokens, "kv_heads": lay.kv_heads,
                   "head_dim": lay.head_dim, "dtype": lay.dtype, "num_pages": lay.num_pages},
        "ucx_env": UCX_ENV, "drain_grace_s": 1.0, "bootstrap_timeout_s": BOOTSTRAP_S,
        "transfer_timeout_s": TRANSFER_S, "arrival_timeout_s": ARRIVAL_S, "connect_timeout_s": 2.0,
        "heartbeat_interval_s": HEARTBEAT_S, "peer_timeout_s": PEER_TIMEOUT_S,
    }


def longest_stall(stalls: Sequence[Sequence[tuple[float, float]]], began: float, ended: float) -> float:
    """The longest of ``stalls`` (each process's ``(ended, seconds)``) that overlaps the time
    from ``began`` to ``ended``; 0 if none does."""
    return max((secs for each in stalls for end, secs in each if end >= began and end - secs <= ended),
               default=0.0)


@dataclass(frozen=True)
class Options:
    transfers: int = 10_000
    seed: int = 0
    decodes: int = 2
    sidecar_decodes: int = 1  # of the decodes, how many run as a sidecar daemon and a worker
    concurrency: int = 6
    max_pages: int = 32
    fault_interval_s: float = 1.0  # mean time between process faults (SIGKILL+restart, SIGSTOP/SIGCONT)
    progress: bool = True
    duration_s: float | None = None  # stop starting requests this long after the first (or at ``transfers``)
    #: every process in a network namespace of its own (``soak(net=)``), and cuts among the process faults
    network_cuts: bool = False

    @property
    def sample_s(self) -> float:
        """Seconds between the leak accounting's samples."""
        return max(SAMPLE_MIN_S, (self.duration_s or 0.0) / SAMPLES_PER_RUN)


class Soak:
    def __init__(self, opts: Options, tg: anyio.abc.TaskGroup, log: IO[Any], env: dict[str, str],
                 net: Hub | None = None) -> None:
        if opts.network_cuts and net is None:
            raise ValueError("network_cuts needs the hosts (net=netns.hub(...) over 'prefill' and every decode)")
        self.opts = opts
        self.net = net
        self.tg = tg
        self.log = log
        self.env = env
        self.rng = np.random.default_rng([opts.seed, 1 << 20])  # the fault schedule
        self.s = Summary()
        self.prefill: Node | None = None
        self.decodes: list[Node] = []
        self.nodes: list[Node] = []  # every process started, for the crash count
        self.next = 0
        self.done = 0
        self.settling = 0  # failed requests waiting for await_settled now
        self.unsettled_pages = 0  # at the last status poll, all processes together
        self.finished = anyio.Event()
        self.workdir = short_tmpdir("kvs-soak-")  # sidecar sockets, the cluster key
        self.daemons: list[LocalDaemon] = []  # every sidecar daemon made, started or not
        self.key_file = os.path.join(self.workdir, "cluster.key")
        if net is not None:  # services bound to a veth's address: a real deployment's shared key
            generate_key(self.key_file)
        self.generation = 0
        self.ledger = Ledger()
        self.t0 = time.monotonic()
        self.deadline = float("inf")
        #: each service's loop stalls as its process reported them (``testing.peer``'s status):
        #: name -> [(ended, seconds)] on CLOCK_MONOTONIC, the clock of every process here
        self.stalls: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        #: receiver SUCCESS, sender failed, nothing injected touched it: judged at the end,
        #: once every stall is reported (rid, fault, sender's event, decode, from, to)
        self.undecided: list[tuple[str, str, dict[str, Any], str, float, float]] = []

    async def _start(self, name: str) -> Node:
        """Start (or restart) ``name``; with ``net``, inside its own namespace (a sidecar
        decode's daemon and worker in the same one), bound to its veth's address."""
        host = self.net.hosts[name] if self.net is not None else None
        config, env, settings = child_config(), dict(self.env), daemon_settings()
        if host is not None:
            config.update(host=host.ip, auth_key_file=self.key_file, ucx_env=host.ucx_env)
            env.update(host.ucx_env)
            settings.update(host.ucx_env, KVSERVICE_SERVICE_HOST=host.ip,
                            KVSERVICE_SERVICE_AUTH_KEY_FILE=self.key_file)
        prefix = host.prefix if host is not None else ()
        daemon = None
        if name in self.sidecar_names:
            self.generation += 1
            lay = child_config()["layout"]
            daemon = PrefixedDaemon("decode", self.workdir, name=f"{name}-{self.generation}", layout=lay,
                                    env=settings, stderr=self.log, prefix=prefix)
            self.daemons.append(daemon)
        node = await Node.start(self.tg, name, config, LAYOUT.num_pages, env, self.log, daemon, prefix=prefix)
        self.nodes.append(node)
        return node

    @property
    def sidecar_names(self) -> set[str]:
        n = self.opts.decodes
        return {f"decode{k}" for k in range(max(0, n - self.opts.sidecar_decodes), n)}

    # -- the run ------------------------------------------------------------------------
    async def run(self) -> Summary:
        t0 = self.t0 = time.monotonic()
        self.prefill = await self._start("prefill")
        for k in range(self.opts.decodes):
            self.decodes.append(await self._start(f"decode{k}"))
        if self.opts.duration_s is not None:  # of traffic: the processes' start is not counted
            self.deadline = time.monotonic() + self.opts.duration_s
        async with anyio.create_task_group() as side:
            side.start_soon(self._progress)
            side.start_soon(self._faults)
            async with anyio.create_task_group() as workers:
                for _ in range(self.opts.concurrency):
                    workers.start_soon(self._worker)
            self.finished.set()
        await self._finish()
        self.s.seconds = time.monotonic() - t0
        self.s.leaks = self.ledger.judge()
        self.s.leak_pids = {row: len(pids) for row, pids in self.ledger.pids.items()}
        self.s.leak_samples = self.ledger.samples
        return self.s

    async def _worker(self) -> None:
        while (self.next < self.opts.transfers and time.monotonic() < self.deadline and self.prefill is not None
               and not self.prefill.dead.is_set()):
            i = self.next
            self.next += 1
            await self._request(i)
            self.done += 1

    # -- one request ----------------------------------------------------------------------
    async def _request(self, i: int) -> None:
        s, prefill = self.s, self.prefill
        assert prefill is not None
        rng = np.random.default_rng([self.opts.seed, i])
        rid = f"soak-{self.opts.seed}-{i}"
        began = time.monotonic()
        npages = int(rng.integers(1, self.opts.max_pages + 1))
        chunks = int(rng.integers(1, min(4, npages) + 1))
        fault = str(rng.choice(FAULT_KINDS, p=FAULT_P))
        expect_first = bool(rng.random() < 0.7)
        s.transfers += 1
        decode = await self._pick_decode(rng)
        src = await self._take(prefill, npages, rng)
        dst = None
        for _ in range(8):  # the chosen decode may be killed (by the soak) while we wait for its pages
            if decode is None:
                break
            dst = await self._take(decode, npages, rng)
            if dst is not None or not decode.dead.is_set():
                break
            decode = await self._pick_decode(rng)
        if decode is None or src is None or dst is None:
            s.hung += 1
            s.note(f"{rid}: no decode or no free pages within {TAKE_S}s")
            return
        filled = await prefill.call(CALL_S, op="fill", rid=rid, pages=src)
        if filled is None:  # the prefill is gone: counted as a crash
            s.failed_by_reason["PREFILL_GONE"] += 1
            return
        if fault != "none":
            s.faults[fault] += 1
        stops_before, cuts_before = decode.faults_seen, decode.cuts_seen
        prefill.expect(("completed", rid))
        decode.expect(("arrived", rid))
        recv_timeout = float(rng.uniform(0.005, 0.3)) if fault == "recv_deadline" else ARRIVAL_S
        send_timeout = float(rng.uniform(0.002, 0.2)) if fault == "send_deadline" else None
        bounds = np.linspace(0, npages, chunks + 1).astype(int)

        async def do_send() -> None:
            for k in range(chunks):
                last = k == chunks - 1
                await prefill.send(op="send", rid=rid, pages=src[bounds[k]:bounds[k + 1]], last=last,
                                   timeout=send_timeout if last else None)

        async def do_expect() -> dict[str, Any] | None:
            return await decode.call(CALL_S, op="expect", rid=rid, pages=dst, sender=prefill.address,
                                     timeout=recv_timeout)

        # The two sides in either order, a gap between them; a deadline fault makes the
        # gap straddle the deadline, an abort lands between the sides or just after both.
        gap = float(rng.uniform(0, 0.02)) if not expect_first else 0.0
        if fault == "recv_deadline":
            expect_first, gap = True, float(rng.uniform(0, 2 * recv_timeout))
        elif fault == "send_deadline":
            expect_first, gap = False, float(rng.uniform(0, 2 * (send_timeout or 0.0)))
        abort_between = fault in ("abort_recv", "abort_send") and bool(rng.random() < 0.4)
        aborter = decode if fault == "abort_recv" else prefill
        expecting: dict[str, Any] | None = None
        for step in ("first", "second"):
            if (step == "first") == expect_first:
                expecting = await do_expect()
            else:
                await do_send()
            if step == "first":
                if abort_between:
                    await aborter.call(CALL_S, op="abort", rid=rid)
                await anyio.sleep(gap)
        if fault in ("abort_recv", "abort_send") and not abort_between:
            await anyio.sleep(float(rng.uniform(0, 0.005)))
            await aborter.call(CALL_S, op="abort", rid=rid)
        expected = expecting is not None and expecting["event"] == "expecting"
        if expecting is not None and not expected:
            s.note(f"{rid}: expect refused: {expecting}")

        sent = await prefill.wait(("completed", rid), BOOTSTRAP_S + TRANSFER_S + CALL_S)
        arrived = await decode.wait(("arrived", rid), ARRIVAL_S + CALL_S) if expected else None
        if not expected:
            decode.forget(("arrived", rid))
        if sent is not None:
            prefill.free.extend(src)  # a sender's result comes once it is settled
        elif not prefill.dead.is_set():
            s.hung += 1
            s.note(f"{rid}: the sender reported no end within its deadline + {CALL_S}s")
        if expected and arrived is None and not decode.dead.is_set() and not decode.killed:
            s.hung += 1
            s.note(f"{rid}: the receiver reported no end within its deadline + {CALL_S}s")
            return
        touched = decode.faults_seen != stops_before or decode.killed
        cut = decode.cuts_seen != cuts_before or decode.restored_at + CUT_AFTERMATH_S >= began
        faulted = fault in ABORTS_OR_DEADLINES or touched or cut
        if arrived is None:  # expect refused, or the receiver died (its pages with it)
            if not expected and not decode.dead.is_set():
                decode.free.extend(dst)
            if sent is not None and sent["status"] != "SUCCESS":
                s.failed_by_reason[sent["reason"]] += 1
            elif sent is not None or decode.killed:
                s.failed_by_reason["RECEIVER_KILLED"] += 1
            return
        if arrived["status"] == "SUCCESS":
            if sent is not None and sent["status"] != "SUCCESS":
                if faulted:
                    s.disagreements[f"recv SUCCESS, send {sent['reason']} "
                                    f"({disagreement_cause(fault, touched, sent, False, cut)})"] += 1
                else:  # a stall may explain it: its report may come after this
                    self.undecided.append((rid, fault, sent, decode.name, began, time.monotonic()))
            if arrived["verified"]:
                s.succeeded_verified += 1
                decode.free.extend(dst)
                if decode.unhealed and began > decode.restored_at:  # begun after its last cut ended
                    s.cuts_healed += decode.unhealed
                    s.heal_s_max = max(s.heal_s_max, time.monotonic() - decode.restored_at)
                    decode.unhealed = 0
            else:
                s.false_success += 1
                s.note(f"{rid}: SUCCESS but the bytes on the receiver differ")
            return
        await self._settle(rid, decode, dst, arrived, sent)

    async def _settle(self, rid: str, decode: Node, dst: list[int], arrived: dict[str, Any],
                      sent: dict[str, Any] | None) -> None:
        """A receiver's failure: wait until it settles, then guard its pages with a canary."""
        s = self.s
        self.settling += 1
        try:
            for _ in range(SETTLE_TRIES):
                cuts, stops = decode.cuts_seen, decode.faults_seen
                st = await decode.call(SETTLE_S + CALL_S, op="await_settled", rid=rid, timeout=SETTLE_S)
                if st is None or st.get("settled") or not decode.alive:
                    break
                # cut off or stopped meanwhile (or still): nothing can settle it while the
                # receiver cannot hear its sender, so the bound runs again from now
                if (decode.cuts_seen, decode.faults_seen) == (cuts, stops) and not decode.cut:
                    break
        finally:
            self.settling -= 1
        if st is None or not decode.alive:
            # a decode the soak killed may refuse the command before its exit is seen (its stdin
            # breaks first): its pages went with it, as when it died while waiting
            if decode.alive:
                s.hung += 1
                s.note(f"{rid}: await_settled did not answer ({decode.name})")
            s.failed_by_reason[arrived["reason"]] += 1
            return
        if st["event"] != "settled" or not st["settled"]:
            # the sender (the prefill, never stopped here) lives: it must have settled
            s.hung += 1
            s.note(f"{rid}: not settled {SETTLE_S}s after failing {arrived['reason']} on {decode.name} "
                   f"(cuts seen {decode.cuts_seen}, sender said {sent}): {st}")
            s.failed_by_reason[arrived["reason"]] += 1
            return
        if st["status"] == "SUCCESS":  # the abort lost the race with the last chunk: every page landed
            v = await decode.call(CALL_S, op="verify", rid=rid, pages=dst)
            if v is not None and v.get("ok"):
                s.succeeded_verified += 1
                s.settled_to_success += 1
                decode.free.extend(dst)
            elif v is not None:
                s.false_success += 1
                s.note(f"{rid}: settled as SUCCESS but the bytes differ")
            return
        s.failed_by_reason[arrived["reason"]] += 1
        if sent is not None and sent["status"] == "SUCCESS":
            s.disagreements[f"recv {arrived['reason']} settled FAILED, send SUCCESS"] += 1
        tag = f"canary-{rid}"
        filled = await decode.call(CALL_S, op="fill", rid=tag, pages=dst)
        if filled is not None and filled["event"] == "filled":
            decode.canaries[tag] = dst

    # -- pages and canaries ---------------------------------------------------------------
    async def _take(self, node: Node, n: int, rng: np.random.Generator) -> list[int] | None:
        """``n`` free pages of ``node`` (contiguous or scattered); canaries are checked
        before their pages are reused."""
        deadline = time.monotonic() + TAKE_S
        while not node.dead.is_set():
            if node.canaries and (len(node.free) < n or rng.random() < 0.25):
                tags = sorted(node.canaries)
                tag = tags[int(rng.integers(len(tags)))]
                pages = node.canaries.pop(tag)
                await self._check_canary(node, tag, pages)
                node.free.extend(pages)
                continue
            if len(node.free) >= n:
                node.free.sort()
                if rng.random() < 0.5:
                    for k in range(len(node.free) - n + 1):
                        if node.free[k + n - 1] - node.free[k] == n - 1:
                            run = node.free[k:k + n]
                            del node.free[k:k + n]
                            return run
                picked = sorted(rng.choice(len(node.free), size=n, replace=False).tolist(), reverse=True)
                return [node.free.pop(k) for k in picked]
            if time.monotonic() > deadline:
                return None
            await anyio.sleep(0.01)
        return None

    async def _check_canary(self, node: Node, tag: str, pages: list[int]) -> None:
        v = await node.call(CALL_S, op="verify", rid=tag, pages=pages)
        if v is None:
            return  # the process died: its pages with it
        if v["event"] == "verified" and v["ok"]:
            self.s.canaries_checked += 1
        else:
            self.s.writes_after_settle += 1
            self.s.note(f"{node.name}: canary {tag} on pages {pages} overwritten after settle: {v}")

    async def _pick_decode(self, rng: np.random.Generator) -> Node | None:
        deadline = time.monotonic() + TAKE_S
        while time.monotonic() < deadline:
            running = ([d for d in self.decodes if d.alive and not d.stopped and not d.cut]
                       or [d for d in self.decodes if d.alive])
            if running:
                return running[int(rng.integers(len(running)))]
            await anyio.sleep(0.05)  # all restarting
        return None

    # -- process faults -------------------------------------------------------------------
    async def _faults(self) -> None:
        """SIGKILL (then restart), SIGSTOP/SIGCONT or (``network_cuts``) cut the network of a
        random decode, while one other runs on."""
        if self.opts.fault_interval_s <= 0:
            return
        async with anyio.create_task_group() as tg:
            with anyio.move_on_after(0.3):
                await self.finished.wait()
            while not self.finished.is_set():
                running = [k for k, d in enumerate(self.decodes) if d.alive and not d.stopped and not d.cut]
                if len(running) < 2:  # one is stopped, cut or restarting: fault again once it is back
                    with anyio.move_on_after(0.05):
                        await self.finished.wait()
                    continue
                k = running[int(self.rng.integers(len(running)))]
                kind = process_fault(self.rng, self.opts.network_cuts)
                if kind == "kill":
                    tg.start_soon(self._kill_and_restart, k)
                elif kind == "stop":
                    tg.start_soon(self._stop_and_cont, self.decodes[k], float(self.rng.uniform(0.1, STOP_MAX_S)))
                else:
                    how = CUTS[int(self.rng.integers(len(CUTS)))]
                    tg.start_soon(self._cut_and_restore, self.decodes[k], how,
                                  float(self.rng.uniform(CUT_MIN_S, CUT_MAX_S)))
                with anyio.move_on_after(float(self.rng.exponential(self.opts.fault_interval_s))):
                    await self.finished.wait()

    async def _kill_and_restart(self, k: int) -> None:
        node = self.decodes[k]
        node.kill()
        self.s.cuts_killed_first += node.unhealed
        node.unhealed = 0
        self.s.faults["sigkill"] += 1
        with anyio.move_on_after(10):
            await node.dead.wait()
        await node.reap()
        self.decodes[k] = await self._start(node.name)
        self.s.faults["restart"] += 1

    async def _stop_and_cont(self, node: Node, seconds: float) -> None:
        node.stopped = True
        node.faults_seen += 1
        node.signal(signal.SIGSTOP)
        self.s.faults["sigstop"] += 1
        try:
            await anyio.sleep(seconds)
        finally:
            node.signal(signal.SIGCONT)
            node.stopped = False
            node.faults_seen += 1

    async def _cut_and_restore(self, node: Node, how: str, seconds: float) -> None:
        """Cut ``node``'s network (``netns.Hub.cut``: link down, or its egress or ingress
        dropped) for ``seconds``, then restore it; the process runs on throughout."""
        assert self.net is not None
        node.cut = True
        node.cuts_seen += 1
        try:
            await anyio.to_thread.run_sync(self.net.cut, node.name, how)
            self.s.faults["netcut"] += 1
            self.s.cuts_by_kind[how] += 1
            await anyio.sleep(seconds)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.net.restore, node.name, how)
            node.restored_at = time.monotonic()
            node.unhealed += 1
            node.cut = False
            node.cuts_seen += 1

    def close(self) -> None:
        """Leave nothing of this run behind: its daemons (``kill_daemons``) and its directory
        of sockets and the cluster key, made when the run was."""
        self.kill_daemons()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def kill_daemons(self) -> None:
        """SIGKILL every sidecar daemon still running: a run that ends early (an error,
        Ctrl-C) leaves none serving, not even one a restart was starting.  The workers exit
        on their own when their stdin closes; a daemon would serve on.  A no-op after a run
        that stopped each one."""
        for daemon in self.daemons:
            if daemon.proc is not None and daemon.proc.poll() is None:
                daemon.signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    daemon.wait(5.0)
                daemon.cleanup_names()

    # -- watching -------------------------------------------------------------------------
    def _running(self) -> list[Node]:
        return [n for n in [self.prefill, *self.decodes] if n is not None and n.alive and not n.stopped]

    async def _poll_status(self) -> list[tuple[Node, dict[str, Any]]]:
        got: list[tuple[Node, dict[str, Any]]] = []

        async def one(node: Node) -> None:
            st = await node.call(1.0, op="status")
            if st is not None and st["event"] == "status":
                got.append((node, st))
                self.stalls[node.name].extend((float(end), float(secs)) for end, secs in st.get("stalls", ()))

        async with anyio.create_task_group() as tg:
            for node in self._running():
                tg.start_soon(one, node)
        if got:
            self.unsettled_pages = sum(int(st["unsettled_pages"]) for _, st in got)
            self.s.unsettled_pages_max = max(self.s.unsettled_pages_max, self.unsettled_pages)
        return got

    async def _progress(self) -> None:
        next_sample = 0.0
        while not self.finished.is_set():
            with anyio.move_on_after(1.0):
                await self.finished.wait()
            got = await self._poll_status()
            if time.monotonic() >= next_sample and not self.finished.is_set():
                next_sample = time.monotonic() + self.opts.sample_s
                await sample(self.ledger, self._running(), got, time.monotonic() - self.t0)
            if self.opts.progress:
                s = self.s
                total = "" if self.opts.duration_s is not None else f"/{self.opts.transfers}"
                print(f"soak {self.done}{total} t={time.monotonic() - self.t0:.0f}s ok={s.succeeded_verified} "
                      f"failed={sum(s.failed_by_reason.values())} settling={self.settling} "
                      f"unsettled_pages={self.unsettled_pages} faults={sum(s.faults.values())} "
                      f"hung={s.hung} false_success={s.false_success} unexplained={s.unexplained_disagreements} "
                      f"late_writes={s.writes_after_settle}",
                      file=sys.stderr, flush=True)

    def _judge_undecided(self) -> None:
        """Name the cause of each disagreement that nothing injected touched, now that every
        stall has been reported: the longest stall of the prefill's or that decode's loop
        during the request."""
        s = self.s
        for rid, fault, sent, decode, began, ended in self.undecided:
            held = longest_stall([self.stalls[name] for name in ("prefill", decode)], began, ended)
            cause = disagreement_cause(fault, False, sent, held >= LINK_STALL_S)
            side = f"recv SUCCESS, send {sent['reason']} ({cause})"
            s.disagreements[side] += 1
            if cause == "none":
                s.unexplained_disagreements += 1
                s.note(f"{rid}: {side}, and no abort, deadline, fault or loop stall explains it "
                       f"(longest stall {held:.2f}s): {sent['message']}")
        self.undecided.clear()

    async def _finish(self) -> None:
        """Final canary check, handles and loop lag of the survivors, clean exits."""
        s = self.s
        await anyio.sleep(LATE_WRITE_WAIT_S)
        for line in stray_output:
            s.note(f"a child printed a line that is no event (skipped): {line!r}")
        for node in [d for d in self.decodes if d.alive]:
            for tag, pages in sorted(node.canaries.items()):
                await self._check_canary(node, tag, pages)
            node.canaries.clear()
        survivors = self._running()
        for node in self.decodes:
            if node.alive and node.unhealed:
                s.cuts_unhealed_at_end += node.unhealed
                if (ago := time.monotonic() - node.restored_at) > SETTLE_S:
                    s.note(f"{node.name}: its network was restored {ago:.1f}s before the end, and no request "
                           "to it begun since then succeeded")
        with anyio.move_on_after(5):
            while True:
                got = await self._poll_status()
                if all(st["live_nixl_handles"] == 0 for _, st in got):
                    break
                await anyio.sleep(0.1)
        self._judge_undecided()
        s.leaked_handles = sum(int(st["live_nixl_handles"]) for _, st in got)
        if s.leaked_handles:
            s.note(f"live NIXL handles at the end: {[(n.name, st['live_nixl_handles']) for n, st in got]}")
        if len(got) < len(survivors):
            s.note("a surviving process did not answer status at the end")
        lags = {n.name: float(st["loop_lag_max_s"]) * 1000 for n, st in got}
        s.max_loop_lag_ms = max(lags.values(), default=0.0)
        s.prefill_loop_lag_ms = lags.get("prefill", 0.0)
        for node in survivors:
            await node.stop()
        s.crashes = sum(n.crashed for n in self.nodes)
        for n in self.nodes:
            if n.crashed:
                s.note(f"{n.name} (pid {n.proc.pid}) exited with {n.returncode} without being killed")
            for err in n.stray_errors[:5]:
                s.note(f"{n.name} reported an error: {err}")


async def soak(opts: Options, log: IO[Any], env: Sequence[tuple[str, str]] = (), net: Hub | None = None) -> Summary:
    """Run the soak.  ``net``: a host per process (``netns.hub`` over ``host_names(opts)``),
    whose links ``opts.network_cuts`` cuts; its namespaces are the caller's to remove."""
    async with anyio.create_task_group() as tg:
        run = Soak(opts, tg, log, dict(env), net)
        try:
            summary = await run.run()
        finally:
            run.close()
        tg.cancel_scope.cancel()
    return summary


def host_names(opts: Options) -> list[str]:
    """The processes of a run, each a host with ``network_cuts``: the prefill and the decodes."""
    return ["prefill", *(f"decode{k}" for k in range(opts.decodes))]
