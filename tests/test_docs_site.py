"""The docs site's structure, checked without building it (`.ci/run` builds it with
`mkdocs build --strict`): every page under docs/ is in mkdocs.yml's nav and every nav entry is a
page, and every relative link of the README (which GitHub shows, and mkdocs does not check)
points to a file that exists, as does every `examples/...` path the docs and docstrings name."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


class _Loader(yaml.SafeLoader):
    """mkdocs.yml with its `!!python/name:` tags read as plain strings."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)


def nav_pages(nav) -> list[str]:
    """The page paths of a mkdocs nav (entries are "page.md", {"Title": "page.md"} or {"Section": [...]})."""
    out = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        out += nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_nav_pages_reads_titles_and_sections():
    assert nav_pages(["a.md", {"B": "b.md"}, {"S": ["c.md", {"D": "d.md"}]}]) == ["a.md", "b.md", "c.md", "d.md"]


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    site = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_Loader)
    listed = nav_pages(site["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert len(listed) == len(set(listed)), "a page is listed twice in mkdocs.yml's nav"
    assert not sorted(set(pages) - set(listed)), f"pages missing from mkdocs.yml's nav: {sorted(set(pages) - set(listed))}"
    assert not sorted(set(listed) - set(pages)), f"nav entries with no page: {sorted(set(listed) - set(pages))}"


def test_the_readme_links_to_files_that_exist():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    assert "docs/reference/config.md" in targets
    missing = sorted({t for t in targets if t and not (ROOT / t).exists()})
    assert not missing, f"README links to files that do not exist: {missing}"


def test_the_examples_named_in_the_docs_and_docstrings_exist():
    # a renamed example left `examples/gdn_lm` in the building blocks' docstring and the Python
    # API reference, where a newcomer looks for a model written against the public API
    sources = [ROOT / "README.md", *DOCS.rglob("*.md"), *(ROOT / "nljax").rglob("*.py")]
    named = {m for s in sources for m in re.findall(r"examples/[\w./-]*\w", s.read_text(encoding="utf-8"))}
    assert "examples/gated_delta" in named
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert not missing, f"examples named in the docs or docstrings that do not exist: {missing}"


def test_the_python_api_reference_documents_every_public_name():
    """docs/reference/python-api.md renders `nljax.models.blocks` from a `members:` list, which
    does not follow the module: every name of its `__all__` must be in it (Model and TextModel
    have their own sections), and every name of `nljax.__all__` must be named on the page."""
    import nljax
    from nljax.models import blocks

    page = (DOCS / "reference" / "python-api.md").read_text(encoding="utf-8")
    listed = re.search(r"::: nljax\.models\.blocks\n(?:\s+.*\n)*?\s+members: \[([^\]]*)\]", page)
    assert listed, "the nljax.models.blocks section has no members: list"
    members = {m.strip() for m in listed.group(1).split(",")}
    assert set(blocks.__all__) - {"Model", "TextModel"} - members == set()
    assert [n for n in nljax.__all__ if n != "__version__" and f"nljax.{n}" not in page] == []
