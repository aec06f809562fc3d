"""kvservice's modules import one another without circles.

A circle between two modules means one of them holds code that belongs to the other (or
to a third, lower one); a ``TYPE_CHECKING`` import or an import inside a function hides
it from Python but not from a reader.  So the module graph is read from the source with
``ast``, nothing is imported (an engine may be absent), and every import counts: at the
top, under ``if TYPE_CHECKING:``, inside a function.

An edge is "module A's code imports module B":

* ``import kvservice.a.b`` and ``from kvservice.a import b`` / ``from .a import b``, where
  ``a.b`` is a module, are edges to ``kvservice.a.b``;
* ``from kvservice.a import name`` / ``from .a import name``, where ``name`` is not a
  submodule, is an edge to ``kvservice.a`` itself: a module's own code, or a package's
  ``__init__`` (which stands for the package);
* importing ``kvservice.a.b`` also runs ``kvservice/a/__init__`` first, but that is not
  an edge: ``a.b`` importing ``a`` back is a circle only when ``a/__init__`` itself
  imports ``a.b``, as when it re-exports a name of it (``kvservice/__init__`` re-exports
  the public API, so a submodule importing a name ``from kvservice`` is in a circle with
  it; import the name from the module that defines it instead).

A circle is a strongly connected component of more than one module, or a module that
imports itself.
"""

from __future__ import annotations

import ast
import collections
import functools
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest

import kvservice

#: circles known and being removed, each named by its modules; any other fails the test,
#: and so does one of these once it is gone (delete its line then)
KNOWN: dict[frozenset[str], str] = {}


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package at ``root`` (a folder with ``__init__.py``) by dotted
    name; a package's ``__init__.py`` is named as the package."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((package, *parts))] = path
    return found


def _within(name: str, known: Mapping[str, Path]) -> str | None:
    """The longest prefix of dotted ``name`` that is a module in ``known``, or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in known:
            return prefix
    return None


def imports(name: str, path: Path, known: Mapping[str, Path]) -> Iterator[tuple[str, int]]:
    """The modules of ``known`` that module ``name``'s code imports, with the line of each."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (target := _within(alias.name, known)) is not None:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = here.split(".")
                if node.level - 1 >= len(base_parts):
                    continue  # above the package: not ours
                base = ".".join(base_parts[: len(base_parts) - (node.level - 1)])
                if node.module:
                    base = f"{base}.{node.module}"
            else:
                base = node.module or ""
            if (target := _within(base, known)) is None:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in known else target), node.lineno


Graph = dict[str, dict[str, int]]


def graph(known: Mapping[str, Path]) -> Graph:
    """Module -> the modules it imports -> the first line that does."""
    edges: Graph = {}
    for name, path in known.items():
        out = edges.setdefault(name, {})
        for target, line in imports(name, path, known):
            out.setdefault(target, line)
    return edges


