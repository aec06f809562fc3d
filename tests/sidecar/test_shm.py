"""The shared KV pool: one set of pages seen by the daemon and its workers, a
stale segment replaced, a live one refused, a full /dev/shm a clear error."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import torch

from kvservice import KVLayout
from kvservice.sidecar.shm import Segment, SegmentError, segment_path

LAYOUT = KVLayout(layers=2, page_tokens=16, kv_heads=2, head_dim=64, num_pages=8)


@pytest.fixture
def name() -> Iterator[str]:
    n = f"kvs-test-{uuid.uuid4().hex[:10]}"
    yield n
    if os.path.exists(segment_path(n)):
        os.unlink(segment_path(n))


def test_worker_sees_the_daemons_pages(name: str) -> None:
    with Segment.create(name, LAYOUT) as owner:
        assert oct(os.stat(owner.path).st_mode & 0o777) == "0o600"
        worker = Segment.attach(name, LAYOUT)
        assert worker.tensor is not None and owner.tensor is not None
        assert tuple(worker.tensor.shape) == LAYOUT.shape
        worker.tensor[1, 0, 3].fill_(7)
        assert bool((owner.tensor[1, 0, 3] == 7).all())
        assert worker.tensor.data_ptr() != owner.tensor.data_ptr()  # two mappings, one set of pages
        worker.close()
        worker.close()  # idempotent
    assert not os.path.exists(segment_path(name))


def test_attach_checks_size_and_existence(name: str) -> None:
    with pytest.raises(SegmentError, match="cannot open"):
        Segment.attach(name, LAYOUT)
    with Segment.create(name, LAYOUT):
        with pytest.raises(SegmentError, match="the pool needs"):
            Segment.attach(name, KVLayout(layers=2, page_tokens=16, kv_heads=2, head_dim=64, num_pages=9))


def test_stale_segment_of_a_dead_owner_is_replaced(name: str) -> None:
    # a real process creates the segment and dies without cleaning up
    code = (f"import os; from kvservice.sidecar.shm import Segment; from kvservice import KVLayout\n"
            f"s = Segment.create({name!r}, KVLayout(layers=2, page_tokens=16, kv_heads=2, head_dim=64, "
            f"num_pages=8)); s.tensor.fill_(1); os._exit(9)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60, check=False).returncode == 9
    stale_ino = os.stat(segment_path(name)).st_ino
    with Segment.create(name, LAYOUT) as fresh:
        assert os.stat(segment_path(name)).st_ino != stale_ino
        assert fresh.tensor is not None and bool((fresh.tensor == 0).all())


def test_segment_of_a_live_owner_is_refused(name: str) -> None:
    with Segment.create(name, LAYOUT) as owner:
        with pytest.raises(SegmentError, match="in use by a running daemon"):
            Segment.create(name, LAYOUT)
        assert owner.tensor is not None
        owner.tensor.fill_(3)  # untouched by the refused attempt
        assert os.path.exists(segment_path(name))


def test_no_room_is_a_clear_error(name: str) -> None:
    free = os.statvfs("/dev/shm")
    too_many = (free.f_blocks * free.f_frsize) // LAYOUT.page_bytes + 1024
    huge = KVLayout(layers=2, page_tokens=16, kv_heads=2, head_dim=64, num_pages=too_many)
    with pytest.raises(SegmentError, match="no room"):
        Segment.create(name, huge)
    assert not os.path.exists(segment_path(name))


def test_views_outliving_close_keep_the_mapping_valid(name: str) -> None:
    with Segment.create(name, LAYOUT) as seg:
        assert seg.tensor is not None
        view = seg.tensor[0, 0, 0]
        view.fill_(2)
        seg.close()  # cannot unmap under a live view: stays mapped until the view goes
        assert float(view[0]) == 2.0
        del view
    assert torch.zeros(1).sum() == 0
