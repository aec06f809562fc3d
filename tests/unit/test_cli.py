"""The ``kvservice`` command line as a user meets it: ``--help`` lists the subcommands as a
table and ``--version`` names the release, both without importing torch or NIXL (what
was imported is read from ``sys.modules`` in a fresh interpreter, not timed); every
subcommand's help is plain text and every option says what it does."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

import kvservice
from kvservice.cli import COMMANDS

REPO = Path(__file__).resolve().parents[2]
#: what ``kvservice --help`` / ``--version`` must not import: the heavy, optional or native parts
HEAVY = ("torch", "nixl", "numpy", "kvservice._service", "kvservice.sidecar")

#: run ``python -m kvservice ARGS`` (through ``__main__``, as the console script runs ``main``)
#: and report its exit code, its output and which of HEAVY it imported
_PROBE = """
import contextlib, io, json, runpy, sys
out = io.StringIO()
sys.argv = ["kvservice", *sys.argv[1:]]
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    try:
        runpy.run_module("kvservice", run_name="__main__", alter_sys=True)
        code = None
    except SystemExit as exc:
        code = exc.code
heavy = json.loads(%r)
print(json.dumps({"code": code, "out": out.getvalue(), "imported": [m for m in heavy if m in sys.modules]}))
"""


def probe(*args: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", _PROBE % json.dumps(HEAVY), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    answer: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return answer


def test_help_lists_the_subcommands_as_a_table_without_importing_torch_or_nixl() -> None:
    answer = probe("--help")
    assert answer["code"] == 0 and answer["imported"] == [], answer
    text = str(answer["out"])
    rows = dict(re.findall(r"^  (\S+) +(\S.*)$", text.split("commands:\n", 1)[1], re.MULTILINE))
    assert rows == {name: what for name, (what, _) in COMMANDS.items()}, text
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "Run 'kvservice COMMAND --help'" in text


def test_version_names_the_release_without_importing_torch_or_nixl() -> None:
    answer = probe("--version")
    assert answer == {"code": 0, "out": f"kvservice {kvservice.__version__}\n", "imported": []}


@pytest.mark.parametrize("args", [(), ("no-such-command",), ("--no-such-option",)])
def test_a_missing_or_unknown_command_is_a_usage_error(args: tuple[str, ...]) -> None:
    answer = probe(*args)
    assert answer["code"] == 2 and answer["imported"] == [], answer
    assert "usage: kvservice" in str(answer["out"])


#: every subcommand's parser, caught as it parses ``--help`` (the subcommands build their
#: own): each option's help and the help text printed, in one interpreter
_PARSERS = """
import argparse, contextlib, io, json, sys
from kvservice.cli import COMMANDS, main
seen = []
real = argparse.ArgumentParser.parse_args
def catch(self, *args, **kwargs):
    seen.append(self)
    return real(self, *args, **kwargs)
argparse.ArgumentParser.parse_args = catch
out = {}
for name in sorted(COMMANDS):
    seen.clear()
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            main([name, "--help"])
        except SystemExit:
            pass
    parser = seen[-1]
    options = {"/".join(a.option_strings) or a.dest: a.help for a in parser._actions
               if not isinstance(a, argparse._HelpAction)}
    out[name] = {"prog": parser.prog, "options": options, "text": text.getvalue()}
print(json.dumps(out))
"""


@cache
def parsers() -> dict[str, dict[str, object]]:
    done = subprocess.run([sys.executable, "-c", _PARSERS], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    answer: dict[str, dict[str, object]] = json.loads(done.stdout.splitlines()[-1])
    return answer


#: reStructuredText (or Markdown) in a help text: ``literal``, `role`, **strong**, :role:
MARKUP = re.compile(r"``|`[^`\s][^`]*`|\*\*|:[a-z]+:`")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_of_every_subcommand_has_help_and_the_help_is_plain_text(name: str) -> None:
    found = parsers()[name]
    assert found["prog"] == f"kvservice {name}"
    options = found["options"]
    assert isinstance(options, dict) and options
    assert [option for option, text in options.items() if not text] == [], f"kvservice {name}: options without help"
    text = str(found["text"])
    assert text.startswith(f"usage: kvservice {name}"), text
    assert MARKUP.search(text) is None, f"kvservice {name} --help shows markup: {MARKUP.search(text)}"


def test_the_markup_check_sees_markup() -> None:
    for marked in ("``kvservice demo``", "the `--peer` side", "**steady**", "see :func:`send`"):
        assert MARKUP.search(marked), marked
    for plain in ("--listen HOST:PORT", "kvservice demo: two phases", "a * b", "it's 'quoted'"):
        assert MARKUP.search(plain) is None, plain
