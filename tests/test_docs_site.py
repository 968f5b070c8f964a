"""The documentation site builds strict, and its pages keep the shape readers rely on.

``mkdocs build --strict`` (mkdocs.yml: mkdocs-material, mkdocstrings for the API reference) fails on
a link to a missing page or anchor and on a name the reference cannot resolve. docs/architecture.md
lists every module of src/resurgo, and only those; the guide's pages stay small and the README short.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SRC = ROOT / "src" / "resurgo"
REFERENCE_PAGES = {"api.md", "reference.md", "format.md", "import.md", "architecture.md"}  # read by lookup
GUIDE_PAGE_MAX = 20 * 1024
README_MAX = 10 * 1024


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))


def test_the_site_builds_strict(tmp_path):
    proc = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-6000:]}"
    assert (tmp_path / "site" / "reference" / "index.html").read_text().count('id="resurgo.load_dict"') == 1


def test_a_broken_link_or_anchor_fails_the_strict_build(tmp_path):
    """The site's own validation settings, on two pages: a link to an anchor that is not there and
    to a page that is not there are errors, not notes."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[there](other.md#no-such-heading)\n")
    (docs / "other.md").write_text("# Other\n\n## A heading\n")
    small = {"site_name": "t", "docs_dir": "docs", "strict": True, "validation": config["validation"],
             "markdown_extensions": config["markdown_extensions"]}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(small))
    proc = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0 and "no-such-heading" in proc.stderr, proc.stderr[-3000:]

    (docs / "index.md").write_text("# Home\n\n[there](missing.md)\n")
    proc = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0 and "missing.md" in proc.stderr, proc.stderr[-3000:]


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    return [p for v in nav.values() for p in _nav_pages(v)]


def test_every_page_is_in_the_navigation():
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages


def test_architecture_lists_every_module_and_only_those():
    text = (DOCS / "architecture.md").read_text()
    listed = set(re.findall(r"^- `([\w/]+\.py)`: \S", text, flags=re.M))
    modules = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")}
    assert sorted(modules - listed) == [], "docs/architecture.md, section Modules, lacks a line '- `path.py`: ...' for these"
    assert sorted(listed - modules) == [], "docs/architecture.md lists modules that src/resurgo does not have"


def test_guide_pages_are_small_and_the_readme_short():
    large = {p.name: p.stat().st_size for p in DOCS.rglob("*.md")
             if p.name not in REFERENCE_PAGES and p.stat().st_size > GUIDE_PAGE_MAX}
    assert large == {}, f"pages over {GUIDE_PAGE_MAX} bytes: split them by subject"
    assert (ROOT / "README.md").stat().st_size <= README_MAX, "README.md: move reference material to docs/"
