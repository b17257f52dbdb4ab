"""The PV and StorageClass examples of the README and the docs (docs/**/*.md) are valid:
`flexhub validate` accepts each."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
BLOCKS = [b for p in PAGES for b in re.findall(r"```yaml\n(.*?)```", p.read_text(), re.S)]
EXAMPLES = [b for b in BLOCKS if "driver: k8s/flexhub" in b]
CLASSES = [b for b in BLOCKS if "kind: StorageClass" in b and "provisioner: flexhub" in b]


def test_every_backend_has_an_example() -> None:
    backends = {m for b in EXAMPLES for m in re.findall(r"backend: (\w+)", b)}
    assert backends == {"loopfile", "nfs", "iscsi", "cifs"}


def test_there_is_a_storage_class_example() -> None:
    assert CLASSES


@pytest.mark.parametrize(
    "example", EXAMPLES + CLASSES, ids=lambda b: re.findall(r"(?:backend|name): ([\w-]+)", b)[0]
)
def test_readme_example_validates(example: str, tmp_path: Path) -> None:
    manifest = tmp_path / "example.yaml"
    manifest.write_text(example)
    proc = subprocess.run(
        [PYTHON, "-m", "flexhub", "validate", str(manifest)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(": ok" in line for line in proc.stdout.splitlines()), proc.stdout
