"""Vetting the metadata of a peer whose host drops every packet: loaded, nobody charged.

The vetting child's trial load (``_trust.vetting``) makes UCX connect to the peer; UCX's TCP
connects block by default.  A peer whose network black-holes packets just after its handshake
(a cut, a broken switch) held the child 3 s, then NIXL refused the load: the child was counted
tainted and replaced, and the peer's source charged, so a few such cuts locked an honest
prefill out of a decode for seconds to minutes (``vetting_backoff``).  The trial agent now
connects without blocking: it unpacks the metadata and loads it at once.

Real parts: a NIXL agent in one network namespace, every packet it sends dropped
(``netem``/``blackhole``), and a ``MetadataVetter`` with its real vetting child in the other,
vetting that agent's metadata twice from the same source.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults import netns

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
#: hang guards for the children (Python, NIXL and torch imports on a loaded machine)
START_S = 120.0
RUN_S = 120.0

#: in host a: a NIXL agent with a registered pool; its metadata to ``argv[2]``, then it waits
PEER = """
import json, sys, time
from kvservice._nixl.agent import NixlDoor
from kvservice.memory._pool import KVPool
from tests.helpers import SMALL, register_pool
door = NixlDoor("kv-cut-peer", progress_thread=False, ucx_env={"UCX_NET_DEVICES": sys.argv[1]})
pool = KVPool(SMALL)
register_pool(door, pool)
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(door.metadata().hex())
import os
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
while True:
    door.notifs()
    time.sleep(0.01)
"""

#: in host b: a vetter and its child vet that metadata twice from one source; the outcome as JSON
VETTER = """
import json, sys, anyio
from kvservice._trust.vetting import MetadataVetter

async def main():
    metadata = bytes.fromhex(open(sys.argv[2]).read())
    async with anyio.create_task_group() as tg:
        vetter = MetadataVetter(tg, {"UCX_NET_DEVICES": sys.argv[1]})
        vetter.start()
        with anyio.fail_after(100):
            await vetter.ready()
            refusals = [await vetter.vet(metadata, "10.213.0.1") for _ in range(2)]
        print(json.dumps({"refusals": [r and r.kind for r in refusals], "charged": len(vetter.strikes),
                          "children": vetter.children_started, "serving": vetter.serving}), flush=True)
        tg.cancel_scope.cancel()

anyio.run(main)
"""


def test_metadata_of_a_peer_cut_off_is_loaded_and_charges_nobody(tmp_path: Path) -> None:
    netns.require()
    md = tmp_path / "metadata"
    with netns.wire() as w:
        peer = subprocess.Popen([*w.a.prefix, sys.executable, "-c", PEER, w.a.dev, str(md)], cwd=ROOT)
        try:
            deadline = time.monotonic() + START_S
            while not md.exists():
                assert peer.poll() is None, f"the peer exited: {peer.returncode}"
                assert time.monotonic() < deadline, "the peer did not start"
                time.sleep(0.1)
            w.drop_all(w.a)  # from now on every packet the peer sends is dropped
            run = subprocess.run([*w.b.prefix, sys.executable, "-c", VETTER, w.b.dev, str(md)], cwd=ROOT,
                                 capture_output=True, text=True, timeout=RUN_S)
        finally:
            peer.kill()
            peer.wait()
    assert run.returncode == 0, run.stdout + run.stderr
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    # loaded both times (the first load connects in the background), the child never
    # replaced, the source never charged
    assert outcome == {"refusals": [None, None], "charged": 0, "children": 1, "serving": True}, outcome
