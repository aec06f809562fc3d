"""An application that embeds kvservice and configures no logging at all (run by
``test_quiet_library``): a transfer that succeeds, then a peer SIGKILLed while this
side waits for its request, so the failure path logs too.  It writes what happened
to the file named by argv[1], never to stdout: its stdout is what the test checks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from typing import Any

import anyio

from kvservice import TransferService
from kvservice.testing import PeerProcess, pattern
from tests.helpers import READY_S, SMALL, config, peer_config


async def main(out_path: str) -> None:
    outcome: dict[str, Any] = {}
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            # the peer's own log (it configures itself, as kvservice's children do) is not ours
            peer = await PeerProcess.start(tg, peer_config(), stderr=subprocess.DEVNULL, ready_timeout=READY_S)
            try:
                async with TransferService(config()) as svc:
                    svc.kv.write([1, 2], pattern(SMALL, "ok", 2))
                    await peer.command(op="expect", rid="ok", pages=[10, 11], sender=svc.address)
                    await peer.event("expecting", "ok")
                    handle = await svc.send("ok", [1, 2], last=True)
                    sent = await svc.await_completion(handle, timeout=20)
                    outcome["sent"] = sent.status.value
                    outcome["verified"] = (await peer.event("arrived", "ok"))["verified"]
                    await svc.expect("lost", [20, 21], sender=peer.address)
                    peer.signal(signal.SIGKILL)
                    lost = await svc.await_arrival("lost", timeout=20)
                    outcome["lost"] = lost.reason.value if lost.reason else lost.status.value
            finally:
                with anyio.CancelScope(shield=True):
                    await peer.stop(timeout=5)
                tg.cancel_scope.cancel()
    await anyio.Path(out_path).write_text(json.dumps(outcome))


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
