"""The docs' commands and links, checked against what the project really runs.

Every shell block marked ``<!-- quickstart -->`` (the README's two commands and its install
lines, and each docs page's quick start) is split into commands, and each command is checked by
what it is: a ``scripts/`` script exists, parses, and is the one CI (``.ci/run``) or the demo
really runs; ``kvservice SUB ...`` is run as ``kvservice SUB --help`` (``kvservice --help``
itself as written) and every option the docs give it must be in that help; a ``pip install``
names extras ``pyproject.toml`` declares and the torch pin ``scripts/setup.sh`` installs; a
``python -m MODULE`` or ``python FILE`` names a module or file of this checkout. A command no
rule knows fails the test: a new kind of command needs a rule here. The full demo and the
whole suite are CI's to run, not this test's.

Every relative link of the README and the docs pages must name a file that exists and, with
``#anchor``, a heading of that file.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: the pages whose quick-start blocks are checked (each must have at least one)
QUICKSTART_PAGES = ["README.md", "docs/testing.md", "docs/sidecar.md", "docs/perf/README.md", "docs/vllm.md",
                    "docs/bench.md"]
QUICKSTART = re.compile(r"<!-- quickstart -->\s*```(?:bash|sh)\n(.*?)```\s*<!-- /quickstart -->", re.S)
#: shell words that need no check beyond the block parsing (``bash -n``)
SHELL_WORDS = {"curl", "echo", "kill", "sleep", "grep", "for", "break", "done", "cd", "export"}
#: the interpreters a quick start may name: .venv's, an engine's environment, the one on PATH
PYTHON = re.compile(r"^(?:\.venv/bin/python|python3?|\$\(bash scripts/engine-env\.sh (?:vllm|sglang)\)/bin/python)$")


@dataclass(frozen=True)
class Command:
    page: str
    text: str
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}: {self.text}"


def quickstart_blocks(page: str) -> list[str]:
    return QUICKSTART.findall((REPO / page).read_text())


def split_commands(page: str, block: str) -> Iterator[Command]:
    """The block's commands: continuation lines joined, a line with an open quote joined to the
    next, comments dropped, ``a; b``, ``a && b`` and a trailing ``&`` split."""
    pending = ""
    for line in block.splitlines():
        pending = f"{pending} {line.rstrip()}" if pending else line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        # 2>&1 is no `&`; a process substitution `<(...)` is one word (a constraints file)
        plain = re.sub(r"<\([^)]*\)", "PROCESS-SUBSTITUTION", re.sub(r"\d?>&\d", "", pending))
        lexer = shlex.shlex(plain, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        try:
            words = list(lexer)
        except ValueError:  # an open quote: the command goes on
            continue
        text, pending = pending, ""
        command: list[str] = []
        for word in [*words, ";"]:
            if word in (";", "&&", "&", "||", "|"):
                if command:
                    yield Command(page, text.strip(), tuple(command))
                command = []
            else:
                command.append(word)
    assert not pending, f"{page}: a quick-start command does not end: {pending!r}"


def all_commands() -> list[Command]:
    return [cmd for page in QUICKSTART_PAGES for block in quickstart_blocks(page)
            for cmd in split_commands(page, block)]


def pyproject() -> dict[str, object]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def extras() -> set[str]:
    project = pyproject()["project"]
    assert isinstance(project, dict)
    return set(project["optional-dependencies"])


def torch_pin() -> str:
    found = re.findall(r'"(torch==[^"]+)"', (REPO / "scripts" / "setup.sh").read_text())
    assert len(found) == 1, found
    return str(found[0])


#: runs ``kvservice SUB --help`` for each SUB in one process (each would import torch again)
_HELPS = """
import contextlib, io, json, sys
from kvservice.cli import main
out = {}
for sub in sys.argv[1:]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            rc = main(([sub] if sub else []) + ["--help"])
        except SystemExit as exc:
            rc = exc.code
    out[sub] = [rc, buf.getvalue()]
