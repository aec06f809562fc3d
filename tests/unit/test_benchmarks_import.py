"""Every developer benchmark in ``benchmarks/`` still imports: they reach into private
modules (``benchmarks.hops`` patches the door and the watchdog), and nothing else runs
them in CI, so a move of those modules must break here, not in the next person's hands.
Modules that run inside an engine's own environment skip when that engine is absent."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: modules loaded only in an engine's environment, and the engine each needs
ENGINE_ONLY = {"vllm_pd_timing": "vllm"}
MODULES = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")


def test_the_benchmarks_are_found() -> None:
    assert {"compare", "cpu", "hops", "vllm_pd"} <= set(MODULES), MODULES


@pytest.mark.parametrize("name", MODULES)
def test_a_benchmark_module_imports(name: str) -> None:
    if name in ENGINE_ONLY:
        pytest.importorskip(ENGINE_ONLY[name], reason=f"benchmarks.{name} runs in {ENGINE_ONLY[name]}'s environment")
    importlib.import_module(f"benchmarks.{name}")
