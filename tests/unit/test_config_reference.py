"""docs/configuration.md is what the keys' declarations generate, every key has its doc, and
each key is declared once."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

from kvservice._config import LOOPS, ServiceConfig
from kvservice._reference import reference
from kvservice._settings import declared
from kvservice.discovery.settings import DiscoverySettings
from kvservice.integrations.vllm.settings import Settings
from kvservice.memory._layout import KVLayout
from kvservice.sidecar.settings import LAYOUT_DOCS, NOT_KEYS, SECTIONS, DaemonSettings

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "configuration.md"


def test_the_page_is_what_the_declarations_generate() -> None:
    assert PAGE.read_text() == reference(), (
        "docs/configuration.md is out of date: python -m kvservice._reference > docs/configuration.md")


def test_the_page_is_regenerated_by_its_entry_point() -> None:
    out = subprocess.run([sys.executable, "-m", "kvservice._reference"], capture_output=True, text=True, cwd=REPO,
                         timeout=120, check=True)
    assert out.stdout == reference()


def test_every_key_of_every_section_is_on_the_page_with_its_doc() -> None:
    page = PAGE.read_text()
    for section, cls in SECTIONS.items():
        docs = LAYOUT_DOCS if cls is KVLayout else {}
        for name, decl in declared(cls).items():
            if name in NOT_KEYS.get(section, ()):
                continue
            doc = decl.doc or docs.get(name, "")
            assert doc, f"{section}.{name} has no doc"
            assert f"| `{name}` |" in page and doc in page, f"{section}.{name}"
    assert set(LAYOUT_DOCS) == {f.name for f in dataclasses.fields(KVLayout)}
    assert all(decl.doc for decl in declared(Settings).values())


def test_each_key_is_declared_once() -> None:
    """Discovery's keys are ``DiscoverySettings``' own, which ``ServiceConfig`` inherits with
    their defaults, types and docs; the loop's choices are one type."""
    discovery = {f.name for f in dataclasses.fields(DiscoverySettings)}
    assert not discovery & set(ServiceConfig.__annotations__)
    assert issubclass(ServiceConfig, DiscoverySettings)
    theirs, ours = declared(DiscoverySettings), declared(ServiceConfig)
    assert all(ours[name] == theirs[name] for name in discovery)
    assert typing.get_args(declared(DaemonSettings)["loop"].type) == LOOPS
