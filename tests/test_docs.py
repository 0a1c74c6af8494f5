"""The documents name what exists: every ``tessera.…`` name in docs/ resolves, every document the
README points to is in the repository, and the glossary covers every public noun."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import tessera

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def resolve(dotted: str) -> object:
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_every_name_the_docs_mention_exists():
    names = set()
    for page in DOCS.glob("*.md"):
        names |= set(re.findall(r"`(tessera(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`", page.read_text()))
        names |= set(re.findall(r"^::: (tessera[\w.]*)", page.read_text(), re.MULTILINE))
    assert len(names) > 40, "the docs name the functions they describe"
    missing = []
    for name in sorted(names):
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing, f"named in docs/ but not in the code: {missing}"


def test_the_readme_points_only_inside_the_repository():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)]+)\)", readme)
    assert not [link for link in links if "://" in link], "the README links outside the repository"
    for link in links:
        assert (ROOT / link.split("#")[0]).exists(), f"README links to {link}, which is missing"
    for name in ("LICENSE", "CHANGELOG.md", "CONTRIBUTING.md", "docs/index.md"):
        assert (ROOT / name).exists(), name


def test_the_glossary_covers_every_public_noun():
    glossary = (DOCS / "glossary.md").read_text()
    terms = set(re.findall(r"^\*\*([^*]+)\*\*", glossary, re.MULTILINE))
    public = [name for name in tessera.__all__ if name[0].isupper()]
    missing = [name for name in public if name not in terms]
    assert not missing, f"public names without a glossary entry: {missing}"
