"""``kvservice bench``: kvservice against raw NIXL and the memory-copy limit.

On one host it runs every method in child processes over loopback: the copy
limit, a hand-written raw-NIXL loop, kvservice in process and as a sidecar.

Between two hosts, ``--listen HOST:PORT`` on one (the receiving side) and
``--peer HOST:PORT`` on the other (the sending side, which drives the run and
writes the report) run the same workloads over the network: raw NIXL and
kvservice, each between one process on either host, on the UCX transports and
devices each side selects (``--ucx-tls``, ``--net-devices``).  Off loopback the
exchange is authenticated with the cluster key (``--auth-key-file`` or
``KVSERVICE_AUTH_KEY_FILE``), or runs without one only with
``--allow-unauthenticated``; on loopback without a key file, with this user's own
key, like a service.

    kvservice bench                            # full run on this host, into ./kvservice-bench/
    kvservice bench --quick --out /tmp/b       # CI smoke run: seconds, asserts nothing about speed
    kvservice bench --listen 10.0.0.7:7390 --auth-key-file cluster.key         # host A
    kvservice bench --peer 10.0.0.7:7390 --auth-key-file cluster.key --quick   # host B: drives, reports
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvservice._config import ConfigError
from kvservice._control.addresses import is_loopback_host, join_address, split_address
from kvservice._exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE, sigterm_as_sigint
from kvservice._results import KVServiceError
from kvservice._trust.authority import CA_CERT, create_authority, issue
from kvservice._trust.keys import generate_key, load_key, resolve_key
from kvservice.bench import _lines, control, engines, report, vetting
from kvservice.bench._lines import Child, ChildError
from kvservice.bench.control import ControlError
from kvservice.bench.listen import ListenOptions, listen
from kvservice.bench.methods import SETUP_TIMEOUT_S, TCP_ENV, KvService, Limit, Method, Mooncake, RawNixl, Sidecar
from kvservice.bench.remote import Link, dial
from kvservice.bench.run import (
    PARTS,
    aggregate,
    evaluate,
    kill_test,
    log,
    machine,
    memory_per_request,
    run_cases,
    warm_up,
)
from kvservice.bench.workloads import FULL, LLAMA3_8B, QUICK, Plan, all_cases

KEY_ENV = "KVSERVICE_AUTH_KEY_FILE"
TWO_HOST_PARTS = PARTS - {"kill"}
#: ``--verify-landing``'s method: kvservice with ``verify_landing = true`` on both sides
VERIFY = "kvservice/verify"
#: ``--identity``'s method: kvservice with a member identity on each side
IDENTITY = "kvservice/identity"


#: ``kvservice bench --help``: the module's docstring in plain words (no markup)
_DESCRIPTION = """\
kvservice against raw NIXL and the memory-copy limit.

On one host it runs every method in child processes over loopback: the copy
limit, a hand-written raw-NIXL loop, kvservice in process and as a sidecar.

