"""The control run's connector: kvservice's, except that a load's blocks are overwritten
with noise after they arrived and before vLLM reads them (KV corrupted on the way).  If
the decode's tokens still matched the single engine's, the tokens would not depend on
the KV the connector moved, and the tests proved nothing."""

from __future__ import annotations

from typing import Any

import torch

from kvservice.integrations.vllm import KVServiceConnector


class CorruptingConnector(KVServiceConnector):
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = list(kv_caches.values())
        super().register_kv_caches(kv_caches)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        # a load reported now has landed; vLLM reads its blocks from the next step on
        for rid in results.finished_recving - results.failed_recving:
            blocks = list(self.__dict__.get("_loaded_blocks", {}).pop(rid, ()))
            for cache in self._caches:
                cache[blocks] = torch.randn_like(cache[blocks])
        return results

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        loaded = self.__dict__.setdefault("_loaded_blocks", {})
        for recv in getattr(meta, "recvs", ()):
            loaded[recv.req_id] = recv.blocks
        super().start_load_kv(forward_context, **kwargs)
