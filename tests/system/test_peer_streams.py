"""A child service that never becomes ready leaves nothing open in the parent: its
process is reaped and both ends of its event stream are closed (an unclosed one is a
ResourceWarning, an error at whichever later test collects it)."""

from __future__ import annotations

import subprocess

import anyio

from kvservice.testing import PeerProcess

from ..helpers import unclosed_resources


async def test_a_child_that_never_became_ready_leaves_no_stream_open() -> None:
    raised = ""
    with unclosed_resources() as unclosed:
        async with anyio.create_task_group() as tg:
            # Not pytest.raises: the exception's traceback would keep the streams alive.
            try:
                await PeerProcess.start(tg, {"layout": {"no_such_field": 1}}, stderr=subprocess.DEVNULL)
            except EOFError as exc:
                raised = repr(exc)
    assert raised.startswith("EOFError"), raised
    assert unclosed == []
