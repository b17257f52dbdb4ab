"""Smoke runs of the kubelet-path and data-path benchmarks and of the call profile: the
documented commands work, print every figure (the figures themselves are reported, never
asserted) and leave nothing mounted or attached."""

from __future__ import annotations

import re
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


PROFILE_ARGS = ("--profile", "all", "--smoke", "--top", "40")


@needs_root
def test_profile_smoke_run_profiles_each_call_kinds_own_work() -> None:
    proc = subprocess.run(
        [PYTHON, str(REPO / "benchmarks" / "kubelet.py"), *PROFILE_ARGS],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sections = {part.split(":", 1)[0]: part for part in proc.stdout.split("\n## ")[1:]}
    assert list(sections) == [
        "init",
        "unmount (directory not mounted)",
        "mount of an already-mounted directory",
        "second pod's mount of a staged volume",
        "first mount of a new 1 GiB loopfile",
    ], proc.stdout
    # each profile is the driver's own run of that call: the quick path answers init and
    # unmount; a second pod's mount writes its record; a new volume is formatted by commands
    assert "flexhub/driver/quick.py" in sections["init"]
    assert "flexhub/node/fastpath.py" in sections["unmount (directory not mounted)"]
    assert "posix.fsync" in sections["second pod's mount of a staged volume"]
    first = sections["first mount of a new 1 GiB loopfile"]
    assert "flexhub/node/fs.py" in first and "_posixsubprocess.fork_exec" in first, first
    assert "flexhub-bench-" not in Path("/proc/self/mountinfo").read_text()
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True)
    assert "flexhub-bench-" not in loops.stdout


DATAPATH_JOBS = (
    "randread-4k-qd1",
    "randread-4k-qd32",
    "randwrite-4k-qd1",
    "randwrite-4k-qd32",
    "seqread-1m-qd8",
    "seqwrite-1m-qd8",
    "fsync-4k-write",
)
DATAPATH_TARGETS = ("host", "flexhub", "loop-buffered")


@needs_root
def test_datapath_smoke_run_prints_a_figure_per_job_and_target() -> None:
    proc = subprocess.run(
        [PYTHON, str(REPO / "benchmarks" / "datapath.py"), "--smoke"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for job in DATAPATH_JOBS:
        for target in DATAPATH_TARGETS:
            unit = "MiB/s" if job.startswith("seq") else "IOPS"
            figure = re.compile(rf"^{job} +{target} +([0-9.]+) {re.escape(unit)} ", re.M)
            found = figure.search(proc.stdout)
            assert found is not None and float(found.group(1)) > 0, (job, target, proc.stdout)
    # the volume really went through flexhub with direct I/O, the twin without
    assert re.search(r"^# flexhub volume: (ext4|xfs) .* dio=1 ", proc.stdout, re.M), proc.stdout
    assert re.search(r"^# loop-buffered: (ext4|xfs) .* dio=0 ", proc.stdout, re.M), proc.stdout
    assert "flexhub-bench-" not in Path("/proc/self/mountinfo").read_text()
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True)
    assert "flexhub-bench-" not in loops.stdout


@needs_root
def test_csi_benchmark_smoke_run_prints_every_figure() -> None:
    """benchmarks/csi_publish.py: the plugin process starts, every figure is printed, and
    nothing it staged or published is left mounted."""
    proc = subprocess.run(
        [PYTHON, str(REPO / "benchmarks" / "csi_publish.py"), "--smoke"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for figure in ("second pod's mount of a staged volume", "a pod's unmount (volume stays staged)",
                   "first mount of a new 16Mi loopfile", "plugin memory (RSS)"):  # fmt: skip
        assert re.search(re.escape(figure) + r".* [0-9.]+ (ms|MiB)", proc.stdout), proc.stdout
    assert "(0 unmount failures)" in proc.stdout
    mounts = Path("/proc/self/mountinfo").read_text()
    assert "csi-bench-" not in mounts and "flexhub-bench-" not in mounts
