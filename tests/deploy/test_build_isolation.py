"""deploy/build_runtime.py builds the local projects with the building interpreter's own
setuptools (``pip --no-build-isolation``) only when that builds the same thing: checked here
for each way it must fall back to pip's isolated build environments. (That both ways give a
runtime of the same content, so of the same name, was checked by hand: 8c3c564585de both.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "deploy"))

import build_runtime  # noqa: E402

SETUPTOOLS = (
    '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
)


def project(base: Path, name: str, text: str = SETUPTOOLS) -> Path:
    path = base / name
    path.mkdir()
    (path / "pyproject.toml").write_text(text)
    return path


def shipped() -> list[Path]:
    return [REPO, *(REPO / "backends" / name for name in build_runtime.BACKENDS)]


def test_flexhub_and_its_backends_build_in_place() -> None:
    """As in CI: the test extra brings setuptools (>= 77, with grpcio-tools) and packaging."""
    assert build_runtime._builds_in_place(shipped(), (), sys.executable)


def test_a_scaffolded_backend_builds_in_place_too(tmp_path: Path) -> None:
    mystore = project(tmp_path, "mystore")
    assert build_runtime._builds_in_place([*shipped(), mystore], (str(mystore),), sys.executable)
    wheel = str(tmp_path / "x-1.0-py3-none-any.whl")
    assert build_runtime._builds_in_place(shipped(), (wheel,), sys.executable)


@pytest.mark.parametrize(
    "text",
    [
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n',
        '[build-system]\nrequires = ["setuptools>=68", "no-such-dist-here"]\n'
        'build-backend = "setuptools.build_meta"\n',
        '[build-system]\nrequires = ["setuptools>=9999"]\nbuild-backend = "setuptools.build_meta"\n',
        "[build-system]\nrequires = [\"setuptools; python_version < '3'\"]\n"
        'build-backend = "setuptools.build_meta"\n',
        "[project]\nname = 'legacy'\n",  # no build-system: pip's default, isolated
        "not toml [",
    ],
    ids=["other-backend", "missing-requirement", "too-old", "marker", "none", "unreadable"],
)
def test_a_project_this_interpreter_cannot_build_the_same_way_is_isolated(
    tmp_path: Path, text: str
) -> None:
    other = project(tmp_path, "other", text)
    assert not build_runtime._builds_in_place([*shipped(), other], (str(other),), sys.executable)


def test_a_package_pip_fetches_or_another_interpreter_is_isolated(tmp_path: Path) -> None:
    assert not build_runtime._builds_in_place(shipped(), ("flexhub-backend-x",), sys.executable)
    assert not build_runtime._builds_in_place(shipped(), ("./x-1.0.tar.gz",), sys.executable)
    assert not build_runtime._builds_in_place(shipped(), (), "/usr/bin/python3.9")
    assert not build_runtime._builds_in_place([tmp_path / "absent"], (), sys.executable)
