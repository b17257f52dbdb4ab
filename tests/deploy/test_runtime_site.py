"""A runtime's driver starts Python without :mod:`site` when site would only have added the
runtime's ``site-packages``: the build says so in the runtime's marker (no ``.pth`` file and no
``sitecustomize``), and the shim then starts with ``-I -S`` and adds that directory itself. Anything else (a
``.pth`` file or a ``sitecustomize``, an older runtime's marker, an odd value, a plain Python) keeps ``-I`` with site.
The real runtime's shim is checked end to end in tests/deploy/test_runtime.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flexhub.admin.install import render_shim

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "deploy"))

import build_runtime  # noqa: E402

MARKER = {"python": "bin/python3.11", "loader": "lib/ld.so", "library_path": "lib"}
SITE = "lib/python3.11/site-packages"


def runtime_tree(tmp_path: Path, *names: str) -> tuple[Path, Path]:
    """A runtime's stdlib and site-packages directories, with ``names`` (relative to the
    stdlib) in them."""
    stdlib = tmp_path / "lib/python3.11"
    (stdlib / "site-packages").mkdir(parents=True)
    (stdlib / "os.py").write_text("")
    for name in names:
        (stdlib / name).parent.mkdir(parents=True, exist_ok=True)
        (stdlib / name).write_text("")
    return stdlib, stdlib / "site-packages"


def test_a_build_with_nothing_for_site_to_run_starts_without_it(tmp_path: Path) -> None:
    stdlib, site = runtime_tree(
        tmp_path, "site-packages/flexhub_iscsi/__init__.py", "site-packages/six.py"
    )
    (site / "flexhub-0.1.0.dist-info").mkdir()
    assert build_runtime.site_needs(stdlib, site) == []


@pytest.mark.parametrize(
    ("name", "found"),
    [
        ("site-packages/vendor-nspkg.pth", "vendor-nspkg.pth"),
        ("site-packages/sitecustomize.py", "site-packages/sitecustomize.py"),
        ("site-packages/sitecustomize/__init__.py", "site-packages/sitecustomize"),
        ("sitecustomize.py", "sitecustomize.py"),  # the stdlib's, as some distributions have
    ],
)
def test_a_pth_file_or_a_sitecustomize_keeps_site(tmp_path: Path, name: str, found: str) -> None:
    stdlib, site = runtime_tree(tmp_path, name)
    assert build_runtime.site_needs(stdlib, site) == [found]


def test_how_a_runtime_is_started_is_part_of_its_name(tmp_path: Path) -> None:
    """A node that holds an older build of the same files (started with site) must not keep
    it under the new build's name: it would never start without site."""
    runtime_tree(tmp_path, "site-packages/six.py")
    start = {"site_packages": "lib/python3.11/site-packages"}
    assert build_runtime._digest(tmp_path, start) != build_runtime._digest(tmp_path, {})
    assert build_runtime._digest(tmp_path, start) == build_runtime._digest(tmp_path, start)


@pytest.mark.parametrize("site", [SITE, "lib/python3.11/dist-packages"])  # upstream's, Debian's
def test_the_shim_of_such_a_runtime_starts_without_site(site: str) -> None:
    text = render_shim("/ignored", None, "/rt", {**MARKER, "site_packages": site})
    assert "/rt/bin/python3.11 -I -S -c 'import sys\n" in text
    assert f'sys.path.append(sys.prefix + "/{site}")\ntry:\n' in text


@pytest.mark.parametrize(
    "marker",
    [
        MARKER,  # a runtime built before, or with a .pth file
        {**MARKER, "site_packages": "lib/python3.11/site-packages/../../../tmp"},
        {**MARKER, "site_packages": "lib/python3.11/site-packages\")' ; touch /x ; '"},
        {**MARKER, "site_packages": "/usr/lib/python3/dist-packages"},
        {**MARKER, "site_packages": "lib/python3/dist-packages"},
        {**MARKER, "site_packages": "lib/python3.11/dist-packages/../site-packages"},
        {**MARKER, "site_packages": "lib/python3.11/other-packages"},
    ],
)
def test_any_other_runtime_starts_with_site(marker: dict[str, str]) -> None:
    text = render_shim("/ignored", None, "/rt", marker)
    assert "/rt/bin/python3.11 -I -c 'import sys\ntry:\n" in text
    assert " -S " not in text and "sys.path" not in text


def test_a_plain_python_starts_with_site() -> None:
    text = render_shim("/usr/bin/python3", None)
    assert 'exec "$PY" -I -c \'import sys\ntry:\n' in text and " -S " not in text
