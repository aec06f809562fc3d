"""``kvservice.testing.engine_process``: both ends of an engine's JSON-line pipe, with a
child that echoes commands until it is told to quit (or ignores the quit and is killed)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from kvservice.testing.engine_process import ask_to_quit, reap, send_line

CHILD = textwrap.dedent("""
    import sys
    from kvservice.testing.engine_process import read_commands, say

    commands = read_commands()
    say({"ready": True})
    for _ in range(100):
        cmd = commands.get(timeout=30)
        if cmd is None or (cmd["op"] == "quit" and sys.argv[1] == "obey"):
            break
        say({"echo": cmd})
""")


def child(mode: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", CHILD, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def answer(proc: subprocess.Popen[bytes]) -> object:
    assert proc.stdout is not None
    return json.loads(proc.stdout.readline())


def test_a_child_answers_then_quits_and_its_pipes_are_closed() -> None:
    proc = child("obey")
    try:
        assert answer(proc) == {"ready": True}
        send_line(proc, {"op": "generate", "id": "r1"})
        assert answer(proc) == {"echo": {"op": "generate", "id": "r1"}}
        assert ask_to_quit(proc, 30) is True
        reap(proc)
        assert proc.returncode == 0
        assert proc.stdin is not None and proc.stdin.closed and proc.stdout is not None and proc.stdout.closed
        assert ask_to_quit(proc, 1) is True  # already gone: nothing written
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_a_child_that_ignores_quit_is_left_to_the_caller_to_kill() -> None:
    proc = child("ignore")
    try:
        assert answer(proc) == {"ready": True}
        assert ask_to_quit(proc, 0.5) is False
        assert proc.poll() is None
        proc.kill()  # by this test's own child's pid
        reap(proc)
        assert proc.returncode is not None and proc.returncode < 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
