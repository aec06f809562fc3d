"""Hostile values at every entry SGLang hands the kvservice backend (a property test).

The room and the bootstrap address come from a client's request body; the DP rank, the page
indices and the aux index from SGLang's schedulers.  Whatever they are, the constructor and
every call return, ``poll()`` answers ``KVPoll.Failed``, and ``failure_exception()`` raises
``TransferFailed`` (``REFUSED``) whose message names the value that was refused; the
rejected request leaves nothing live in the engine.  One prefill and one decode manager in
this process (SGLang's own ``KVArgs`` and ``MetadataBuffers``, two real NIXL agents, a real
bootstrap registry on 127.0.0.1) serve every example, and a good request still moves after
them.  Runs in SGLang's environment, like ``test_sglang_backend.py``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from .needs import HAVE_SGLANG

if not HAVE_SGLANG:
    if os.environ.get("KVSERVICE_REQUIRE_SGLANG"):
        raise RuntimeError("KVSERVICE_REQUIRE_SGLANG is set, but SGLang is not installed here")
    pytest.skip("SGLang is not installed here: run with the python of scripts/engine-env.sh sglang",
                allow_module_level=True)

import numpy as np
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvservice import FailureReason, TransferFailed
from kvservice._control.addresses import split_address
from tests.helpers import free_port

#: importing SGLang's scheduler modules on a CPU machine warns (CUDA-only kernels): theirs, not ours
pytestmark = [pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

LAYERS, HEADS, HEAD_DIM, PAGE, NUM_PAGES, AUX_ROWS = 2, 8, 4, 4, 16, 8
FAILED, SUCCESS = 0, 4
ROOMS = itertools.count(1000)
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def manager(mode: str, port: int) -> tuple[Any, list[torch.Tensor]]:
    """A rank's ``KVManager`` over an 8-KV-head MHA pool, ``KVArgs`` filled as SGLang's own
    scheduler of that mode fills it (its decode sets no ``kv_head_num``)."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import DisaggregationMode, MetadataBuffers

    from kvservice.integrations.sglang.conn import KVManager

    bufs = [torch.zeros(NUM_PAGES * PAGE, HEADS, HEAD_DIM) for _ in range(2 * LAYERS)]
    meta = MetadataBuffers(AUX_ROWS, hidden_size=8, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4)
    args = KVArgs()
    args.engine_rank, args.pp_rank, args.system_dp_rank, args.kv_cache_dtype_str = 0, 0, 0, "auto"
    args.kv_data_ptrs = [t.data_ptr() for t in bufs]
    args.kv_data_lens = [t.nbytes for t in bufs]
    args.kv_item_lens = [t[0].nbytes * PAGE for t in bufs]
    args.num_draft_entries, args.page_size, args.state_types = 0, PAGE, []
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = meta.get_buf_infos()
    if mode == "prefill":
        args.kv_head_num = args.total_kv_head_num = HEADS
        args.gpu_id = 0
    server_args = SimpleNamespace(tp_size=1, dp_size=1, enable_dp_attention=False, pp_size=1, device="cpu",
                                  host="127.0.0.1", dist_init_addr=None, disaggregation_bootstrap_port=port)
    kind = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
    mgr = KVManager(args, kind, server_args, False)
    mgr._keep = (bufs, meta)  # the buffers live as long as the manager
    return mgr, bufs


@pytest.fixture(scope="module")
def pair() -> Iterator[SimpleNamespace]:
    from kvservice.integrations.sglang.conn import KVBootstrapServer, KVReceiver, KVSender

    port = free_port()
    server = KVBootstrapServer("127.0.0.1", port)
    prefill, pbufs = manager("prefill", port)
    decode, dbufs = manager("decode", port)
    try:
        yield SimpleNamespace(prefill=prefill, decode=decode, addr=f"127.0.0.1:{port}", sender=KVSender,
                              receiver=KVReceiver, pbufs=pbufs, dbufs=dbufs)
    finally:
        decode.close()
        prefill.close()
        server.close()


def refused(side: Any, *names: str) -> None:
    """``Failed`` for good, ``REFUSED`` saying which value, the original error as its cause,
    and nothing of it live once cleared."""
    assert side.poll() == FAILED and side.poll() == FAILED
    with pytest.raises(TransferFailed) as failed:
        side.failure_exception()
    assert failed.value.reason is FailureReason.REFUSED, failed.value
    assert failed.value.__cause__ is not None, failed.value
    for name in names:
        assert name in str(failed.value), (name, str(failed.value))
    assert len(str(failed.value)) < 600
    side.clear()
    engine = side.kv_mgr.engine
    assert side.request_id not in {t.request_id for t in engine.live()}


def is_address(value: Any) -> bool:
    try:
        split_address(value)
    except ValueError:
        return False
    return True


anything = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=40),
                     st.binary(max_size=20), st.lists(st.integers(), max_size=3),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
bad_rooms = st.one_of(anything, st.integers(max_value=-1), st.integers(min_value=2**64),
                      st.integers(-2**63, -1).map(np.int64), st.just(10**5000))
bad_addrs = st.one_of(anything, st.text(max_size=60).filter(lambda a: not is_address(a)),
                      st.sampled_from(["127.0.0.1", "127.0.0.1:", ":8998", "127.0.0.1:0", "127.0.0.1:65536",
                                       "127.0.0.1:-1", "a b:80", "x" * 10_000 + ":80", "127.0.0.1:\uff18\uff19"]))
bad_ranks = st.one_of(anything, st.integers(max_value=-1), st.integers(min_value=4096),
                      st.integers(-2**31, -1).map(np.int32))


