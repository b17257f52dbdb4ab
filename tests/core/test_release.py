"""One version everywhere: the package metadata, ``flexhub --version``, the changelog, the
DaemonSet manifest's image tag (the runtime's marker is checked in tests/deploy); a LICENSE
that matches the metadata."""

from __future__ import annotations

import re
import subprocess
import tomllib
from importlib.metadata import metadata, version

import flexhub
from tests.conftest import PYTHON, REPO


def test_the_version_is_written_once() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "flexhub.__version__"}
    assert version("flexhub") == flexhub.__version__


def test_flexhub_version_prints_it() -> None:
    for args in (["--version"], ["version"]):
        proc = subprocess.run(
            [PYTHON, "-m", "flexhub", *args], capture_output=True, text=True, check=False
        )
        assert proc.stdout == f"flexhub {flexhub.__version__}\n"


def test_the_changelog_has_the_version() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## (\S+)", text, flags=re.MULTILINE)
    assert flexhub.__version__ in headings
    assert headings[0] in ("Unreleased", flexhub.__version__)


def test_the_manifest_runs_this_versions_image() -> None:
    text = (REPO / "deploy" / "kubernetes" / "flexhub.yaml").read_text()
    tags = set(re.findall(r"image:\s*\"?flexhub:([^\s\"]+)", text))
    assert tags == {flexhub.__version__}


def test_license_is_apache_and_matches_the_metadata() -> None:
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    meta = metadata("flexhub")
    assert "Apache-2.0" in (meta.get("License") or meta.get("License-Expression") or "")
