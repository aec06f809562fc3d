"""Fixtures the unit tests share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvservice.keygen import main as keygen


@pytest.fixture
def ca(tmp_path: Path) -> str:
    """A cluster authority (``kvservice keygen ca``, cluster ``c1``) in a fresh folder: its path."""
    folder = str(tmp_path / "ca")
    os.mkdir(folder)
    assert keygen(["ca", folder, "--cluster", "c1"]) == 0
    return folder