def bad_indices(limit: int) -> st.SearchStrategy[Any]:
    return st.one_of(
        anything, st.integers(),
        st.lists(st.integers(max_value=-1), min_size=1, max_size=4),
        st.lists(st.integers(min_value=limit), min_size=1, max_size=4),
        st.lists(st.floats(), min_size=1, max_size=4),
        st.integers(0, limit - 1).map(lambda p: [p, p]),  # a page twice
        st.just([[0, 1], [2, 3]]), st.just([]), st.just(np.zeros((2, 2), dtype=np.int32)),
        st.just(np.array([2**40], dtype=np.int64)), st.just(np.array(["a"])))


def valid_pages(pages: Any) -> bool:
    from kvservice.memory._layout import check_pages

    try:
        check_pages(np.asarray(pages), NUM_PAGES)
    except (ValueError, TypeError, OverflowError):
        return False
    return True


def bad_aux() -> st.SearchStrategy[Any]:
    return st.one_of(st.booleans(), st.floats(), st.text(max_size=5), st.lists(st.integers(), max_size=2),
                     st.integers(max_value=-1), st.integers(min_value=AUX_ROWS))


@PROPERTY
@given(room=bad_rooms)
def test_a_hostile_room_fails_either_side_never_raises(pair: SimpleNamespace, room: Any) -> None:
    """The issue's case: a negative room raised ``AttributeError`` out of ``KVReceiver.__init__``."""
    refused(pair.sender(pair.prefill, pair.addr, room), "bootstrap_room")
    receiver = pair.receiver(pair.decode, pair.addr, room)
    receiver.init(0)
    receiver.send_metadata(np.array([0], dtype=np.int32), 0)
    refused(receiver, "bootstrap_room")


@PROPERTY
@given(addr=bad_addrs)
def test_a_hostile_bootstrap_address_fails_the_receiver(pair: SimpleNamespace, addr: Any) -> None:
    assume(not is_address(addr))
    receiver = pair.receiver(pair.decode, addr, next(ROOMS))
    assert receiver.poll() == FAILED
    receiver.init(0)
    refused(receiver, "bootstrap_addr")
    assert not pair.decode.try_ensure_parallel_info(addr) if isinstance(addr, str) else True


@PROPERTY
@given(dp_rank=bad_ranks)
def test_a_hostile_dp_rank_fails_the_receiver(pair: SimpleNamespace, dp_rank: Any) -> None:
    receiver = pair.receiver(pair.decode, pair.addr, next(ROOMS))
    receiver.init(dp_rank)
    refused(receiver, "prefill_dp_rank")


@PROPERTY
@given(num=st.one_of(anything, st.integers(max_value=0), st.integers(min_value=NUM_PAGES + 1)), aux=bad_aux())
def test_hostile_counts_and_aux_indices_fail_the_sender(pair: SimpleNamespace, num: Any, aux: Any) -> None:
    sender = pair.sender(pair.prefill, pair.addr, next(ROOMS))
    sender.init(num, 0)
    refused(sender, "num_kv_indices")
    sender = pair.sender(pair.prefill, pair.addr, next(ROOMS))
    sender.init(2, aux)
    refused(sender, "aux_index")


@PROPERTY
@given(pages=bad_indices(NUM_PAGES))
def test_hostile_page_indices_fail_the_sender(pair: SimpleNamespace, pages: Any) -> None:
    assume(not valid_pages(pages))
    sender = pair.sender(pair.prefill, pair.addr, next(ROOMS))
    sender.init(2, 0)
    sender.send(pages)
    sender.send(pages)  # and again: still no exception
    refused(sender)


@PROPERTY
@given(pages=bad_indices(NUM_PAGES), aux=st.one_of(st.none(), bad_aux()))
def test_hostile_page_or_aux_indices_fail_the_receiver(pair: SimpleNamespace, pages: Any, aux: Any) -> None:
    assume(aux is not None or not valid_pages(pages))
    receiver = pair.receiver(pair.decode, pair.addr, next(ROOMS))
    receiver.init(0)
    assert receiver.poll() != FAILED, receiver.failure_exception()
    receiver.send_metadata(pages if aux is None else np.array([0, 1], dtype=np.int32), 0 if aux is None else aux)
    refused(receiver)


def test_a_good_request_still_moves_byte_exact_after_the_hostile_ones(pair: SimpleNamespace) -> None:
    """The hostile examples left both managers serving: a good request of 8 KV heads moves,
    and what lands is what was sent."""
    import time

    room = next(ROOMS)
    for buf in pair.pbufs:
        buf[2 * PAGE:4 * PAGE] = torch.rand(2 * PAGE, HEADS, HEAD_DIM)
    receiver = pair.receiver(pair.decode, pair.addr, room)
    receiver.init(0)
    receiver.send_metadata(np.array([5, 6], dtype=np.int32), 1)
    sender = pair.sender(pair.prefill, pair.addr, room)
    deadline = time.monotonic() + 60
    while sender.poll() == 1 and time.monotonic() < deadline:  # Bootstrapping until the expect arrives
        time.sleep(0.01)
    sender.init(2, 1)
    sender.send(np.array([2, 3], dtype=np.int32))
    while SUCCESS not in (sender.poll(), receiver.poll()) or sender.poll() != receiver.poll():
        assert FAILED not in (sender.poll(), receiver.poll()) and time.monotonic() < deadline
        time.sleep(0.01)
    for src, dst in zip(pair.pbufs, pair.dbufs, strict=True):
        assert torch.equal(src[2 * PAGE:4 * PAGE], dst[5 * PAGE:7 * PAGE])
    sender.clear()
    receiver.clear()
