"""csi-sanity against ``flexhub csi`` serving the backend ``flexhub new-backend demo`` writes, as
generated (issue 33: a backend needs no change to work under CSI).

The scaffold is written and pip-installed (no deps) into a root-only directory that only the
plugin process has on its path; ``flexhub csi --mode both`` serves it with a node config naming
its ``[demo] root``. The generated backend does not provision (its provisioning is a stub), so,
as under FlexVolume, its volumes are static PVs: csi-sanity's controller endpoint is
:mod:`tests.csi.static_controller`, the stand-in for the admin who writes them. Every node spec
(stage, publish, stats, unpublish, unstage, the full lifecycle) runs against the real node
service. Zero failures, and exactly the skips of ``sanity-skips-demo.tsv``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import needs_root
from tests.csi.sanity import (
    HERE,
    REPO,
    node_config,
    read_skips,
    run_sanity,
    start_plugin,
    stop_plugin,
)
from tests.csi.static_controller import static_controller
from tests.csi.test_sanity import csi_sanity  # noqa: F401 (the fixture)

pytestmark = [needs_root, pytest.mark.root]

DEMO_SKIPS = HERE / "sanity-skips-demo.tsv"


def _install_demo(top: Path) -> Path:
    """``flexhub new-backend demo`` under ``top``, pip-installed into ``top/site``."""
    src, site = top / "src", top / "site"
    src.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    made = subprocess.run(
        [sys.executable, "-m", "flexhub", "new-backend", "demo"],
        cwd=src, capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert made.returncode == 0 and made.stderr == "", made.stderr
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(src / "flexhub-backend-demo")],
        cwd=src, capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    assert (site / "flexhub_demo" / "__init__.py").is_file()
    return site


def test_csi_sanity_scaffolded_demo_backend(csi_sanity: Path, trusted_dir: Path) -> None:  # noqa: F811
    started = time.monotonic()
    site = _install_demo(trusted_dir)
    config = node_config(trusted_dir)
    root = trusted_dir / "demo-volumes"
    root.mkdir(mode=0o700)
    with open(config, "a") as out:
        out.write(f'[demo]\nroot = "{root}"\n')
    work = trusted_dir / "sanity"
    work.mkdir(mode=0o700)
    endpoint, controller = trusted_dir / "csi.sock", trusted_dir / "controller.sock"
    log = trusted_dir / "plugin.log"
    proc = start_plugin(config, endpoint, log, PYTHONPATH=f"{REPO}{os.pathsep}{site}")
    try:
        with static_controller(controller, "demo", root):
            report = run_sanity(
                csi_sanity, endpoint, work, f"--csi.controllerendpoint=unix://{controller}"
            )
    finally:
        code = stop_plugin(proc)
    print(f"[demo] {report.summary()}; in all {time.monotonic() - started:.1f} s")
    assert code == 0, log.read_text()[-2000:]
    assert not report.failed, "\n\n".join(f"{k}\n{v}" for k, v in report.failed.items())
    skips = read_skips(DEMO_SKIPS)
    assert dict(report.skipped) == {k: m for k, (m, _) in skips.items()}
    # the node specs ran for real: the demo bound its directories on the staging paths
    text = log.read_text()
    assert "bound on" in text and "staged demo:" in text and "published demo:" in text
    node_specs = [p for p in report.passed if p.startswith("[It] Node Service")]
    assert "[It] Node Service should work" in node_specs, report.summary()
    assert "[It] Node Service should be idempotent" in node_specs, report.summary()
    assert len(node_specs) >= 24, report.summary()
    # every volume was unpublished, unstaged and deleted
    assert os.listdir(root) == []
    for made in (work / "mnt", work / "stage"):
        assert not made.exists() or os.listdir(made) == [], made
