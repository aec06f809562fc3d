"""``SidecarClient.live_peers``: a worker asks its sidecar daemon which members etcd holds,
as an engine asks its in-process ``TransferService``.  Real ``kvservice serve`` daemons
registered in a real etcd."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvservice import SidecarClient
from tests.helpers import eventually, scaled
from tests.sidecar.daemons import CONFIG, sidecars

from .etcd_server import EtcdServer

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]

GUARD_S = scaled(30.0)  # a hang guard, never a timed assertion


def etcd_config(tmp_path: Path, role: str, name: str) -> Path:
    """config/<role>.toml, registering in etcd as ``name`` with ``role``."""
    text = (CONFIG / f"{role}.toml").read_text()
    path = tmp_path / f"{name}.toml"
    keys = f'discovery_name = "{name}"\ndiscovery_role = "{role}"\n'
    path.write_text(text.replace("[service]\n", f"[service]\n{keys}", 1))
    return path


async def test_a_worker_lists_the_live_peers_through_its_sidecar(etcd: EtcdServer, tmp_path: Path) -> None:
    env = {"KVSERVICE_DISCOVERY": "etcd", "KVSERVICE_ETCD_ENDPOINTS": etcd.endpoint, "KVSERVICE_CLUSTER": "sc"}
    with sidecars("prefill", config=etcd_config(tmp_path, "prefill", "prefill-0"), env=env) as [prefill], \
            sidecars("decode", config=etcd_config(tmp_path, "decode", "decode-0"), env=env) as [decode]:
        async with SidecarClient(decode.socket) as client:
            await eventually(lambda: client.status()["discovery"]["members"] == 1, timeout=GUARD_S)
            members = await client.live_peers()
            assert [(m.name, m.role) for m in members] == [("prefill-0", "prefill")]  # not the daemon itself
            assert members[0].address == prefill.address
            assert await client.live_peers(role="prefill") == members
            assert await client.live_peers(role="decode") == []
            assert await client.live_peers(role="x" * 200) == []  # no member has such a role


async def test_static_discovery_lists_no_peers() -> None:
    with sidecars("decode") as [decode]:
        async with SidecarClient(decode.socket) as client:
            assert await client.live_peers() == []
