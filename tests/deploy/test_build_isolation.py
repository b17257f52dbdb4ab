"""deploy/build_runtime.py builds the local projects' wheels with the building interpreter's
own setuptools (``pip wheel --no-build-isolation --no-deps``) only when that interpreter can
build them the way an isolated build would, and installs their dependencies as before (an
sdist among them gets its own build environment). Checked here: each way it must fall back,
and what ``build()`` hands pip either way. (That both ways give the same runtime, with this
machine's setuptools, the newest the index serves, is measured in docs/operators/deploy.md.)"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "deploy"))

import build_runtime  # noqa: E402


def scaffolded(base: Path) -> Path:
    """What ``flexhub new-backend mystore`` writes (as the test runtimes are built with)."""
    from flexhub.admin.scaffold import new_backend

    return new_backend("mystore", base)


def project(base: Path, name: str, text: str) -> Path:
    path = base / name
    path.mkdir()
    (path / "pyproject.toml").write_text(text)
    return path


def shipped() -> list[Path]:
    return [REPO, *(REPO / "backends" / name for name in build_runtime.BACKENDS)]


def test_flexhub_its_backends_and_a_scaffolded_one_build_in_place(tmp_path: Path) -> None:
    """As in CI: the test extra brings setuptools (>= 77, with grpcio-tools) and packaging."""
    mystore = scaffolded(tmp_path)
    assert build_runtime._builds_in_place([*shipped(), mystore], sys.executable)


@pytest.mark.parametrize(
    "text",
    [
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n',
        '[build-system]\nrequires = ["setuptools>=68", "no-such-dist-here"]\n'
        'build-backend = "setuptools.build_meta"\n',
        '[build-system]\nrequires = ["setuptools>=9999"]\nbuild-backend = "setuptools.build_meta"\n',
        '[build-system]\nrequires = ["setuptools; python_version < \'3\'"]\n'
        'build-backend = "setuptools.build_meta"\n',
        '[build-system]\nrequires = ["setuptools", "packaging[x]"]\n'
        'build-backend = "setuptools.build_meta"\n',
        '[build-system]\nrequires = ["not a requirement !!"]\n'
        'build-backend = "setuptools.build_meta"\n',
        "[project]\nname = 'legacy'\n",  # no build-system: pip's default, isolated
        "not toml [",
    ],
    ids=[
        "other-backend", "missing", "too-old", "marker", "extras", "malformed", "none",
        "unreadable",
    ],
)  # fmt: skip
def test_a_project_this_interpreter_cannot_build_the_same_way_is_isolated(
    tmp_path: Path, text: str
) -> None:
    other = project(tmp_path, "other", text)
    assert not build_runtime._builds_in_place([*shipped(), other], sys.executable)


def test_another_interpreter_or_venv_is_isolated(tmp_path: Path) -> None:
    """Another venv's ``python`` links to the same base interpreter but has its own
    distributions: only this very path counts."""
    link = tmp_path / "python"
    link.symlink_to(sys.executable)
    assert not build_runtime._builds_in_place(shipped(), str(link))
    assert not build_runtime._builds_in_place(shipped(), "/usr/bin/python3.9")
    assert not build_runtime._builds_in_place([tmp_path / "absent"], sys.executable)


def test_a_setuptools_that_needs_the_wheel_distribution_is_isolated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.metadata.version

    def old_setuptools(name: str) -> str:
        return "69.5.1" if name == "setuptools" else real(name)

    monkeypatch.setattr(importlib.metadata, "version", old_setuptools)
    assert not build_runtime._builds_in_place(shipped(), sys.executable)


class _Stop(Exception):
    pass


def _pip_calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, in_place: bool) -> list[list[str]]:
    """The pip commands ``build()`` runs up to its install (then stopped), with the standard
    library's copy (and so the question where its ``site`` reads) left out and ``pip wheel`` answered by empty files of the wheels' names."""
    calls: list[list[str]] = []

    def run(argv: list[str], **_: Any) -> None:
        calls.append([str(a) for a in argv])
        if argv[3] == "wheel":
            into = Path(argv[argv.index("--wheel-dir") + 1])
            into.mkdir(parents=True)
            for name in ("flexhub", *(f"flexhub_{b}" for b in build_runtime.BACKENDS)):
                (into / f"{name}-0.1.0-py3-none-any.whl").touch()
            (into / "flexhub_backend_mystore-0.1.0-py3-none-any.whl").touch()
            return
        raise _Stop

    monkeypatch.setattr(build_runtime, "_run", run)
    monkeypatch.setattr(build_runtime, "_copy_stdlib", lambda source, target: target.mkdir())
    site = lambda rt: rt / "lib" / build_runtime.PYVER / "site-packages"  # noqa: E731
    monkeypatch.setattr(build_runtime, "_site_dir", site)  # no standard library copied to ask
    monkeypatch.setattr(build_runtime, "_builds_in_place", lambda projects, python: in_place)
    mystore = scaffolded(tmp_path)
    with pytest.raises(_Stop):
        build_runtime.build(tmp_path / "out", extras=(str(mystore), "some-wheel.whl"))
    return calls


def test_in_place_builds_only_the_local_wheels_and_installs_them_as_usual(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    wheel, install = _pip_calls(monkeypatch, tmp_path, in_place=True)
    assert wheel[3] == "wheel" and {"--no-build-isolation", "--no-deps"} <= set(wheel)
    built = wheel[wheel.index("--wheel-dir") + 2 :]
    assert [Path(b).name for b in built] == [
        "flexhub-src",
        *(f"backend-{b}" for b in build_runtime.BACKENDS),
        "with-0",
    ]  # flexhub, its backends, the --with project: never a dependency, never the --with wheel
    assert install[3] == "install" and "--no-build-isolation" not in install
    targets = install[install.index(str(Path(install[install.index("--target") + 1]))) + 1 :]
    assert targets[0].endswith("/flexhub-0.1.0-py3-none-any.whl[csi]")
    assert all(t.endswith(".whl") for t in targets[1:])
    assert targets[-1] == "some-wheel.whl" and len(targets) == 7  # a --with wheel as given


def test_isolated_installs_from_the_sources_as_before(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (install,) = _pip_calls(monkeypatch, tmp_path, in_place=False)
    assert install[3] == "install" and "--no-build-isolation" not in install
    targets = install[install.index("--target") + 2 :]
    assert targets[0].endswith("/flexhub-src[csi]") and targets[-1] == "some-wheel.whl"
    assert not any(t.endswith(".whl") for t in targets[:-1])
