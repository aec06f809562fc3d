"""A pure-torch stand-in for ``sgl_kernel`` that lets SGLang serve a small Llama on a CPU.

SGLang (``SGLANG_USE_CPU_ENGINE=1``) imports its CPU ops from ``sgl_kernel`` at start; the
``sgl_kernel`` of SGLang's environment is a CUDA build that cannot load without ``libcuda``, and
no CPU build of it is published.  The server tests put this folder's parent first on
``PYTHONPATH``.

Provides one op, the only one a small Llama calls on the CPU engine:

- ``assign_req_to_token_pool_cpu``: writes each request's new KV slots into its row of the
  request-to-token table.

Every other name imports (SGLang imports many at module level) but raises
``NotImplementedError`` naming itself when called, so a new op a model needs fails loudly.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, _row_len: int) -> None:
    """``req_to_token[req, start:end] = out_cache_loc[pos:pos + end - start]``, ``pos`` the
    running sum of the lengths, for each request of the batch in order."""
    pos = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = int(end) - int(start)
        req_to_token[req, start:end] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name}: not in the test stand-in (tests/integrations/sglang/kernels)")

    missing.__name__ = name
    return missing
