"""A process that ran a service exits with its own exit code, not a crash in a library's
destructor.

On a host with ``libibverbs`` installed and no RDMA device, UCX's InfiniBand module
left ``libnl-route`` to segfault when the process exited (every NIXL agent's process
ended -11 after a clean shutdown); the service leaves those modules unloaded there
(``kvservice._config.host_ucx_defaults``).  On a host without ``libibverbs`` the
crash cannot happen and these tests pass either way."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvservice import ServiceConfig
from kvservice._config import RDMA_DEVICES, UCX_RDMA_MODULES, host_ucx_defaults

pytestmark = pytest.mark.nixl

SERVICE = textwrap.dedent("""
    import anyio
    from kvservice import KVLayout, ServiceConfig, TransferService

    async def main() -> None:
        layout = KVLayout(layers=2, kv_heads=2, head_dim=8, page_tokens=4, num_pages=4)
        async with TransferService(ServiceConfig(layout=layout, ucx_env={"UCX_NET_DEVICES": "lo"})) as svc:
            print(svc.config.ucx_environment.get("UCX_MODULES"), flush=True)

    anyio.run(main)
    print("exiting", flush=True)
""")


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SERVICE], env=env, capture_output=True, text=True, timeout=120)


def test_a_service_process_exits_zero() -> None:
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    done = _run(env)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.splitlines()[-1] == "exiting"
    modules = done.stdout.splitlines()[0]  # what the agent was created with
    if not os.path.isdir(RDMA_DEVICES) or not os.listdir(RDMA_DEVICES):
        assert modules == UCX_RDMA_MODULES
        assert host_ucx_defaults() == {"UCX_MODULES": UCX_RDMA_MODULES}
    else:
        assert modules == "None"


def test_an_operators_setting_wins() -> None:
    """``ucx_env`` (and the process's environment, see ``_nixl.trial.ucx_environment``) win over
    the host's defaults."""
    cfg = ServiceConfig(ucx_env={"UCX_MODULES": "^cma"})
    assert cfg.ucx_environment["UCX_MODULES"] == "^cma"
