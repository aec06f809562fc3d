"""The metadata-vetting child starts light: NIXL and the module that loads with it, not the service.

Every service (every engine rank) runs one child (``_trust.vetting``), and a peer's first
link may wait for it to serve.  When it ran ``kvservice``'s ``__init__`` it imported the whole
service and torch: ~590 MiB resident and ~2.3 s of CPU per rank in SGLang's environment
(docs/perf).  The child is started here as a service starts it, with Python's import log on
(``PYTHONPROFILEIMPORTTIME``: the child inherits it and writes the log to the stderr it shares
with this process), and its mapped libraries are read from ``/proc``.
"""

from __future__ import annotations

import anyio
import pytest

from kvservice._trust.vetting import MetadataVetter
from tests.helpers import config

pytestmark = pytest.mark.nixl

#: all the child may import of kvservice: the loader and the error it raises
LIGHT = {"kvservice._nixl", "kvservice._nixl.trial", "kvservice._results"}


async def test_the_vetting_child_imports_neither_torch_nor_the_service(
        capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    async with anyio.create_task_group() as tg:
        vetter = MetadataVetter(tg, config().ucx_environment)
        vetter.start()
        with anyio.fail_after(60):  # a bound for a loaded machine, not a speed check
            await vetter.ready()
        pid = vetter.pid
        assert vetter.serving and pid is not None
        maps = await anyio.Path(f"/proc/{pid}/maps").read_text()
        libraries = {line.split()[-1] for line in maps.splitlines() if "/" in line}
        tg.cancel_scope.cancel()
    log = capfd.readouterr().err.splitlines()
    imported = {line.rsplit("|", 1)[1].strip() for line in log if line.startswith("import time:")}
    top = {name.split(".")[0] for name in imported}
    assert any(name.startswith("nixl") for name in top), "no import log from the child"  # the log is read
    assert "torch" not in top and not [path for path in libraries if "/torch/" in path]
    assert {name for name in imported if name.split(".")[0] == "kvservice"} <= LIGHT
