"""The engine example runs as documented: a decode crash mid-run, a restart,
and every request accounted for."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..helpers import scaled
from .daemons import REPO

pytestmark = pytest.mark.nixl


def test_prefill_engine_example_survives_a_decode_crash() -> None:
    out = subprocess.run(
        [sys.executable, "examples/prefill_engine.py", "--spawn", "--requests", "30", "--crash-after", "8",
         "--after-restart", "5", "--interval", "0.02"],
        cwd=REPO, capture_output=True, text=True, timeout=scaled(300), check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every request accounted for" in out.stdout
    assert "-- SIGKILL the decode sidecar" in out.stdout
    assert "after the restart: 5 of 5 succeeded" in out.stdout, out.stdout
    assert "35 of 35 requests ended" in out.stdout
