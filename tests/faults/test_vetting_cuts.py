"""An honest peer cut off while its metadata is vetted is vetted apart, never refused.

A trial load connects to the peer's UCX listener.  Cut off (its link down), the connect
fails after ~3 s (the kernel's unanswered ARP requests) and NIXL refuses the load; with
every packet dropped instead, the load hangs past ``load_timeout_s``.  Either replaces the
vetting child, but neither says anything about the bytes: the soak saw an honest prefill,
cut mid-handshake twice, refused for a vetting backoff afterwards.  Such costs now give a
source its first strike (its metadata vetted on a lane of its own) and escalate only when
they come close together (``Strikes.window_s``).

Real parts: the peer's bare NIXL agents in one network namespace, a ``MetadataVetter`` (and
its child) in another, joined by a veth that the test cuts.  Its strikes' backoff is 600 s,
so one escalation would refuse every later load here.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.faults import netns

pytestmark = pytest.mark.nixl

ROOT = Path(__file__).resolve().parents[2]
#: hang guard per answer (a child boots NIXL; a cut load takes 3 s, a hung one its timeout)
ANSWER_S = 90.0
#: the vetter's load timeout here: a dropped-packets load hangs ~38 s, so it is killed at this
LOAD_TIMEOUT_S = 4.0
PEERS = 7

# The peer: bare NIXL agents (no memory: only their metadata is loaded) on the veth.
_PEERS = """
import select, sys
from kvservice._nixl.trial import TrialLoader
agents = [TrialLoader(f"cut-peer-{i}", ucx_env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": sys.argv[1]})
          for i in range(int(sys.argv[2]))]
print(" ".join(bytes(a._agent.get_agent_metadata()).hex() for a in agents), flush=True)
while not select.select([sys.stdin], [], [], 0.01)[0] or sys.stdin.readline():
    for a in agents:
        a.progress()
"""

# The vetting side: a MetadataVetter whose answers, strikes and children are printed per load.
_VETTER = """
import json, sys, time
import anyio
from kvservice._trust.strikes import Strikes
from kvservice._trust.vetting import MetadataVetter

async def main():
    async with anyio.create_task_group() as tg:
        vetter = MetadataVetter(tg, {"UCX_TLS": "tcp", "UCX_NET_DEVICES": sys.argv[1]},
                                load_timeout_s=float(sys.argv[3]),
                                strikes=Strikes(base_s=600.0, max_s=600.0, window_s=float(sys.argv[4])))
        vetter.start()
        await vetter.ready()
        print(json.dumps({"ready": vetter.serving}), flush=True)
        source = sys.argv[2]
        async for line in anyio.wrap_file(sys.stdin):
            t0 = time.monotonic()
            refusal = await vetter.vet(bytes.fromhex(line.strip()), source)
            now = time.monotonic()
            print(json.dumps({"refusal": refusal.kind if refusal else None, "took": now - t0,
                              "strikes": vetter.strikes.count(source, now),
                              "backoff": vetter.strikes.refused(source, now) is not None,
                              "children": vetter.children_started}), flush=True)
        tg.cancel_scope.cancel()

anyio.run(main)
"""


class Lines:
    """A child process in a namespace, spoken to in lines; every read bounded in time."""

    def __init__(self, host: netns.Host, script: str, *args: str) -> None:
        self.proc = subprocess.Popen([*host.prefix, sys.executable, "-c", script, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})

    def read(self, timeout: float = ANSWER_S) -> str:
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            pytest.fail(f"no answer within {timeout:g} s")
        line = self.proc.stdout.readline()
        assert line, f"the child ended (exit {self.proc.poll()})"
        return line.strip()

    def ask(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer: dict[str, Any] = json.loads(self.read())
        return answer

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@contextmanager
def sides(window_s: float) -> Iterator[tuple[netns.Wire, list[str], Lines, Lines]]:
    """The wire, the peer's metadata (one per agent: each a digest of its own), the vetter
    (its strikes' ``window_s`` as given) and the peer."""
    netns.require()
    with netns.wire() as w:
        peer = Lines(w.a, _PEERS, w.a.dev, str(PEERS))
        vetter: Lines | None = None
        try:
            metadata = peer.read().split()
            vetter = Lines(w.b, _VETTER, w.b.dev, w.a.ip, str(LOAD_TIMEOUT_S), str(window_s))
            assert json.loads(vetter.read()) == {"ready": True}
            yield w, metadata, vetter, peer
        finally:
            if vetter is not None:
                vetter.close()
            peer.close()


def test_a_peer_cut_off_while_vetted_is_vetted_apart_and_never_refused() -> None:
    """Cuts spaced out (here: any spacing, ``window_s`` 0), link down or every packet dropped."""
    with sides(window_s=0.0) as (w, metadata, vetter, _):
        first = vetter.ask(metadata[0])
        assert first == {**first, "refusal": None, "strikes": 0, "children": 1}

        # link down: NIXL refuses the load once the connect fails (~3 s), and the Join goes on
        # to the door's own load, which says the same; the child is replaced
        w.a.link_down()
        cut = vetter.ask(metadata[1])
        assert cut["refusal"] is None and cut["took"] >= 2.5, cut
        assert cut["strikes"] == 1 and not cut["backoff"], cut
        w.a.link_up()
        healed = vetter.ask(metadata[2])  # on the source's own lane now: a child of its own
        assert healed == {**healed, "refusal": None, "strikes": 1, "backoff": False}
        assert healed["children"] >= 2, healed  # (the shared lane's replacement may still be starting)

        # cut again, on its own lane: still one strike, still not refused
        w.a.link_down()
        again = vetter.ask(metadata[3])
        assert again["took"] >= 2.5 and again["strikes"] == 1 and not again["backoff"], again
        w.a.link_up()

        # every packet dropped while the peer's address is known (a load just made a connection
        # to it): the connect waits on unanswered SYNs (38 s here), the child is killed at the
        # load timeout and the link refused for now (vetting_unavailable), the source not backed off
        assert vetter.ask(metadata[4])["refusal"] is None
        w.a.drop_all()
        try:
            hung = vetter.ask(metadata[5])
        finally:
            w.a.unshape()
        assert hung["refusal"] == "vetting_unavailable" and hung["took"] >= LOAD_TIMEOUT_S, hung
        assert hung["strikes"] == 1 and not hung["backoff"], hung

        last = vetter.ask(metadata[6])
        assert last == {**last, "refusal": None, "strikes": 1, "backoff": False}


def test_loads_refused_close_together_still_back_the_source_off() -> None:
    """The other side of the rule: such costs within ``window_s`` of the last escalate (600 s
    here), so a source cannot cost a child again and again for free.  NIXL refuses these
    loads at once: the peer's process is gone, and its host refuses the connect on the spot
    (a service refuses a dead peer's Join before any load: ``ControlStream.hung_up``)."""
    with sides(window_s=600.0) as (_, metadata, vetter, peer):
        assert vetter.ask(metadata[0])["refusal"] is None
        peer.close()  # its agents and their UCX listeners go with it
        first = vetter.ask(metadata[1])
        assert first["refusal"] is None and first["strikes"] == 1 and not first["backoff"], first
        second = vetter.ask(metadata[2])
        assert second["strikes"] == 2 and second["backoff"], second
        third = vetter.ask(metadata[3])
        assert third["refusal"] == "vetting_backoff" and third["strikes"] == 2, third
