"""``_nixl.native_log``: UCX's lines as kvservice's events, and who chooses where UCX logs."""

from __future__ import annotations

import os
import threading

import pytest
from structlog.testing import capture_logs

from kvservice._nixl import native_log
from kvservice._nixl.native_log import relog
from kvservice._nixl.trial import nixl_log_level

PREFIX = "[1796148215.386324] [vm:14786:0]            sock.c:355  UCX  "


def _events(line: str) -> list[dict[str, object]]:
    with capture_logs() as logs:
        relog(line)
    return logs


def test_a_peer_gone_is_debug_in_kvservice_words() -> None:
    [event] = _events(PREFIX + "ERROR connect(fd=16, dest_addr=127.0.0.1:58129) failed: Connection refused")
    assert event["event"] == "ucx.peer_unreachable" and event["log_level"] == "debug"
    assert event["ucx_pid"] == 14786 and event["source"] == "sock.c:355"
    assert event["message"] == "connect(fd=16, dest_addr=127.0.0.1:58129) failed: Connection refused"
    hint = ('[1796148215.386390] [vm:14786:0]          tcp_ep.c:1234 UCX  ERROR try to increase '
            '"net.core.somaxconn", "net.core.netdev_max_backlog", "net.ipv4.tcp_max_syn_backlog" to the maximum '
            'value on the remote node or increase UCX_TCP_MAX_CONN_RETRIES (=25)')
    assert [e["event"] for e in _events(hint)] == ["ucx.peer_unreachable"]
    # seen as a peer was killed under load: the connection event UCX cannot name
    unknown = ("[1796278301.639883] [vm:6601 :0]          tcp_cm.c:140  UCX  ERROR tcp_ep 0x7f275c1f1f40: "
               "UNKNOWN (1) [127.0.0.1:47521]:0")
    assert [e["event"] for e in _events(unknown)] == ["ucx.peer_unreachable"]


@pytest.mark.parametrize(("level", "event", "log_level"), [
    ("ERROR", "ucx.error", "warning"), ("WARN", "ucx.warning", "warning"), ("FATAL", "ucx.fatal", "error"),
    ("INFO", "ucx.info", "info"), ("DEBUG", "ucx.debug", "debug"),
])
def test_other_lines_keep_their_weight_and_the_raw_line(level: str, event: str, log_level: str) -> None:
    line = f"[1796148215.4] [vm:1:0]   unknown_{level}.c:7  UCX  {level} something else went wrong"
    [got] = _events(line)
    assert (got["event"], got["log_level"], got["line"]) == (event, log_level, line)
    assert got["message"] == "something else went wrong"


def test_a_line_not_in_ucx_format_is_a_warning() -> None:
    [got] = _events("ucp_context.c:1234 a line of another shape")
    assert (got["event"], got["log_level"], got["line"]) == ("ucx.output", "warning", "ucp_context.c:1234 a line "
                                                                                          "of another shape")
    assert _events("   ") == []


def test_a_flood_of_one_warning_is_throttled() -> None:
    line = "[1796148215.4] [vm:1:0]   flood.c:9  UCX  WARN the same again"
    with capture_logs() as logs:
        for _ in range(25):
            relog(line)
    assert len(logs) == 10  # the throttle's burst in its window


def test_who_chose_where_ucx_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_LOG_FILE", raising=False)
    assert not native_log._operator_chose({})
    assert native_log._operator_chose({"UCX_LOG_FILE": "stderr"})
    monkeypatch.setenv("UCX_LOG_FILE", "/var/log/ucx.%p")
    assert native_log._operator_chose({})
    # a parent's pipe, inherited while that parent started its agent: not a choice
    monkeypatch.setenv("UCX_LOG_FILE", f"/proc/{os.getpid() + 1}/fd/7")
    assert not native_log._operator_chose({})
    monkeypatch.setenv("UCX_LOG_FILE", f"/proc/{os.getpid()}/fd/7")
    assert native_log._operator_chose({})


def test_nixl_log_level_only_while_nixl_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NIXL_LOG_LEVEL", raising=False)
    with nixl_log_level():
        assert os.environ["NIXL_LOG_LEVEL"] == "FATAL"
    assert "NIXL_LOG_LEVEL" not in os.environ
    monkeypatch.setenv("NIXL_LOG_LEVEL", "INFO")
    with nixl_log_level():
        assert os.environ["NIXL_LOG_LEVEL"] == "INFO"
    assert os.environ["NIXL_LOG_LEVEL"] == "INFO"


def test_nixl_log_level_holds_while_any_thread_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vetting thread and the door's thread may load NIXL at once: the level stays set
    until the last of them is done, not dropped when the first one ends."""
    monkeypatch.delenv("NIXL_LOG_LEVEL", raising=False)
    inside, leave = threading.Event(), threading.Event()

    def first() -> None:
        with nixl_log_level():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(10)
    with nixl_log_level():  # the second, while the first is still inside
        leave.set()
        thread.join(10)  # the first is done
        assert os.environ.get("NIXL_LOG_LEVEL") == "FATAL"
    assert "NIXL_LOG_LEVEL" not in os.environ
