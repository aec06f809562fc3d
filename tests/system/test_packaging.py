"""The wheel: what ``python -m build`` puts in it, and ``kvservice bench`` from it alone.

The wheel is built from a copy of the source tree (so no ``build/`` of an earlier
build can leak into it) with ``--no-isolation`` (the test extra brings ``build``
and a setuptools that reads SPDX license expressions; no index is needed).  The
second test installs it into a fresh virtual environment, torch first as the
README says (never letting pip resolve another torch), and runs ``kvservice bench
--quick`` from a directory outside the checkout: the bench must run from the
wheel alone, write its report, and say that the chart was skipped (matplotlib is
the ``bench`` extra, not installed here).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import scaled

REPO = Path(__file__).resolve().parents[2]
#: pip's note about this machine's configured index folders, not about the package
_PIP_INDEX_NOTE = re.compile(r"^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$")
#: not copied: version control, environments and build or tool output (tests/, docs/ and benchmarks/ are
#: copied: the package's configuration must keep them out)
_SKIP_COPY = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
                                    ".hypothesis")


def _run(*argv: str | Path, cwd: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=scaled(timeout),
                          env=env, check=False)
    assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _no_warnings(output: str) -> None:
    lines = [ln for ln in output.splitlines() if re.search(r"warn|deprecat", ln, re.IGNORECASE)]
    bad = [ln for ln in lines if not _PIP_INDEX_NOTE.match(ln.strip())
           and "byte-compiling is disabled" not in ln]  # PYTHONDONTWRITEBYTECODE, not the package
    assert not bad, bad


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src") / "kvservice"
    shutil.copytree(REPO, src, ignore=_SKIP_COPY)
    out = tmp_path_factory.mktemp("dist")
    log = _run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", out, ".", cwd=src, timeout=120)
    _no_warnings(log)
    (built,) = out.glob("kvservice-*.whl")
    return built


def test_wheel_holds_the_package_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        dist = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(f"{dist}/METADATA").decode()
        entry_points = z.read(f"{dist}/entry_points.txt").decode()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"kvservice", dist}, tops
    for forbidden in ("tests/", "benchmarks/", "docs/", "examples/", "config/"):
        assert not [n for n in names if f"/{forbidden}" in f"/{n}"], forbidden
    assert not [n for n in names if Path(n).name in ("bench.json", "bench.png", "results.md")]
    for module in ("main", "run", "control", "listen", "remote", "raw_nixl", "kv_side", "report", "mooncake_side"):
        assert f"kvservice/bench/{module}.py" in names, module
    # the doubles other projects test against ship too (``python -m kvservice.testing.peer``)
    for module in ("__init__", "peer", "peer_process", "fake_door", "pages"):
        assert f"kvservice/testing/{module}.py" in names, module
    assert re.search(r"^\[console_scripts\]\s*\nkvservice = kvservice\.cli:main$", entry_points, re.MULTILINE)
    # SGLang's plugin loader finds the transfer backend here (docs/sglang.md)
    assert re.search(r"^\[sglang\.srt\.plugins\]\s*\nkvservice = kvservice\.integrations\.sglang\.plugin:register$",
                     entry_points, re.MULTILINE)
    assert "License-Expression: Apache-2.0" in metadata
    assert f"{dist}/licenses/LICENSE" in names


@pytest.mark.slow
@pytest.mark.nixl
@pytest.mark.timeout(420)
def test_bench_runs_from_the_wheel_alone(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path, timeout=120)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # torch first, as scripts/setup.sh does: the CPU build on this machine's disk
    _run(py, "-m", "pip", "install", "--quiet", "torch==2.13.0", cwd=tmp_path, timeout=240, env=env)
    _no_warnings(_run(py, "-m", "pip", "install", wheel, cwd=tmp_path, timeout=180, env=env))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    log = _run(venv / "bin" / "kvservice", "bench", "--quick", "--only", "w1,w2", "--out", "report",
               cwd=outside, timeout=240, env=env)
    assert "chart: skipped (matplotlib is not installed" in log
    assert "kv/raw" in log
    # the Mooncake baseline is an extra: without it, its rows are skipped with the reason, the rest runs
    assert ("mooncake/tcp: skipped (Mooncake's Transfer Engine is not installed: "
            "pip install 'kvservice[mooncake]')") in log
    results = json.loads((outside / "report" / "bench.json").read_text())
    assert {c["workload"] for c in results["cases"]} == {"w1", "w2"}
    assert (outside / "report" / "results.md").is_file() and not (outside / "report" / "bench.png").exists()
    assert results["meta"]["versions"]["torch"].startswith("2.13.0")
