"""``kvservice.sidecar.local``: the environment a local daemon gets, and a daemon
that cannot start reported with its reason (the daemons that do start are the
rest of this directory's)."""

from __future__ import annotations

import os
import shutil

import pytest

from kvservice.sidecar.local import DaemonError, LocalDaemon, daemon_env, short_tmpdir

from .daemons import REPO


def test_daemon_env_gives_own_names_and_drops_settings_meant_for_the_caller() -> None:
    base = {"PATH": "/bin", "KVSERVICE_HTTP_PORT": "9400", "KVSERVICE_SIDECAR_MAX_CLIENTS": "3"}
    env = daemon_env("/tmp/x/p.sock", "seg", role="prefill", layout={"num_pages": 8, "dtype": "float16"},
                     base=base, KVSERVICE_LOG_LEVEL="error")
    assert env == {
        "PATH": "/bin",
        "KVSERVICE_SIDECAR_SOCKET_PATH": "/tmp/x/p.sock", "KVSERVICE_SIDECAR_SHM_NAME": "seg",
        "KVSERVICE_HTTP_PORT": "0", "KVSERVICE_SERVICE_PORT": "0", "KVSERVICE_SIDECAR_ROLES": "prefill",
        "KVSERVICE_LAYOUT_NUM_PAGES": "8", "KVSERVICE_LAYOUT_DTYPE": "float16", "KVSERVICE_LOG_LEVEL": "error",
    }


def test_each_daemon_gets_names_of_its_own() -> None:
    a, b = LocalDaemon("prefill", "/tmp/a"), LocalDaemon("prefill", "/tmp/b")
    assert a.socket != b.socket and a.shm != b.shm


def test_a_daemon_that_cannot_start_raises_with_the_end_of_its_log() -> None:
    workdir = short_tmpdir()
    try:
        d = LocalDaemon("decode", workdir, env={"KVSERVICE_LAYOUT_NUM_PAGES": "0"},
                        log_path=os.path.join(workdir, "decode.log"), cwd=REPO)
        with pytest.raises(DaemonError, match=r"(?s)exited 2 before it was ready.*layout\.num_pages"):
            d.start(timeout=60)
        assert d.names_gone()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
