"""SGLang's ``KVArgs`` as ``kvservice.memory``, its aux rows as a payload, and the bootstrap
registry: the parts of the SGLang backend that need no SGLang (the rest runs in SGLang's
own environment, ``tests/integrations/sglang``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
import torch

from kvservice import ConfigError
from kvservice.integrations.sglang import bootstrap
from kvservice.integrations.sglang.memory import AuxRows, kv_memory
from kvservice.integrations.sglang.settings import service_config

PAGE = 4


def kv_args(bufs: list[torch.Tensor], **kw: Any) -> SimpleNamespace:
    fields = {"kv_data_ptrs": [t.data_ptr() for t in bufs], "kv_data_lens": [t.nbytes for t in bufs],
              "kv_item_lens": [t[0].nbytes * PAGE for t in bufs], "page_size": PAGE}
    return SimpleNamespace(**{**fields, **kw})


def test_an_mha_pool_is_its_k_and_v_buffers_interleaved_by_layer() -> None:
    k = [torch.zeros(32, 2, 8) for _ in range(3)]
    v = [torch.zeros(32, 2, 8) for _ in range(3)]
    memory = kv_memory(kv_args(k + v), is_mla=False, tp_size=2, tp_rank=1)
    assert (memory.layers, memory.num_pages, memory.tp_size, memory.tp_rank) == (3, 8, 2, 1)
    assert [(r.layer, r.kind, r.addr) for r in memory.regions] == [
        (layer, kind, t.data_ptr()) for layer in range(3) for kind, t in (("k", k[layer]), ("v", v[layer]))]
    first = memory.regions[0]  # the rank's 2 heads of 8 float32 as one head of 64 bytes
    assert (first.page_stride, first.tokens, first.heads, first.head_dim) == (PAGE * 2 * 8 * 4, PAGE, 1, 2 * 8 * 4)


def sglang_kv_args(mode: str, bufs: list[torch.Tensor], aux: list[torch.Tensor]) -> SimpleNamespace:
    """``KVArgs`` with exactly the fields SGLang 0.5.23's schedulers set before ``KVManager(...)``
    for an MHA pool (``disaggregation/prefill.py`` and ``decode.py``, ``_init_kv_manager``):
    the prefill also sets ``kv_head_num``, ``total_kv_head_num``, ``gpu_id`` (and more that
    the backend does not read); the decode none of those three."""
    fields: dict[str, Any] = {
        "engine_rank": 0, "pp_rank": 0, "system_dp_rank": 0, "kv_cache_dtype_str": "auto", "kv_layout": None,
        "kv_data_ptrs": [t.data_ptr() for t in bufs], "kv_data_lens": [t.nbytes for t in bufs],
        "kv_item_lens": [t[0].nbytes * PAGE for t in bufs], "num_draft_entries": 0, "kv_layer_ids": [0, 1, 0, 1],
        "page_size": PAGE, "aux_data_ptrs": [t.data_ptr() for t in aux], "aux_data_lens": [t.nbytes for t in aux],
        "aux_item_lens": [t[0].nbytes for t in aux], "state_types": []}
    if mode == "prefill":
        fields.update(kv_head_num=bufs[0].shape[1], total_kv_head_num=bufs[0].shape[1], gpu_id=0,
                      prefill_start_layer=0, prefill_end_layer=2, rust_http_port=None, ib_device=None)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("heads", [1, 8])
def test_both_sides_describe_one_model_the_same_from_what_sglang_sets(heads: int) -> None:
    """A model with 8 KV heads (Llama, Qwen, Mistral): the decode's pool, described from the
    ``KVArgs`` SGLang's decode builds (no ``kv_head_num``), pairs with the prefill's."""
    from kvservice.memory._pairing import compare, pair

    aux = [torch.zeros(8, 16, dtype=torch.int32)]
    sides = {mode: [torch.zeros(32, heads, 16, dtype=torch.bfloat16) for _ in range(4)] for mode in ("p", "d")}
    prefill = kv_memory(sglang_kv_args("prefill", sides["p"], aux), is_mla=False, tp_size=1, tp_rank=0)
    decode = kv_memory(sglang_kv_args("decode", sides["d"], aux), is_mla=False, tp_size=1, tp_rank=0)
    assert compare(prefill, decode) is None and compare(decode, prefill) is None
    assert [(r.heads, r.head_dim, r.page_bytes) for r in prefill.regions] == \
        [(r.heads, r.head_dim, r.page_bytes) for r in decode.regions]
    assert not isinstance(pair(prefill, decode), str)


def test_an_mla_pool_is_one_latent_region_per_layer() -> None:
    latent = [torch.zeros(32, 1, 24, dtype=torch.bfloat16) for _ in range(2)]
    memory = kv_memory(kv_args(latent), is_mla=True, tp_size=4, tp_rank=3)
    assert [(r.layer, r.kind, r.heads, r.head_dim) for r in memory.regions] == [(0, "latent", 1, 48),
                                                                                (1, "latent", 1, 48)]
    assert memory.latent


@pytest.mark.parametrize(("change", "says"), [
    ({"kv_data_ptrs": []}, "non-empty"),
    ({"kv_item_lens": [0, 1]}, "positive"),
    ({"page_size": 0}, "page_size"),
    ({"num_draft_entries": 2}, "draft"),
    ({"kv_data_lens": [512, 1000]}, "whole number of pages"),
])
def test_kv_args_that_do_not_describe_a_pool_are_refused_by_name(change: dict[str, Any], says: str) -> None:
    bufs = [torch.zeros(32, 2, 8) for _ in range(2)]
    with pytest.raises(ValueError, match=says):
        kv_memory(kv_args(bufs, **change), is_mla=False, tp_size=1, tp_rank=0)


def test_an_mha_pool_needs_k_and_v_buffers() -> None:
    with pytest.raises(ValueError, match="odd count"):
        kv_memory(kv_args([torch.zeros(32, 2, 8) for _ in range(3)]), is_mla=False, tp_size=1, tp_rank=0)


def test_an_aux_row_travels_as_bytes_and_lands_in_the_same_row_elsewhere() -> None:
    def rows() -> tuple[list[torch.Tensor], AuxRows]:
        bufs = [torch.zeros(8, 16, dtype=torch.int32), torch.zeros(8, 8, dtype=torch.uint64)]
        return bufs, AuxRows(SimpleNamespace(aux_data_ptrs=[t.data_ptr() for t in bufs],
                                             aux_data_lens=[t.nbytes for t in bufs],
                                             aux_item_lens=[t[0].nbytes for t in bufs]))

    (src, out), (dst, into) = rows(), rows()
    src[0][3] = torch.arange(16, dtype=torch.int32)
    src[1][3, 0] = 2**40 + 5
    payload = out.read(3)
    assert len(payload) == out.row_bytes == 16 * 4 + 8 * 8
    into.write(6, payload)
    assert torch.equal(dst[0][6], src[0][3]) and int(dst[1][6, 0]) == 2**40 + 5
    assert not dst[0][3].any()
    with pytest.raises(ValueError, match="aux row is 128 bytes"):
        into.write(6, payload[:-1])
    with pytest.raises(ValueError, match="past the end"):
        out.read(8)


def test_the_registry_serves_what_ranks_registered_and_refuses_the_rest() -> None:
    """Without a key (``allow_unauthenticated``) registrations are believed: the newest wins."""
    registry = bootstrap.Registry("127.0.0.1", 0, key=None)
    addr = f"127.0.0.1:{registry.port}"
    try:
        with pytest.raises(bootstrap.BootstrapError, match="no kvservice ranks"):
            bootstrap.lookup(addr)  # 503 until a rank registers
        info = {"attn_tp_size": 2, "dp_size": 1, "page_size": 16, "kv_cache_dtype": "auto", "is_mla": False}
        bootstrap.register(addr, 0, 1, "127.0.0.1:7001", info, key=None, incarnation="a")
        bootstrap.register(addr, 0, 0, "127.0.0.1:7000", info, key=None, incarnation="b")
        bootstrap.register(addr, 0, 0, "127.0.0.1:7002", info, key=None, incarnation="c")  # the newest wins
        assert bootstrap.lookup(addr) == (info, {"0/0": "127.0.0.1:7002", "0/1": "127.0.0.1:7001"})
        with pytest.raises(bootstrap.BootstrapError, match="refused"):
            bootstrap.register(addr, 0, 2, "127.0.0.1:7003", {**info, "page_size": 32}, key=None,
                               incarnation="d")  # another pool
        with structlog.testing.capture_logs() as logs:
            for body in (b"{", b"[]", json.dumps({"dp_rank": 0, "tp_rank": 99999, "address": "h:1",
                                                   "info": info}).encode()):
                req = urllib.request.Request(f"http://{addr}{bootstrap.PATH}", data=body, method="PUT")
                with pytest.raises(urllib.error.HTTPError) as refused:
                    urllib.request.urlopen(req, timeout=10)
                assert refused.value.code == 400
                refused.value.close()
        assert registry.refused == {"conflict": 1, "registration": 3}  # the other pool, then the bodies
        assert [e["event"] for e in logs] == ["sglang.bootstrap.refused"] * 3
    finally:
        registry.close()


def test_a_lookup_of_nothing_or_of_something_else_is_a_bootstrap_error() -> None:
    with pytest.raises(ValueError, match="host:port"):
        bootstrap.lookup("nonsense")
    registry = bootstrap.Registry("127.0.0.1", 0, key=None)
    port = registry.port
    registry.close()
    with pytest.raises(bootstrap.BootstrapError, match=f"127.0.0.1:{port}"):
        bootstrap.lookup(f"127.0.0.1:{port}", timeout=2)


# -- SGLang's timeouts -------------------------------------------------------------------------

SGLANG_DEFAULTS = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": 300, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": 300}


def sglang_reader(**set_: int) -> Any:
    """What SGLang's ``envs.<NAME>.get()`` answers: the value set, else its default."""
    return lambda name: set_.get(name, SGLANG_DEFAULTS[name])


