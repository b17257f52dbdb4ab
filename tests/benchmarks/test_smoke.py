"""A smoke run of the kubelet-path benchmark: the documented command works and prints every
figure (the figures themselves are reported, never asserted)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import PYTHON, REPO, needs_root

FIGURES = (
    "init ",
    "unmount (directory not mounted)",
    "mount of an already-mounted directory",
    "second pod's mount of a staged volume",
    "first mount of a new 1 GiB loopfile",
    "init, 4 volumes",
    "idempotent mount, 4 volumes",
    "new volume's mount, 4 volumes",
    "throughput 2 workers / 1 worker",
    "8 pods over 2 volumes at once: 0 mount and 0 unmount failures",
)


@needs_root
def test_benchmark_smoke_run_prints_every_figure() -> None:
    proc = subprocess.run(
        [PYTHON, str(REPO / "benchmarks" / "kubelet.py"), "--smoke"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for figure in FIGURES:
        assert figure in proc.stdout, (figure, proc.stdout)
    assert "(0 failed)" in proc.stdout
    assert "flexhub-bench-" not in Path("/proc/self/mountinfo").read_text()
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True)
    assert "flexhub-bench-" not in loops.stdout
