"""The previous release, for the mixed-version tests: its ``kvservice`` package taken from
the repository's history into a folder of its own, run in child processes with that
folder first on ``PYTHONPATH`` (the same interpreter and dependencies; nothing of this
checkout is imported there).

``PREVIOUS`` moves with each release: docs/operations.md "Upgrades" says which versions talk.
``KVSERVICE_PREVIOUS_TREE`` names a folder holding such a ``kvservice`` package instead
(e.g. a wheel unpacked there), for a checkout without the history.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

#: the release before this one: control protocol 5, sidecar wire 2
PREVIOUS = "47714debc1657e018832e021bba389302f56b7b6"
PREVIOUS_PROTOCOL = 5
PREVIOUS_SIDECAR = 2
REPO = Path(__file__).resolve().parents[2]


def previous_tree() -> Path:
    """A folder whose ``kvservice`` package is the previous release's (made once, kept
    under the user's cache).  Raises ``RuntimeError`` saying how to get it when the
    history is not there: a mixed-version test must not silently test nothing."""
    given = os.environ.get("KVSERVICE_PREVIOUS_TREE")
    if given:
        return Path(given)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvservice" / "previous"
    tree = cache / PREVIOUS
    if (tree / "kvservice" / "__init__.py").exists():
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", PREVIOUS, "kvservice"],
                                 capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        raise RuntimeError(
            f"the previous release ({PREVIOUS[:12]}) is not in this checkout's history: clone with "
            f"history, or set KVSERVICE_PREVIOUS_TREE ({exc!r} {detail.decode(errors='replace').strip()})") from exc
    staging = Path(tempfile.mkdtemp(dir=cache, prefix="unpacking-"))
    try:
        with tempfile.TemporaryFile() as f:
            f.write(archive)
            f.seek(0)
            with tarfile.open(fileobj=f) as tar:
                tar.extractall(staging, filter="data")
        try:
            staging.rename(tree)
        except OSError:  # another run unpacked it first
            if not (tree / "kvservice" / "__init__.py").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tree


def previous_env() -> dict[str, str]:
    """The environment a child runs the previous release in: its tree first on the path,
    and not the working directory (``python -m`` would put a checkout's own package
    there, ahead of ``PYTHONPATH``)."""
    return {"PYTHONPATH": str(previous_tree()), "PYTHONSAFEPATH": "1"}