print(json.dumps(out))
"""


@cache
def all_helps() -> dict[str, str]:
    """``kvservice --help`` and ``kvservice SUB --help`` for every subcommand the quick starts
    name, as the CLI answers them (this checkout's ``kvservice.cli``)."""
    named = [strip_prefix(c.words) for c in all_commands()]
    subs = ["", *sorted({w[1] for w in named if w[0] in ("kvservice", ".venv/bin/kvservice")
                         and len(w) > 1 and not w[1].startswith("-")})]
    out = subprocess.run([sys.executable, "-c", _HELPS, *subs], capture_output=True, text=True, cwd=REPO,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    answers = json.loads(out.stdout.splitlines()[-1])
    for sub, (rc, _) in answers.items():
        assert rc in (0, None), f"kvservice {sub} --help exited {rc}: {out.stderr}"
    return {sub: text for sub, (_, text) in answers.items()}


def kvservice_help(*args: str) -> str:
    return all_helps()[args[0] if args else ""]


def kvservice_version() -> str:
    """What ``kvservice --version`` prints (this checkout's ``kvservice.cli``)."""
    out = subprocess.run([sys.executable, "-c", "from kvservice.cli import main; main(['--version'])"],
                         capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def project_version() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


def strip_prefix(words: tuple[str, ...]) -> tuple[str, ...]:
    """Without leading ``NAME=value`` assignments and a ``taskset -c CPUS`` launcher."""
    i = 0
    while i < len(words) and re.match(r"^[A-Z_][A-Z0-9_]*=", words[i]):
        i += 1
    if words[i:i + 1] == ("taskset",):
        i += 3
    return words[i:]


def module_exists(name: str) -> bool:
    """A module of this checkout (``kvservice...``, ``benchmarks...``), or a tool a quick start
    runs from an installed package (pytest, pip, build, vLLM's server): looked up without
    importing it."""
    path = REPO.joinpath(*name.split("."))
    if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() or (path / "__main__.py").is_file():
        return True
    return name in {"pytest", "pip", "build", "vllm.entrypoints.openai.api_server"}


def check_kvservice(cmd: Command, args: tuple[str, ...]) -> None:
    if args == ("--version",):  # run as written: it must print this checkout's version
        assert kvservice_version() == f"kvservice {project_version()}", cmd
        return
    if not args or args[0].startswith("-"):  # `kvservice --help`: run as written
        assert args in ((), ("--help",), ("-h",)), f"{cmd}: only --help and --version are checked without a subcommand"
        assert "demo" in kvservice_help() and "serve" in kvservice_help()
        return
    sub, rest = args[0], args[1:]
    assert re.search(rf"\b{re.escape(sub)}\b", kvservice_help()), f"{cmd}: kvservice has no subcommand {sub!r}"
    text = kvservice_help(sub)
    for word in rest:
        if word.startswith("--"):
            option = word.split("=", 1)[0]
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text), \
                f"{cmd}: `kvservice {sub} --help` lists no {option}"
        elif not word.startswith("-") and "/" in word and not word.startswith("/tmp") and word not in ("docs/perf",):
            assert (REPO / word).exists(), f"{cmd}: no {word} in the checkout"


def check_pip(cmd: Command, args: tuple[str, ...]) -> None:
    if args[:1] == ("uninstall",):  # what a recipe removes needs no check
        return
    assert args[:1] == ("install",), f"{cmd}: only pip install and uninstall are known"
    skip_next = False
    for word in args[1:]:
        if skip_next:
            skip_next = False
            continue
        if word in ("-c", "--constraint"):
            skip_next = True  # the constraint's file: a shell substitution
            continue
        if word.startswith("-"):
            continue
        if word.startswith("torch=="):
            assert word == torch_pin(), f"{cmd}: {word}, where scripts/setup.sh installs {torch_pin()}"
            continue
        if word == "build":
            assert "build" in str(pyproject()["project"]), f"{cmd}: build is no test dependency"
            continue
        m = re.fullmatch(r"(\.|dist/kvservice-\*\.whl|dist/kvservice-[\w.]+-py3-none-any\.whl)(?:\[([\w,]+)\])?", word)
        assert m, f"{cmd}: installs {word!r}: kvservice is not on an index, install it from a checkout or its wheel"
        if m.group(1).startswith("dist/"):
            project = pyproject()["project"]
            assert isinstance(project, dict)
            wheel = f"dist/kvservice-{project['version']}-py3-none-any.whl"
            pattern = m.group(1).replace(".", r"\.").replace("*", ".*")
            assert re.fullmatch(pattern, wheel), f"{cmd}: the wheel is {wheel}"
        for extra in (m.group(2) or "").split(","):
            assert not extra or extra in extras(), f"{cmd}: no extra {extra!r} in pyproject.toml ({sorted(extras())})"


def check_python(cmd: Command, args: tuple[str, ...]) -> None:
    if args[:1] == ("-m",):
        module, rest = args[1], args[2:]
        assert module_exists(module), f"{cmd}: no module {module}"
        if module == "pip":
            check_pip(cmd, rest)
        elif module == "build":
            packaging = (REPO / "tests" / "system" / "test_packaging.py").read_text()
            assert '"-m", "build", "--wheel"' in packaging, "test_packaging.py no longer builds the wheel this way"
            assert set(rest) <= {"--wheel"}, f"{cmd}: test_packaging.py builds with --wheel only"
        elif module == "pytest":
            for word in rest:
                if word.startswith("tests"):
                    assert (REPO / word.split("::")[0]).exists(), f"{cmd}: no {word}"
        elif module == "kvservice.cli":
            check_kvservice(cmd, rest)
    else:
        assert args and (REPO / args[0]).is_file(), f"{cmd}: no file {args[:1]}"


def check(cmd: Command) -> None:
    words = strip_prefix(cmd.words)
    if words[0] in ("do", "then"):  # a loop's body: its first command
        words = words[1:]
    if not words:
        return
    head, args = words[0], words[1:]
    if head == "bash":
        script = REPO / args[0]
        assert script.is_file(), f"{cmd}: no {args[0]}"
        parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
        assert parsed.returncode == 0, f"{cmd}: {parsed.stderr}"
        if args[0] == "scripts/engine-env.sh":
            assert args[1:] in (("vllm",), ("sglang",)), cmd
    elif head in ("kvservice", ".venv/bin/kvservice"):
        check_kvservice(cmd, args)
    elif head == "pip":
        check_pip(cmd, args)
    elif PYTHON.match(head):
        check_python(cmd, args)
    elif head in SHELL_WORDS:
        pass
    else:
        pytest.fail(f"{cmd}: a quick-start command no rule of tests/unit/test_docs.py checks")


def test_every_page_has_its_quick_start() -> None:
    for page in QUICKSTART_PAGES:
        assert quickstart_blocks(page), f"{page} has no <!-- quickstart --> block"


@pytest.mark.parametrize("page", QUICKSTART_PAGES)
def test_quick_start_blocks_parse(page: str) -> None:
    for block in quickstart_blocks(page):
        out = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True, check=False)
        assert out.returncode == 0, f"{page}: {out.stderr}"


@pytest.mark.parametrize("cmd", all_commands(), ids=str)
def test_quick_start_command(cmd: Command) -> None:
    check(cmd)


def test_the_readme_two_commands_are_what_ci_and_the_demo_run() -> None:
    first = list(split_commands("README.md", quickstart_blocks("README.md")[0]))
    assert [c.words for c in first] == [("bash", "scripts/demo.sh"), ("bash", "scripts/test.sh")]
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^bash scripts/test\.sh$", ci, re.M), ".ci/run runs another command"
    assert re.search(r"^exec \.venv/bin/kvservice demo ", (REPO / "scripts" / "demo.sh").read_text(), re.M)
    setup = (REPO / "scripts" / "setup.sh").read_text()
    for script in ("demo.sh", "test.sh"):
        assert "bash scripts/setup.sh" in (REPO / "scripts" / script).read_text(), f"{script} sets up no .venv"
    assert setup.index(torch_pin()) < setup.index('-e ".['), "setup.sh must install torch before kvservice"


def test_the_readme_is_a_front_door() -> None:
    """About 200 lines, and the sections a stranger looks for."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 220
    for heading in ("## Two commands", "## Install", "## Using it", "## What fails how", "## Where to go next"):
        assert heading in text, heading


@pytest.mark.parametrize(("page", "section"),
                         [("README.md", "## What fails how"), ("docs/api.md", "## Failure reasons")])
def test_every_failure_reason_is_in_the_tables(page: str, section: str) -> None:
    from kvservice import FailureReason

    text = (REPO / page).read_text()
    table = text.split(section)[1].split("\n## ")[0]
    missing = [r.name for r in FailureReason if f"`{r.name}`" not in table]
    assert not missing, f"{page} {section!r} lacks {missing}"



def test_the_api_page_names_every_member_of_kvtransfer() -> None:
    """docs/api.md's "One API" section names each member of ``KVTransfer`` (kvservice/_api.py),
    the scheduler's reads among them, and the calls it says are outside the protocol are not in
    it: the in-process service's own."""
    from kvservice import KVTransfer, SidecarClient, TransferService

    text = (REPO / "docs" / "api.md").read_text()
    section = text.split("## One API, two faces: `KVTransfer`")[1].split("\n## ")[0]
    inside, outside = section.split("Outside the protocol")
    members = {name for name in vars(KVTransfer) if not name.startswith("_")} | set(KVTransfer.__annotations__)
    missing = sorted(m for m in members if not re.search(rf"`{m}[`(]", inside))
    assert not missing, f"docs/api.md's KVTransfer members lack {missing}"
    named = set(re.findall(r"`(\w+)`", outside.split(".")[0]))
    assert {"expected", "expected_pages", "expect_dropped", "live_peers"} <= members
    assert named == {"remembers", "completion_future", "arrival_future", "metrics"}, named
    assert not named & members and all(hasattr(TransferService, n) for n in named), named
    assert not any(hasattr(SidecarClient, n) for n in named), named


# -- examples -----------------------------------------------------------------------------------

#: the pages whose Python examples are checked (the README and the docs this project keeps by hand)
EXAMPLE_PAGES = ["README.md", "docs/api.md", "docs/engines.md", "docs/engine-facade.md", "docs/settle.md",
                 "docs/sidecar.md", "docs/testing.md", "docs/design.md", "docs/operations.md", "docs/security.md"]


def examples(page: str) -> list[ast.Module]:
    """The page's ```python blocks, parsed as a user would paste them into an async function."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / page).read_text(), re.S)
    flags = ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    return [compile(block, f"{page}, example {i}", "exec", flags=flags) for i, block in enumerate(blocks)]


@pytest.mark.parametrize("page", EXAMPLE_PAGES)
def test_examples_name_what_kvservice_has(page: str) -> None:
    """Each example parses; every name it imports from kvservice exists; every attribute it
    uses on a ``TransferService`` (``svc``) is the service's."""
    from kvservice import ServiceConfig, TransferService

    service = TransferService(ServiceConfig())  # not started: only its attributes are read
    for tree in examples(page):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvservice"):
                module = importlib.import_module(str(node.module))
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, f"{page}: {node.module} has no {missing}"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "svc":
                assert hasattr(TransferService, node.attr) or node.attr in vars(service), \
                    f"{page}: TransferService has no {node.attr!r}"


# -- links --------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: generated from the configuration's declarations by its own tool; checked once it exists
GENERATED = {REPO / "docs" / "configuration.md"}


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings (lower case, punctuation dropped, spaces
    to hyphens, a repeated one numbered)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"^#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_resolve() -> None:
    broken = []
    for page in pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if path in GENERATED and not path.exists():
                continue
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
