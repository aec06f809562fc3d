"""kvservice as a library is quiet: an application that configures no logging sees
nothing on stdout and only warnings on stderr, during transfers and failures alike,
and no raw UCX line when a peer dies (UCX's lines are kvservice's ``ucx.*`` events
unless the operator sets ``UCX_LOG_FILE``); the command-line entry points still print
what they did."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl

REPO = Path(__file__).resolve().parents[2]
#: what the services log below WARNING in this run (they would show if logging leaked)
#: a line of NIXL's C++ log (Abseil's format): ``E1202 04:46:56.936129   26884 nixl_agent.cpp:1198] ...``
NIXL_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\.cpp:\d+\]", re.MULTILINE)
INFO_EVENTS = ("service.key", "service.started", "peer.connected", "transfer.completed", "service.stopped")


def _env() -> dict[str, str]:
    # no KVSERVICE_* or UCX_LOG_* from the caller: the defaults are what is tested
    return {k: v for k, v in os.environ.items() if not k.startswith(("KVSERVICE_", "UCX_LOG"))}


def test_unconfigured_library_writes_nothing_to_stdout(tmp_path: Path) -> None:
    out = tmp_path / "outcome.json"
    proc = subprocess.run([sys.executable, "-m", "tests.system.quiet_app", str(out)], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text()) == {"sent": "SUCCESS", "verified": True, "lost": "PEER_LOST"}
    assert proc.stdout == ""
    # Python's lastResort handler: warnings and above, one message per line
    assert "peer.lost" in proc.stderr or "transfer.failed" in proc.stderr, proc.stderr
    leaked = [event for event in INFO_EVENTS if event in proc.stderr]
    assert not leaked, proc.stderr
    # the peer's death is kvservice's to report: UCX's own words about it are not printed
    assert "UCX  ERROR" not in proc.stderr, proc.stderr
    assert not NIXL_LINE.search(proc.stderr), proc.stderr  # nor NIXL's own (its C++ log)


def _ucx_log_child(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "tests.system.ucx_log_child"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 0 and proc.stdout == "", proc
    return proc


def test_ucx_lines_are_kvservice_events() -> None:
    proc = _ucx_log_child(_env())
    assert "UCX  ERROR" not in proc.stderr, proc.stderr
    # at debug, in kvservice's words, with UCX's message
    assert "kvservice.ucx DEBUG ucx.peer_unreachable" in proc.stderr, proc.stderr
    assert "Connection refused" in proc.stderr, proc.stderr


def test_the_operators_ucx_log_file_wins() -> None:
    proc = _ucx_log_child({**_env(), "UCX_LOG_FILE": "stderr"})
    assert "UCX  ERROR connect(" in proc.stderr, proc.stderr
    assert "ucx.peer_unreachable" not in proc.stderr, proc.stderr


def test_entry_points_still_print(tmp_path: Path) -> None:
    key = tmp_path / "cluster.key"
    keygen = subprocess.run([sys.executable, "-m", "kvservice.cli", "keygen", str(key)], cwd=REPO, env=_env(),
                            capture_output=True, text=True, timeout=60, check=False)
    assert keygen.returncode == 0 and "wrote a new key" in keygen.stdout, keygen
    check = subprocess.run([sys.executable, "-m", "kvservice.cli", "check-config", "config/prefill.toml"],
                           cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 0 and check.stdout.startswith("# effective configuration"), check
