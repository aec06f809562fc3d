"""A NIXL agent that lies about who it is: run as ``python -m tests.forger`` with a JSON
object on stdin.

NIXL takes a notification's sender name from the sender: an agent that holds a
service's NIXL metadata (any peer it ever linked with has it) can send it a
notification under any name.  This child creates an agent named ``name``, loads
``metadata`` (hex) and sends each of ``notifs`` (hex) to agent ``peer``, then prints
``sent`` and exits.  The fault tests use it to forge completions and settle fences.
"""

from __future__ import annotations

import json
import logging
import sys
import time


def main() -> None:
    spec = json.loads(sys.stdin.read())
    from nixl._api import nixl_agent, nixl_agent_config

    logging.getLogger("nixl").setLevel(logging.WARNING)
    agent = nixl_agent(spec["name"], nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                                       backends=["UCX"]))
    agent.add_remote_agent(bytes.fromhex(spec["metadata"]))
    for notif in spec["notifs"]:
        agent.send_notif(spec["peer"], bytes.fromhex(notif))
    # UCX sends asynchronously: keep progressing its worker a while before exiting, longer
    # than a target holding only cold Expects takes to poll NIXL again (its idle cadence,
    # ``idle_poll_interval_s``: 1 s), which its side of the connection needs
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        agent.get_new_notifs()
        time.sleep(0.01)
    print("sent", flush=True)


if __name__ == "__main__":
    main()
