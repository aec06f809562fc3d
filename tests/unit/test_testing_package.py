"""``kvservice.testing`` ships for others, and the service never depends on it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvservice
import kvservice.testing

PACKAGE = Path(kvservice.__file__).parent
#: the commands that run their peers as child processes through the doubles
USERS = {"demo.py", "soak"}


def test_importing_the_service_leaves_its_doubles_unloaded() -> None:
    probe = ("import sys, kvservice, kvservice.cli, kvservice.engine, kvservice.sidecar\n"
             "print(sorted(m for m in sys.modules if m.startswith('kvservice.testing')))\n"
             "import kvservice.testing\n"
             "print('kvservice.testing.peer' in sys.modules)")
    out = subprocess.run([sys.executable, "-W", "error", "-c", probe], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    assert out[0] == "[]"
    # nor does the package import its child side: ``python -m kvservice.testing.peer``
    # would then run a second copy of a module already imported, and Python warns of
    # that on every peer's stderr
    assert out[1] == "False"


def _imports_testing(path: Path) -> bool:
    package = path.relative_to(PACKAGE.parent).parts[:-1]  # the importing module's package
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):  # ``from ..testing import X``: against the package
            base = package[: len(package) - node.level + 1] if node.level else ()
            names = [".".join([*base, *([node.module] if node.module else [])])]
            names += [f"{names[0]}.{alias.name}" for alias in node.names]
        else:
            continue
        if any(n == "kvservice.testing" or n.startswith("kvservice.testing.") for n in names):
            return True
    return False


def test_only_the_commands_that_run_child_peers_import_the_doubles() -> None:
    importers = {
        path.relative_to(PACKAGE).parts[0] for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).parts[0] != "testing" and _imports_testing(path)
    }
    assert importers == USERS


def test_the_public_surface_says_where_to_import_it() -> None:
    for name in kvservice.testing.__all__:
        assert getattr(kvservice.testing, name).__module__ == "kvservice.testing", name
