"""Makes UCX log an error on purpose (run by ``test_quiet_library``): an agent loads a
partner's metadata, unloads it and the partner goes at once, so UCX's connection to it
is refused (``UCX  ERROR connect(...) failed: Connection refused``).  Logging goes to
stderr, warnings and above plus every ``kvservice.ucx`` event; stdout stays empty."""

from __future__ import annotations

import logging
import time

from kvservice._config import host_ucx_defaults
from kvservice._nixl.agent import door_environment
from kvservice._nixl.trial import TrialLoader
from tests.helpers import LOOPBACK_UCX

#: how long the agent is driven after its partner went: UCX's refusal came within ms
DRIVE_S = 2.0


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("kvservice.ucx").setLevel(logging.DEBUG)
    ucx_env = {**host_ucx_defaults(), **LOOPBACK_UCX}
    with door_environment(ucx_env):  # as the door's first agent in a process starts
        agent = TrialLoader("ucx-log-child", ucx_env=ucx_env)
    partner = TrialLoader("ucx-log-partner", ucx_env=ucx_env)
    assert agent.try_load(bytes(partner._agent.get_agent_metadata())) is None
    del partner
    deadline = time.monotonic() + DRIVE_S
    while time.monotonic() < deadline:
        agent.progress()
        time.sleep(0.01)


if __name__ == "__main__":
    main()
