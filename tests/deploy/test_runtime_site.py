"""A runtime's driver starts Python without :mod:`site` when site would only have added the
runtime's ``site-packages``: the build says so in the runtime's marker (no ``.pth`` file and no
``sitecustomize``), and the shim then starts with ``-I -S`` and adds that directory itself. Anything else (a
``.pth`` file or a ``sitecustomize``, an older runtime's marker, an odd value, a plain Python) keeps ``-I`` with site.
The real runtime's shim is checked end to end in tests/deploy/test_runtime.py."""

from __future__ import annotations

import subprocess
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
    assert 'if os.path.isfile(sys.prefix + "/flexhub-runtime.json"):\n' in text
    assert f'    sys.path.append(sys.prefix + "/{site}")\ntry:\n' in text


def test_a_prefix_without_the_runtime_s_marker_gets_no_site_directory() -> None:
    """Python whose prefix is not the runtime (its standard library incomplete, it fell back
    to the one it was built for, such as the node's /usr) reads no site directory there."""
    text = render_shim("/ignored", None, "/rt", {**MARKER, "site_packages": SITE})
    prelude = text.split(" -I -S -c '", 1)[1].split("\ntry:\n", 1)[0]
    probe = f"{prelude}\nprint(repr(sys.path))"
    out = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert not Path(sys.prefix, "flexhub-runtime.json").exists()
    assert SITE not in out and "sys.prefix" not in out


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


def _fake_interpreter(rt: Path, prints: list[str]) -> None:
    """``rt/bin/python3.11``: a script that prints ``prints``, one per line, as the copied
    interpreter's ``site.getsitepackages()`` would."""
    (rt / "bin").mkdir(parents=True)
    python = rt / "bin" / build_runtime.PYVER
    lines = "".join(f"printf '%s\\n' '{p}'\n" for p in prints)
    python.write_text(f"#!/bin/sh\n{lines}")
    python.chmod(0o755)


@pytest.mark.parametrize("name", ["site-packages", "dist-packages"])
def test_the_build_installs_where_the_copied_interpreter_s_site_reads(
    tmp_path: Path, name: str
) -> None:
    """Upstream CPython's site reads lib/python3.X/site-packages; Debian's, under the same
    prefix, local/lib/python3.X/dist-packages, lib/python3/dist-packages and
    lib/python3.X/dist-packages. A path with a space is one path."""
    rt = tmp_path / "a build dir" / "runtime"
    lib = rt / "lib" / build_runtime.PYVER
    others = [
        str(rt / "local" / "lib" / build_runtime.PYVER / name),
        str(rt / "lib/python3" / name),
    ]
    _fake_interpreter(rt, [*others, str(lib / name)])
    assert build_runtime._site_dir(rt) == lib / name


def test_a_build_whose_interpreter_reads_no_site_directory_of_its_own_stops(tmp_path: Path) -> None:
    rt = tmp_path / "runtime"
    _fake_interpreter(rt, ["/usr/lib/python3/dist-packages", str(rt / "lib/python3/dist-packages")])
    with pytest.raises(SystemExit, match="reads none of site-packages, dist-packages"):
        build_runtime._site_dir(rt)


def test_a_distribution_s_hooks_and_packages_stay_out_of_the_runtime(tmp_path: Path) -> None:
    """Debian's sitecustomize.py (a link into /etc), its EXTERNALLY-MANAGED and any
    dist-packages in the standard library's directory are the build machine's, not CPython's."""
    stdlib = tmp_path / "stdlib"
    (stdlib / "dist-packages" / "six").mkdir(parents=True)
    (stdlib / "json").mkdir()
    for name in ("os.py", "json/__init__.py", "EXTERNALLY-MANAGED", "json/sitecustomize.py"):
        (stdlib / name).write_text("")
    (tmp_path / "etc-hook.py").write_text("import apport_python_hook\n")
    (stdlib / "sitecustomize.py").symlink_to(tmp_path / "etc-hook.py")
    build_runtime._copy_stdlib(stdlib, tmp_path / "copy")
    copied = sorted(str(p.relative_to(tmp_path / "copy")) for p in (tmp_path / "copy").rglob("*"))
    # only at the top: a module of that name deeper down is the library's own
    assert copied == ["json", "json/__init__.py", "json/sitecustomize.py", "os.py"]


def test_the_node_profile_prunes_without_the_packaging_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A distribution's interpreter may have pip but not ``packaging`` (Debian's): the prune
    reads requirements with pip's vendored copy."""
    site = tmp_path / "site"
    for name, requires in (
        ("flexhub", ["kubernetes>=30", "jsonschema"]),
        ("kubernetes", ["six", "urllib3; python_version < '3'"]),
        ("six", []),
        ("jsonschema", []),
        ("flexhub_backend_x", ["flexhub"]),
    ):
        info = site / f"{name}-1.0.dist-info"
        info.mkdir(parents=True)
        meta = [f"Name: {name}", *(f"Requires-Dist: {r}" for r in requires)]
        (info / "METADATA").write_text("\n".join(meta) + "\n")
        (site / f"{name}.py").write_text("")
        (info / "RECORD").write_text(f"{name}.py,,\n")
    monkeypatch.setitem(sys.modules, "packaging", None)  # import packaging: ImportError
    monkeypatch.setitem(sys.modules, "packaging.requirements", None)
    assert build_runtime._prune(site, frozenset({"kubernetes"})) == ["kubernetes", "six"]
    assert sorted(p.name for p in site.glob("*.py")) == [
        "flexhub.py", "flexhub_backend_x.py", "jsonschema.py"
    ]  # fmt: skip
