"""The docs site (docs/, mkdocs.yml) and the README that points into it.

- the reference pages under docs/reference/ are what ``docs/gen.py`` writes from the code now
  (a schema, a command or a chart value changed without ``python3 docs/gen.py`` is stale);
- ``mkdocs build --strict`` passes: no broken link or anchor, no page outside the nav, every
  README or CHANGELOG section a page includes is there;
- the README stays short, and each of its relative links names a file of the repository;
- the repository stands alone: no page points outside it.
"""

from __future__ import annotations

import filecmp
import os
import re
import subprocess
from pathlib import Path

from tests.conftest import PYTHON, REPO

GENERATED = REPO / "docs" / "reference"


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_generated_pages_are_not_stale(tmp_path: Path) -> None:
    proc = subprocess.run(
        [PYTHON, str(REPO / "docs" / "gen.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fresh = tmp_path / "reference"
    assert _files(fresh) == _files(GENERATED), "generated pages added or gone: run docs/gen.py"
    stale = [
        name for name in sorted(_files(fresh)) if not filecmp.cmp(fresh / name, GENERATED / name)
    ]
    assert not stale, f"stale generated pages (run python3 docs/gen.py): {stale}"


def test_gen_check_names_a_stale_page(tmp_path: Path) -> None:
    """``docs/gen.py --check`` fails on a page that differs, and names it."""
    docs = tmp_path / "docs"
    subprocess.run([PYTHON, str(REPO / "docs" / "gen.py"), "--out", str(docs)], check=True)
    page = docs / "reference" / "cli.md"
    page.write_text(page.read_text() + "edited by hand\n")
    proc = subprocess.run(
        [PYTHON, str(REPO / "docs" / "gen.py"), "--check", "--out", str(docs)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert "reference/cli.md" in proc.stderr
    assert "reference/chart-values.md" not in proc.stderr


def test_generated_pages_cover_every_backend_command_and_value() -> None:
    """What the generator reads is all there: each shipped backend's options and class
    parameters, each visible command, each chart value."""
    for backend in ("loopfile", "nfs", "cifs", "iscsi"):
        text = (GENERATED / "backends" / f"{backend}.md").read_text()
        assert "## PV options" in text and "## StorageClass parameters" in text
        assert "| `onDelete` |" in text
    assert "| `file` | yes |" in (GENERATED / "backends" / "loopfile.md").read_text()
    assert "| `targetHost` | yes |" in (GENERATED / "backends" / "iscsi.md").read_text()
    cli = (GENERATED / "cli.md").read_text()
    for command in ("validate", "doctor", "install", "fence preempt", "provisioner", "csi"):
        assert f"## `flexhub {command}`" in cli
    assert "reclaim-volume" not in cli  # hidden: the node agent's, not people's
    values = (GENERATED / "chart-values.md").read_text()
    for value in ("image.repository", "pluginDir", "provisioner.replicas", "storageClasses"):
        assert f"| `{value}` |" in values


def test_mkdocs_build_is_strict_and_clean(tmp_path: Path) -> None:
    proc = subprocess.run(
        [PYTHON, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()


def test_readme_is_short_and_its_links_resolve() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    targets += re.findall(r"^\[[\w-]+\]: ([^#\s]+)", text, re.M)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links into docs/"
    missing = [t for t in local if not (REPO / t).exists()]
    assert not missing, missing


def test_the_docs_stand_alone() -> None:
    for page in [REPO / "README.md", REPO / "mkdocs.yml", *(REPO / "docs").rglob("*.md")]:
        text = page.read_text()
        assert "../shared" not in text and "/work/" not in text, page
