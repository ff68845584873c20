"""The documentation: the README a newcomer reads in five minutes, and the pages under docs/ that MkDocs builds.

`mkdocs build --strict` fails on a broken link or anchor and on a page left out of the navigation (tools/mkdocs.yml's
`validation` turns each into a warning, strict mode into an error); the other tests say the same things without
MkDocs, so that a failure names the page.
"""

import os
import re
import subprocess
import sys

import yaml
from conftest import REPO

DOCS = REPO / "docs"
README = REPO / "README.md"
MKDOCS = REPO / "tools" / "mkdocs.yml"
MAX_README_LINES = 200
LINK = re.compile(r"\]\(([^)\s]+)\)")  # a Markdown link's target


def nav_pages(entries) -> list[str]:
    """Every page the MkDocs config's nav lists, depth first."""
    pages = []
    for entry in entries:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_the_site_builds_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(MKDOCS), "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's notice about its future, not about our pages
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_page_is_in_the_nav():
    config = yaml.safe_load(MKDOCS.read_text())
    listed = nav_pages(config["nav"])
    pages = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
    assert sorted(listed) == pages, "docs/ pages and tools/mkdocs.yml's nav differ"
    assert len(listed) == len(set(listed)), "a page is listed twice"


def test_the_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines < MAX_README_LINES, f"README.md has {lines} lines; the rest belongs in docs/"


def test_the_readme_links_to_pages_that_exist():
    targets = [target for target in LINK.findall(README.read_text()) if target.startswith("docs/")]
    assert targets, "the README links to no page under docs/"
    missing = [target for target in targets if not (REPO / target.split("#")[0]).is_file()]
    assert not missing, f"README.md links to missing files: {missing}"
    linked = {target.split("#")[0] for target in targets}
    config = yaml.safe_load(MKDOCS.read_text())
    unlinked = [page for page in nav_pages(config["nav"]) if f"docs/{page}" not in linked]
    assert not unlinked, f"the README's table links to none of: {unlinked}"
