"""SGLang's ``nixl`` transfer backend with its KV pool in host memory, for ``benchmarks.sglang_pd``.

SGLang's NIXL backend labels every KV region ``VRAM`` unless the scheduler says otherwise
(``_normalize_kv_mem_kinds`` in ``sglang/srt/disaggregation/nixl/conn.py``: the prefill passes
no kinds, the decode passes ``VRAM`` for its pool).  On a CPU-only server the pool is host
memory, and NIXL's UCX backend refuses to register host pages as ``VRAM``.  This directory,
first on a server's ``PYTHONPATH`` in the ``nixl`` arm only, makes the function answer ``DRAM``
for what it would have called ``VRAM`` once that module is imported; nothing else of SGLang
changes.  The engine is otherwise the same in every arm.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

TARGET = "sglang.srt.disaggregation.nixl.conn"


def _in_dram(module: Any) -> None:
    normalize = module._normalize_kv_mem_kinds

    def normalize_in_dram(kinds: Any, expected_len: int) -> list[str]:
        return ["DRAM" if kind == "VRAM" else kind for kind in normalize(kinds, expected_len)]

    module._normalize_kv_mem_kinds = normalize_in_dram


class _OnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of ``TARGET`` to patch it once executed."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _in_dram(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _OnImport())