def components(edges: Graph) -> Iterator[list[str]]:
    """Tarjan's strongly connected components of ``edges`` (iteratively: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for start in sorted(edges):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, {})))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    yield sorted(component)


def cycles(edges: Graph) -> list[frozenset[str]]:
    """Every circle: a component of more than one module, or a module importing itself."""
    return sorted(
        (frozenset(c) for c in components(edges) if len(c) > 1 or c[0] in edges.get(c[0], {})),
        key=sorted,
    )


def shortest(cycle: Iterable[str], edges: Graph) -> list[str]:
    """One shortest circle through the component ``cycle`` (breadth first from each
    member), first module repeated last: in a large component, where to start cutting."""
    members = set(cycle)
    best: list[str] = []
    for start in sorted(members):
        parent: dict[str, str | None] = {start: None}
        queue, closing = collections.deque([start]), None
        while queue and closing is None:
            a = queue.popleft()
            for b in sorted(edges[a]):
                if b == start:
                    closing = a
                    break
                if b in members and b not in parent:
                    parent[b] = a
                    queue.append(b)
        if closing is None:
            continue
        path = [closing]
        while (before := parent[path[-1]]) is not None:
            path.append(before)
        if not best or len(path) + 1 < len(best):
            best = [*reversed(path), start]
    return best


def describe(cycle: Iterable[str], edges: Graph, known: Mapping[str, Path]) -> str:
    """A circle as the imports that close it: ``a -> b (pkg/a.py:12)`` per edge inside it,
    after one shortest circle through it."""
    members = set(cycle)
    top = min(known.values(), key=lambda p: len(p.parts)).parent.parent  # above the package folder
    lines = [f"  {', '.join(sorted(members))}:", f"    shortest: {' -> '.join(shortest(members, edges))}"]
    for a in sorted(members):
        for b, line in sorted(edges[a].items()):
            if b in members:
                lines.append(f"    {a} -> {b}  ({known[a].relative_to(top)}:{line})")
    return "\n".join(lines)


def find(root: Path, package: str) -> tuple[list[frozenset[str]], Graph, dict[str, Path]]:
    known = modules(root, package)
    edges = graph(known)
    return cycles(edges), edges, known


@functools.cache
def _kvservice() -> tuple[list[frozenset[str]], Graph, dict[str, Path]]:
    return find(Path(kvservice.__file__).parent, "kvservice")


def test_kvservice_has_no_import_cycles() -> None:
    found, edges, known = _kvservice()
    new = [c for c in found if c not in KNOWN]
    gone = [c for c in KNOWN if c not in found]
    assert not new, "import circles:\n" + "\n".join(describe(c, edges, known) for c in new)
    assert not gone, f"known circles that are gone (delete them from KNOWN): {[sorted(c) for c in gone]}"


#: (lower, upper): no module of the lower layer imports one of the upper, even lazily
LAYERS = (
    ("kvservice.memory", "kvservice._transfer"),  # pages and their pairing; the request plane uses them
    ("kvservice.discovery", "kvservice._config"),  # discovery's own settings; the service's config holds them
)


@pytest.mark.parametrize(("lower", "upper"), LAYERS)
def test_a_lower_layer_imports_nothing_of_an_upper_one(lower: str, upper: str) -> None:
    _, edges, _ = _kvservice()

    def within(name: str, layer: str) -> bool:
        return name == layer or name.startswith(layer + ".")

    wrong = sorted(f"{a} -> {b}" for a, out in edges.items() if within(a, lower) for b in out if within(b, upper))
    assert not wrong


def test_the_graph_sees_every_kind_of_import() -> None:
    """The real package's graph holds an edge of each kind the finder claims to read, so a
    finder that silently skipped one would fail here, not pass on a graph missing it."""
    _, edges, _ = _kvservice()
    assert "kvservice._config" in edges["kvservice"]  # from ._config import ServiceConfig (package init)
    assert "kvservice.discovery.member" in edges["kvservice.discovery.registry"]  # from . import member
    assert "kvservice.discovery.cli" in edges["kvservice.cli"]  # inside a function
    assert "kvservice._service" in edges["kvservice._tp"]  # under TYPE_CHECKING


# -- the finder on packages with known answers ---------------------------------------------


def _package(tmp_path: Path, files: Mapping[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


CIRCLES = {
    "top level": ({"a.py": "from .b import x\n", "b.py": "from pkg.a import y\n"}, {"pkg.a", "pkg.b"}),
    "type checking": (
        {"a.py": "from .b import x\n",
         "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"},
        {"pkg.a", "pkg.b"},
    ),
    "inside a function": (
        {"a.py": "import pkg.b\n", "b.py": "def f():\n    from . import a\n    return a\n"},
        {"pkg.a", "pkg.b"},
    ),
    "three modules": (
        {"a.py": "from .b import x\n", "b.py": "from .c import y\n", "c.py": "from .a import z\n"},
        {"pkg.a", "pkg.b", "pkg.c"},
    ),
    "through a re-exporting init": (
        {"__init__.py": "from .sub.a import A\n", "sub/__init__.py": "", "sub/a.py": "from .. import B\n"},
        {"pkg", "pkg.sub.a"},
    ),
    "through a subpackage's init": (
        {"x.py": "from .sub import a\n", "sub/__init__.py": "from .a import A\n", "sub/a.py": "import pkg.x\n"},
        {"pkg.x", "pkg.sub.a"},
    ),
    "itself": ({"a.py": "import pkg.a\n"}, {"pkg.a"}),
}


@pytest.mark.parametrize("case", sorted(CIRCLES))
def test_the_finder_reports_a_known_circle(tmp_path: Path, case: str) -> None:
    files, expected = CIRCLES[case]
    found, edges, _ = find(_package(tmp_path, files), "pkg")
    assert found == [frozenset(expected)]
    circle = shortest(expected, edges)
    assert circle[0] == circle[-1] and set(circle) == expected  # every case is one simple circle


ACYCLIC = {
    # a.b runs pkg/__init__ first, but that init does not import a.b: no circle
    "a submodule importing its package's name": (
        {"__init__.py": "X = 1\n", "a.py": "from pkg import X\n", "b.py": "from .a import Y\n"}
    ),
    # `from . import a` is the submodule a, not pkg/__init__
    "a sibling by from-dot": ({"__init__.py": "from .b import B\n", "a.py": "X = 1\n", "b.py": "from . import a\n"}),
    "an outside module of the same prefix": ({"a.py": "import pkgx.a\nfrom pkgx import b\n"}),
}


@pytest.mark.parametrize("case", sorted(ACYCLIC))
def test_the_finder_reports_no_circle_where_there_is_none(tmp_path: Path, case: str) -> None:
    found, _, _ = find(_package(tmp_path, ACYCLIC[case]), "pkg")
    assert found == []
