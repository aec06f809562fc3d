"""``kvservice cluster``: the cluster as an operator wants to see it, read from etcd.

    kvservice cluster --endpoints etcd-0:2379 --cluster prod
    kvservice cluster --config /etc/kvservice/decode.toml [--json]

One line per registered service: name, role, address, incarnation, age, linked peers,
requests in flight (as the service last reported them, every few seconds).  Entries that
are no valid member (a key that is not UTF-8 or not a member name, a value that does
not decode, a second claim of one agent) are skipped, and counted by why on stderr.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time
from collections.abc import Sequence

import anyio

from .._exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from .._results import ConfigError
from ._etcd import Etcd, EtcdMissing, EtcdUnavailable
from .member import Member, read_listing, services_prefix
from .registry import options
from .settings import DiscoverySettings


def _settings(args: argparse.Namespace) -> DiscoverySettings:
    """The config file's discovery keys (the sidecar's format, its ``[service]`` section, with
    ``KVSERVICE_*`` overrides), or the defaults; then the command line's, over them."""
    if args.config:
        from ..sidecar.settings import load

        settings = load(args.config).service.discovery_settings
    else:
        settings = DiscoverySettings()
    endpoints = tuple(e.strip() for e in args.endpoints.split(",") if e.strip()) if args.endpoints else None
    return dataclasses.replace(settings, discovery="etcd", etcd_endpoints=endpoints or settings.etcd_endpoints,
                               cluster=args.cluster or settings.cluster)


async def _members(cfg: DiscoverySettings) -> tuple[list[Member], collections.Counter[str]]:
    """The members, by role and name, and how many entries were skipped, by why."""
    etcd = await Etcd.connect(options(cfg))
    try:
        _, entries = await etcd.list(services_prefix(cfg.cluster))
    finally:
        await etcd.close()
    found, ignored = read_listing(entries, services_prefix(cfg.cluster))
    return sorted(found, key=lambda m: (m.role, m.name)), collections.Counter(why.why for _, why in ignored)


def _skipped(ignored: collections.Counter[str]) -> str:
    if not ignored:
        return ""
    return f"; skipped {ignored.total()} ({', '.join(f'{why}={n}' for why, n in sorted(ignored.items()))})"


def _age(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvservice cluster", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The cluster as an operator wants to see it, read from etcd: one line per\n"
                    "registered service (name, role, address, incarnation, age, linked peers,\n"
                    "requests in flight).  Entries that are no valid member are skipped, and\n"
                    "counted by why on stderr.",
        epilog="examples:\n  kvservice cluster --endpoints etcd-0:2379 --cluster prod\n"
               "  kvservice cluster --config /etc/kvservice/decode.toml --json")
    parser.add_argument("--config", help="a sidecar config file: its [service] etcd options")
    parser.add_argument("--endpoints", help="etcd endpoints, comma-separated (over the config's)")
    parser.add_argument("--cluster", help="cluster name (over the config's; default 'default')")
    parser.add_argument("--json", action="store_true", help="one JSON array of the members")
    args = parser.parse_args(list(argv))
    try:
        cfg = _settings(args)
        members, ignored = anyio.run(_members, cfg)
    except ConfigError as exc:
        print(f"kvservice cluster: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (EtcdUnavailable, EtcdMissing) as exc:
        print(f"kvservice cluster: {exc}", file=sys.stderr)
        return EXIT_FAILED
    now = time.time()
    if args.json:
        print(json.dumps([{"name": m.name, "role": m.role, "address": m.address, "agent": m.agent,
                           "incarnation": m.incarnation, "age_s": round(m.age_s(now), 1), "linked": m.linked,
                           "inflight": m.inflight, "memory": m.memory} for m in members]))
    else:
        rows = [("NAME", "ROLE", "ADDRESS", "INCARNATION", "AGE", "LINKED", "IN-FLIGHT")]
        rows += [(m.name, m.role or "-", m.address, str(m.incarnation), _age(m.age_s(now)), str(m.linked),
                  str(m.inflight)) for m in members]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print(f"{len(members)} services in cluster {cfg.cluster!r}{_skipped(ignored)}", file=sys.stderr)
    return EXIT_OK