def test_sglangs_timeouts_stand_for_the_bootstrap_and_arrival_timeouts() -> None:
    cfg = service_config(0, env={}, read=sglang_reader())
    assert (cfg.bootstrap_timeout_s, cfg.arrival_timeout_s) == (300.0, 300.0)  # SGLang's defaults, not ours
    tuned = service_config(0, env={}, read=sglang_reader(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=45,
                                                         SGLANG_DISAGGREGATION_WAITING_TIMEOUT=90))
    assert (tuned.bootstrap_timeout_s, tuned.arrival_timeout_s) == (45.0, 90.0)


def test_kvservices_own_setting_wins_only_where_it_is_set(tmp_path: Any) -> None:
    read = sglang_reader(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=45, SGLANG_DISAGGREGATION_WAITING_TIMEOUT=90)
    by_env = service_config(0, env={"KVSERVICE_SERVICE_BOOTSTRAP_TIMEOUT_S": "7"}, read=read)
    assert (by_env.bootstrap_timeout_s, by_env.arrival_timeout_s) == (7.0, 90.0)
    toml = tmp_path / "kvservice.toml"
    toml.write_text("[service]\narrival_timeout_s = 11.0\n")
    by_file = service_config(0, env={"KVSERVICE_CONFIG": str(toml)}, read=read)
    assert (by_file.bootstrap_timeout_s, by_file.arrival_timeout_s) == (45.0, 11.0)
    both = service_config(0, env={"KVSERVICE_CONFIG": str(toml), "KVSERVICE_SERVICE_ARRIVAL_TIMEOUT_S": "3"},
                          read=read)
    assert both.arrival_timeout_s == 3.0  # the environment over the file, as everywhere


def test_a_sglang_timeout_that_cannot_be_one_names_sglangs_variable() -> None:
    with pytest.raises(ConfigError, match=r"SGLANG_DISAGGREGATION_WAITING_TIMEOUT=0: .*arrival_timeout_s"):
        service_config(0, env={}, read=sglang_reader(SGLANG_DISAGGREGATION_WAITING_TIMEOUT=0))


def test_the_payload_bound_holds_one_aux_row() -> None:
    assert service_config(1 << 20, env={}, read=sglang_reader()).max_payload_bytes == 1 << 20
