"""The manual builds: `mkdocs build --strict` (every page in the nav, every link and anchor found, every
API reference resolved), and the README stays a product page that links into it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 300


def test_the_docs_build_strict(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def anchors(page: Path) -> set[str]:
    """The ids a docs page's headings get: an explicit `{ #id }`, else mkdocs' slug of the heading."""
    from markdown.extensions.toc import slugify

    found = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            explicit = re.search(r"\{[^}]*#([\w-]+)[^}]*\}\s*$", heading.group(1))
            found.add(explicit.group(1) if explicit else slugify(heading.group(1), "-"))
    return found


def test_the_readme_is_a_page_whose_docs_links_exist() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]*))?\)", readme)
    assert links, "the README links into docs/"
    missing = sorted({path for path, _ in links if not (ROOT / path).is_file()})
    assert not missing, missing
    broken = sorted({f"{path}#{anchor}" for path, anchor in links if anchor and anchor not in anchors(ROOT / path)})
    assert not broken, broken
