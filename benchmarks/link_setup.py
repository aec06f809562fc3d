"""How long a peer link takes to set up: dial, handshake, vetting and NIXL load on both
sides, ``expect()`` returning.  Pairs of in-process services on 127.0.0.1, one link each.

    python -m benchmarks.link_setup [--pairs 6] [--cold] [--identity]

By default each service's vetting child is started before the link is timed, so the
figure is what every link pays; ``--cold`` times each pair's first link with the
children starting (what the first peer of a service waits, once).  Runs on code
without vetting too (then there is nothing to start), for a before/after comparison.
``--identity``: both services hold a cluster key and a member identity each (a CA made
for the run), so the handshake signs and checks certificates; without it, this user's key.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import anyio

from kvservice import KVLayout, ServiceConfig, TransferService

LAYOUT = KVLayout(layers=2, page_tokens=16, kv_heads=2, head_dim=64, dtype="bfloat16", num_pages=64)


def identities(folder: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two members' settings from an authority made in ``folder``."""
    from kvservice._trust.authority import CA_CERT, create_authority, issue
    from kvservice._trust.keys import generate_key

    create_authority(folder, "bench")
    key = os.path.join(folder, "cluster.key")
    generate_key(key)
    members = []
    for name in ("tx", "rx"):
        cert, member_key = issue(folder, "bench", name, folder)
        members.append({"auth_key_file": key, "identity_cert_file": cert, "identity_key_file": member_key,
                        "identity_ca_file": os.path.join(folder, CA_CERT)})
    return members[0], members[1]


async def one_link(cold: bool, members: tuple[dict[str, Any], dict[str, Any]] | None) -> float:
    tx_id, rx_id = members or ({}, {})
    base = {"layout": LAYOUT, "ucx_env": {"UCX_NET_DEVICES": "lo"}, "drain_grace_s": 0.5}
    async with TransferService(ServiceConfig(**base, **tx_id)) as tx, \
            TransferService(ServiceConfig(**base, **rx_id)) as rx:
        if not cold:
            for svc in (tx, rx):
                vetter = getattr(svc, "_vetter", None)
                if vetter is not None:
                    await vetter.ready()
        t0 = time.perf_counter()
        await rx.expect("r1", [1, 2], sender=tx.address)
        elapsed = time.perf_counter() - t0
        await rx.abort("r1")
    return elapsed


async def main(pairs: int, cold: bool, identity: bool) -> None:
    with tempfile.TemporaryDirectory() as folder:
        members = identities(folder) if identity else None
        times = [await one_link(cold, members) for _ in range(pairs)]
    ms = ", ".join(f"{t * 1e3:.1f}" for t in times)
    kind = ("cold" if cold else "warm") + (", member identities" if identity else "")
    print(f"link set-up ({kind}): median {statistics.median(times) * 1e3:.1f} ms "
          f"over {pairs} pairs ({ms})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--identity", action="store_true")
    args = parser.parse_args()
    anyio.run(main, args.pairs, args.cold, args.identity)