Between two hosts, --listen HOST:PORT on one (the receiving side) and --peer
HOST:PORT on the other (the sending side, which drives the run and writes the
report) run the same workloads over the network: raw NIXL and kvservice, each
between one process on either host, on the UCX transports and devices each
side selects (--ucx-tls, --net-devices). Off loopback the exchange is
authenticated with the cluster key (--auth-key-file or
KVSERVICE_AUTH_KEY_FILE), or runs without one only with
--allow-unauthenticated; on loopback without a key file, with this user's own
key."""

_EXAMPLES = """\
examples:
  kvservice bench                            # full run on this host, into ./kvservice-bench/
  kvservice bench --quick --out /tmp/b       # CI smoke run: seconds, asserts nothing about speed
  kvservice bench --listen 10.0.0.7:7390 --auth-key-file cluster.key         # host A
  kvservice bench --peer 10.0.0.7:7390 --auth-key-file cluster.key --quick   # host B: drives, reports"""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvservice bench", description=_DESCRIPTION, epilog=_EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small CI smoke variant (seconds)")
    p.add_argument("--out", type=Path, default=Path("kvservice-bench"),
                   help="directory for bench.json, results.md and bench.png (default: ./kvservice-bench)")
    p.add_argument("--repeats", type=int, help="repeats per case (default: 5, quick: 1)")
    p.add_argument("--only", help="comma-separated subset of w1,w2,w3,memory,kill,engine,tp,layerwise,fanout "
                                   "(default: all; between two hosts w1,w2,w3,memory: the others need one host)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="event loop of the kvservice processes (the sidecar's daemons and workers too)")
    p.add_argument("--kv-gc", choices=("freeze", "off"), default="freeze",
                   help="cyclic GC in the kvservice processes: frozen start-up heap (default), or also "
                        "no automatic collection (a diagnostic for GC pauses in the loop lag)")
    p.add_argument("--seed", type=int, default=1,
                   help="seeds the W1 and W2 workloads' request sizes, so a run repeats (default 1)")
    p.add_argument("--no-chart", action="store_true", help="skip the PNG")
    p.add_argument("--methods", metavar="LIST",
                   help="one host: measure only these methods (comma-separated, e.g. "
                        "kvservice/tcp,mooncake/tcp); memory and kill need kvservice")
    p.add_argument("--verify-landing", action="store_true",
                   help="one host: also measure kvservice with landing checks (verify_landing) and print "
                        "its cost as a ratio to kvservice without them, from the same run")
    p.add_argument("--identity", action="store_true",
                   help="one host: also measure kvservice with member identities (a throwaway authority, "
                        "each side its own certificate) and print their cost as a ratio to kvservice "
                        "without them, from the same run")
    p.add_argument("--no-tcp", action="store_true",
                   help="one host: skip the same-transport comparison (Mooncake's Transfer Engine over TCP "
                        "against raw NIXL and kvservice with UCX_TLS=tcp)")
    two = p.add_argument_group("two hosts")
    where = two.add_mutually_exclusive_group()
    where.add_argument("--listen", metavar="HOST:PORT",
                       help="be the receiving side: wait for one --peer run (port 0: any free port)")
    where.add_argument("--peer", metavar="HOST:PORT", help="drive a run against a --listen side and report it")
    two.add_argument("--ucx-tls", metavar="LIST", help="UCX_TLS for this side's NIXL agents (e.g. rc,ud,sm,self "
                     "for RDMA or tcp); default: UCX's own choice (on one host: the inherited value)")
    two.add_argument("--net-devices", metavar="LIST", help="UCX_NET_DEVICES for this side's agents "
                     "(e.g. mlx5_0:1 or eth0); default: all (on one host: lo)")
    two.add_argument("--auth-key-file", metavar="PATH", help=f"the cluster key (also ${KEY_ENV}); "
                     "required between hosts unless --allow-unauthenticated; on loopback: this user's own key")
    two.add_argument("--allow-unauthenticated", action="store_true",
                     help="run without a key (anyone who reaches the ports can take part; on loopback, any local user)")
    two.add_argument("--wait", type=float, default=600.0, metavar="S",
                     help="--listen: how long to wait for a peer; --peer: for the listener to accept (default 600)")
    return p.parse_args(list(argv))


def ucx_env(args: argparse.Namespace, two_hosts: bool) -> dict[str, str | None]:
    """UCX's variables for this side's children (``None``: removed from their environment)."""
    devices = args.net_devices or (os.environ.get("UCX_NET_DEVICES") if two_hosts else "lo")
    env: dict[str, str | None] = {"UCX_NET_DEVICES": devices}
    if args.ucx_tls:
        env["UCX_TLS"] = args.ucx_tls
    return env


class UsageError(KVServiceError):
    """The command line asks for something that cannot run (a bad address, no key off
    loopback, an unknown part or method).  ``main`` prints it and exits ``EXIT_USAGE``."""


def _address(text: str, *, port_zero: bool) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if port_zero and sep and port == "0" and host:
        return host.strip("[]"), 0
    try:
        return split_address(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _key(args: argparse.Namespace, host: str) -> tuple[bytes | None, str | None]:
    """The key and its file, as a service so configured resolves them (on loopback without
    a key file: this user's key); refuses a keyless run off loopback unless allowed."""
    path = args.auth_key_file or os.environ.get(KEY_ENV) or None
    if path is None and not is_loopback_host(host) and not args.allow_unauthenticated:
        raise UsageError(f"{host} is not loopback: give the cluster key (--auth-key-file or ${KEY_ENV}, "
                         "`kvservice keygen PATH` writes one), or --allow-unauthenticated to run without one")
    try:
        if path is not None:
            return load_key(path, what="--auth-key-file"), path
        source = resolve_key(None, allow_unauthenticated=args.allow_unauthenticated, loopback=True)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    return source.key, source.path


def _plan(args: argparse.Namespace, parts: set[str]) -> tuple[Plan, set[str]]:
    plan = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            raise UsageError("--repeats must be at least 1")
        plan = Plan(**{**plan.__dict__, "repeats": args.repeats})
    only = set((args.only or ",".join(sorted(parts))).split(","))
    if not only <= parts:
        raise UsageError(f"--only takes a comma-separated subset of {','.join(sorted(parts))}, got {args.only!r}")
    return plan, only


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds as Ctrl-C does: the finally blocks below stop the processes it started
    with sigterm_as_sigint():
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    try:
        if args.listen:
            host, port = _address(args.listen, port_zero=True)
            key, key_file = _key(args, host)
            return listen(ListenOptions(
                host=host, port=port, wait_s=args.wait, key=control.bench_key(key), key_file=key_file,
                allow_unauthenticated=args.allow_unauthenticated, ucx=ucx_env(args, two_hosts=True)))
        if args.peer:
            host, port = _address(args.peer, port_zero=False)
            key, key_file = _key(args, host)
            plan, only = _plan(args, TWO_HOST_PARTS)
            return _drive(args, plan, only, peer=(host, port), key=key, key_file=key_file)
        plan, only = _plan(args, PARTS | set(engines.PARTS))
        return _drive(args, plan, only)
    except UsageError as exc:
        log(f"kvservice bench: {exc}")
        return EXIT_USAGE


def _connect(args: argparse.Namespace, peer: tuple[str, int], key: bytes | None, plan: Plan) -> Link:
    sock = dial(peer, args.wait)
    chan = control.Channel(sock, join_address(*peer))
    link = Link(chan, plan.pool_pages)
    try:
        link.welcome = control.driver_handshake(chan, control.bench_key(key)).kvservice
        link.sync_clock()
    except ControlError:
        sock.close()
        raise
    return link


def _tcp_methods(args: argparse.Namespace, plan: Plan, env: dict[str, str | None],
                 skipped: dict[str, str]) -> list[Method]:
    """Raw NIXL and kvservice with UCX restricted to TCP, and Mooncake (over TCP here):
    like for like; Mooncake is skipped, with the reason, without its optional package."""
    tcp = {**env, **TCP_ENV}
    out: list[Method] = [RawNixl(LLAMA3_8B, plan.pool_pages, env=tcp, name="raw_nixl/tcp"),
                         KvService(LLAMA3_8B, plan.pool_pages, loop=args.loop, gc=args.kv_gc, env=tcp,
                                   name="kvservice/tcp")]
    mooncake = Mooncake(LLAMA3_8B, plan.pool_pages)
    why_not = mooncake.unavailable()
    if why_not is None:
        out.append(mooncake)
    else:
        skipped[mooncake.name] = why_not
        log(f"  {mooncake.name}: skipped ({why_not})")
    return out


def identities(directory: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A throwaway cluster in ``directory``: its authority and key, a prefill member for
    the sending side and a decode member for the receiving one.  (The settings both sides
    share, each side's own.)"""
    create_authority(directory, "bench")
    key = os.path.join(directory, "cluster.key")
    generate_key(key)
    sides: dict[str, dict[str, Any]] = {}
    for side, role in (("send", "prefill"), ("recv", "decode")):
        os.mkdir(out := os.path.join(directory, side))
        cert, member_key = issue(directory, role, f"bench-{role}", out)
        sides[side] = {"identity_cert_file": cert, "identity_key_file": member_key}
    return {"auth_key_file": key, "identity_ca_file": os.path.join(directory, CA_CERT)}, sides


def _select(names: str, methods: list[Method], skipped: dict[str, str],
            only: set[str]) -> tuple[list[Method], dict[str, str]]:
    """``--methods``: the methods named (a skipped one stays skipped, with its reason)."""
    want = set(names.split(","))
    known = {m.name for m in methods} | set(skipped)
    if not want <= known:
        raise UsageError(f"--methods takes a comma-separated subset of {','.join(sorted(known))}, got {names!r}")
    if only & {"memory", "kill"} and "kvservice" not in want:
        raise UsageError("memory and kill measure kvservice: add it to --methods, or leave them out of --only")
    kept, why = [m for m in methods if m.name in want], {k: v for k, v in skipped.items() if k in want}
    if not kept:
        raise UsageError("nothing of --methods can run here: " + "; ".join(f"{k}: {v}" for k, v in why.items()))
    for m in methods:
        if m.name not in want:
            m.close()
    return kept, why


def _drive(args: argparse.Namespace, plan: Plan, only: set[str], *, peer: tuple[str, int] | None = None,
           key: bytes | None = None, key_file: str | None = None) -> int:
    """Run the bench and write its report: on this host, or driving a listener at ``peer``."""
    cases = [c for c in all_cases(plan, args.seed) if c.workload in only]
    meta = machine()
    t0 = time.monotonic()
    env = ucx_env(args, two_hosts=peer is not None)
    log(f"kvservice bench ({'quick' if args.quick else 'full'}): {len(cases)} cases x {plan.repeats} repeats "
        f"on {meta['cores']} cores, load {meta['load_avg_start']:.2f}")

    log_file = tempfile.NamedTemporaryFile("w", prefix="kvservice-bench-", suffix=".log", delete=False)
    _lines.child_stderr = log_file  # NIXL and UCX write to stderr; keep the terminal readable
    link: Link | None = None
    methods: list[Method] = []
    skipped: dict[str, str] = {}
    probe: Child | None = None
    workdir: str | None = None  # --identity's authority and members
    results: dict[str, Any] = {"meta": meta, "plan": plan.__dict__, "layout": LLAMA3_8B,
                               "options": {"loop": args.loop, "kv_gc": args.kv_gc, "seed": args.seed}}
    code = EXIT_FAILED
    keep_log = False  # only a failed run's, and only with something in it
    try:
        if peer is None:
            kv = KvService(LLAMA3_8B, plan.pool_pages, loop=args.loop, gc=args.kv_gc, env=env)
            methods = [Limit(LLAMA3_8B, plan.pool_pages), RawNixl(LLAMA3_8B, plan.pool_pages, env=env), kv]
            sidecar = Sidecar(LLAMA3_8B, plan.pool_pages, loop=args.loop)
            why_not = sidecar.unavailable()
            if why_not is None:
                methods.append(sidecar)
            else:
                skipped[sidecar.name] = why_not
            if args.verify_landing:  # the same processes' code, receivers checking every landing
                methods.append(KvService(LLAMA3_8B, plan.pool_pages, loop=args.loop, gc=args.kv_gc, env=env,
                                         service={"verify_landing": True}, name=VERIFY))
            if args.identity:  # the same processes' code, each side proving its own member
                workdir = tempfile.mkdtemp(prefix="kvservice-bench-identity-")
                shared, sides = identities(workdir)
                methods.append(KvService(LLAMA3_8B, plan.pool_pages, loop=args.loop, gc=args.kv_gc, env=env,
                                         service=shared, sides=sides, name=IDENTITY))
            if not args.no_tcp:
                methods += _tcp_methods(args, plan, env, skipped)
            if args.methods:
                methods, skipped = _select(args.methods, methods, skipped, only)
        else:
            link = _connect(args, peer, key, plan)
            service: dict[str, Any] = {"host": link.local_ip, "ucx_env": {k: v for k, v in env.items() if v}}
            if key_file:
                service["auth_key_file"] = key_file
            if args.allow_unauthenticated:
                service["allow_unauthenticated"] = True
            kv = KvService(LLAMA3_8B, plan.pool_pages, loop=args.loop, gc=args.kv_gc, env=env, service=service,
                           remote=link)
            methods = [RawNixl(LLAMA3_8B, plan.pool_pages, env=env, remote=link), kv]
            skipped = {"limit": "a copy within one host bounds nothing between two",
                       "sidecar": "measured on one host: its cost is a local Unix-socket hop"}
            link.setup("quick" if args.quick else "full", [m.name for m in methods], args.loop, args.kv_gc)
            meta["two_hosts"] = {
                "local": link.local_ip, "peer": link.chan.peer, "peer_kvservice": link.welcome,
                "rtt_ms": round(link.rtt_s * 1e3, 3), "authenticated": key is not None,
                "ucx": {k: v for k, v in env.items() if v}, "clock_offset_s": link.offset}
            log(f"  linked to {link.chan.peer} from {link.local_ip}: rtt {link.rtt_s * 1e3:.2f} ms, "
                f"{'authenticated' if key is not None else 'NOT authenticated'}")
        results["methods"] = [m.name for m in methods] + list(skipped)
        results["skipped"] = skipped
        if not (cases or only & {"memory", "kill"}):
            methods = []  # only engine-memory cases: they start processes of their own
            results["methods"], results["skipped"] = [], {}
        if methods:
            probe = Child("kvservice.bench.lagprobe", args.loop, {})
            for m in methods:
                m.start()
            probe.wait("ready", SETUP_TIMEOUT_S)
            log(f"  started in {time.monotonic() - t0:.1f} s")
        results["cases"] = []
        if cases:
            warm_up(methods, cases)
            runs = run_cases(methods, cases, plan, probe)
            results["cases"] = aggregate(cases, runs, methods)
        if "memory" in only:
            n = 4096 if not args.quick else 64
            results["memory"] = memory_per_request(kv, n)
            log(f"  memory: {results['memory']['peak_per_request']:.0f} B per in-flight request (peak, n={n})")
            # the vetting child every service starts: a failure to start one is the report's to say
            results["vetting"] = vetting.measure(args.loop, vetting.QUICK_RUNS if args.quick else vetting.RUNS, env)
            log(f"  {report.vetting_line(results['vetting'])}")
        if "kill" in only:
            results["kill"] = kill_test(kv, plan)
        if only & set(engines.PARTS):
            for m in methods:  # the engine cases run alone on the cores
                m.close()
            methods = []
            if probe is not None:
                probe.close()
                probe = None
            results["engines"] = engines.run(only, args.quick, args.repeats, args.loop, env)
        code = EXIT_OK
    except (ChildError, ControlError) as exc:
        log_file.flush()
        keep_log = os.path.getsize(log_file.name) > 0
        log(f"kvservice bench: {exc}" + (f" (children's stderr: {log_file.name})" if keep_log else ""))
        if link is not None:
            link.chan.try_error(f"driver: {exc}")
    finally:
        for m in methods:
            m.close()
        if probe is not None:
            probe.close()
        log_file.close()
        if not keep_log:  # an interrupted run's too: it names no log
            with contextlib.suppress(FileNotFoundError):
                os.unlink(log_file.name)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    if code != EXIT_OK:
        if link is not None:
            link.close()
        return code
    results["targets"] = evaluate(results) + engines.evaluate(results.get("engines", {}))
    meta["load_avg_end"] = os.getloadavg()[0]
    meta["wall_s"] = round(time.monotonic() - t0, 1)
    table = report.table(results)
    if link is not None:
        try:
            link.stop(True, table)
        except ControlError as exc:
            log(f"kvservice bench: the listener did not end the session cleanly: {exc}")
            code = EXIT_FAILED
        finally:
            link.close()
    args.out.mkdir(parents=True, exist_ok=True)
    report.write_json(results, args.out / "bench.json")
    print(table)
    png = None
    if not args.no_chart:
        png = report.chart(results, args.out / "bench.png")
        log(f"chart: {png}" if png else "chart: skipped (matplotlib is not installed: pip install 'kvservice[bench]')")
    (args.out / "results.md").write_text(report.markdown(results, png.name if png else None))
    log(f"results: {args.out / 'bench.json'} ({meta['wall_s']} s)")
    return code
