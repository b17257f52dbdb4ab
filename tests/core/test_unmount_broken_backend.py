"""unmount of a filesystem volume whose backend package broke after the mount (real tmpfs)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import TEST_SITE, needs_root, run_flexhub

pytestmark = [needs_root, pytest.mark.root]


def test_unmount_of_a_filesystem_volume_without_its_backend(
    node_tree: dict[str, Path], tmp_path: Path
) -> None:
    target = tmp_path / "pod" / "vol"
    target.mkdir(parents=True)
    reply = run_flexhub(
        ["mount", str(target), json.dumps({"backend": "echo", "tag": "t1"})], node_tree["config"]
    )
    assert reply.ok, reply
    try:
        assert os.path.ismount(target)
        shadow = tmp_path / "shadow" / "flexhub_testbackends"
        shadow.mkdir(parents=True)
        (shadow / "__init__.py").write_text('raise ImportError("testbackends are broken")\n')
        broken = {"PYTHONPATH": f"{shadow.parent}:{TEST_SITE}"}

        reply = run_flexhub(["unmount", str(target)], node_tree["config"], env=broken)
        assert reply.ok, reply  # the core unmounted it alone
        assert not os.path.ismount(target)
        assert not list((node_tree["state"] / "pods").iterdir())
        log = (node_tree["log"] / "flexhub.log").read_text()
        assert "backend 'echo' unusable for unmounting echo:t1" in log
    finally:
        if os.path.ismount(target):
            subprocess.run(["umount", "-l", str(target)], check=False)
