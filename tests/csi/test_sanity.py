"""kubernetes-csi's csi-sanity against ``flexhub csi --mode both`` with loopfile on this host
(real loop devices, filesystems and mounts, under a root-only directory).

Zero failures, and exactly the skips of ``sanity-skips.tsv``, each with the reason flexhub does
not advertise the capability: a spec csi-sanity newly skips fails here, as does one that now
runs (the list must shrink with it).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.ciplugin import on_ci
from tests.conftest import needs_root
from tests.csi import build_sanity
from tests.csi.sanity import loops_backed_under, node_config, plugin, read_skips, run_sanity

pytestmark = [needs_root, pytest.mark.root]


@pytest.fixture(scope="module")
def csi_sanity() -> Path:
    if shutil.which("go") is None and not build_sanity.complete(build_sanity.bin_dir()):
        if on_ci():
            pytest.fail("csi-sanity is not built and go is missing")
        pytest.skip("csi-sanity needs Go to build (go is not on PATH)")
    started = time.monotonic()
    binary = build_sanity.build()
    print(f"csi-sanity {build_sanity.VERSION}: ready in {time.monotonic() - started:.0f} s")
    return binary


@pytest.mark.parametrize("access", ["mount", "block"])
def test_csi_sanity_loopfile(csi_sanity: Path, trusted_dir: Path, access: str) -> None:
    """``mount``: every volume staged with a filesystem; ``block``: as raw block volumes
    (``--csi.testvolumeaccesstype block``: csi-sanity gates no spec on it, so the skips are
    the same list)."""
    config = node_config(trusted_dir)
    (trusted_dir / "sanity").mkdir(mode=0o700)
    params = trusted_dir / "parameters.yaml"
    # xfs: ext4 grows online only with CAP_SYS_RESOURCE, which this host lacks (NodeExpand
    # after NodePublish); xfs needs 300 MiB at least
    params.write_text("backend: loopfile\nfsType: xfs\n")
    endpoint = trusted_dir / "csi.sock"
    work = trusted_dir / "sanity"
    started = time.monotonic()
    with plugin(config, endpoint, trusted_dir / "plugin.log"):
        report = run_sanity(
            csi_sanity,
            endpoint,
            work,
            f"--csi.testvolumeparameters={params}",
            f"--csi.testvolumesize={320 << 20}",
            f"--csi.testvolumeaccesstype={access}",
        )
    print(
        f"[{access}] {report.summary()}; with the plugin's start and stop {time.monotonic() - started:.1f} s"
    )
    if access == "block":  # the volumes were really staged raw (no filesystem, no mount)
        assert "(raw block)" in (trusted_dir / "plugin.log").read_text()
    assert not report.failed, "\n\n".join(f"{k}\n{v}" for k, v in report.failed.items())
    skips = read_skips()
    assert {k: v for k, v in report.skipped.items()} == {k: m for k, (m, _) in skips.items()}
    assert len(report.passed) >= 68, report.summary()
    # every volume csi-sanity made was unstaged, released and deleted
    assert loops_backed_under(trusted_dir) == []
    assert not any((trusted_dir / "loopfiles").rglob("*.img"))
    assert not list((trusted_dir / "state" / "csi").rglob("*.json"))
    for made in (work / "mnt", work / "stage"):
        assert not made.exists() or os.listdir(made) == [], made
