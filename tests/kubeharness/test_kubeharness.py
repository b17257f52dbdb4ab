"""Conformance against the real kubelet code: the Go harness in this directory.

The harness (``*_test.go``, its own ``go.mod`` at the control-plane tier's Kubernetes pin) drives the
installed flexhub driver through ``k8s.io/kubernetes/pkg/volume/flexvolume`` with a real exec
and a real mounter (README, "Conformance against the real kubelet code"). These tests build
it once per session (``go test -c``, a static binary) and run it: for loopfile on this host,
for NFS and iSCSI inside the VM rig. Each check is also run against a deliberately broken
driver and must fail there. Go's own output is shown when a run goes wrong.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import pytest

from tests.cluster import build as cluster_build
from tests.kubeharness import runlist
from tests.rig import services
from tests.rig.vm import VM

HERE = Path(__file__).resolve().parent
BINARY = HERE / "build" / "kubeharness.test"
BUILD_LOCK = HERE / "build" / ".lock"
MiB = 1024 * 1024
#: Bound for one harness run (the lifecycle is about 15 driver calls; in the VM 3-10 s each).
RUN_TIMEOUT = 900
#: Bound for a cold ``go test -c`` (module download and build; 3.5 min on an idle 2-core machine).
BUILD_TIMEOUT = 1800
#: Bound for the wait for the build lock: .ci/run's pre-build holds it through the control
#: plane's build and then the harness's.
LOCK_WAIT = cluster_build.BUILD_TIMEOUT + BUILD_TIMEOUT

pytestmark = [pytest.mark.goharness, pytest.mark.root]


def _on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def harness() -> Path:
    """The harness test binary, built once per session (Go's build cache makes a rebuild
    after no change a few seconds)."""
    reason = None
    if os.geteuid() != 0:
        reason = "needs root (real mounts)"
    elif shutil.which("go") is None:
        reason = "needs Go >= 1.26 (`go` not on PATH)"
    if reason:
        if _on_ci():
            pytest.fail(f"CI=true but the Go harness {reason}", pytrace=False)
        pytest.skip(reason)
    BINARY.parent.mkdir(exist_ok=True)
    started = time.monotonic()
    # One build at a time: .ci/run's background pre-build holds this lock (flock(1)) until it
    # is done, so this build then only relinks instead of compiling everything a second time.
    with open(BUILD_LOCK, "a") as lock:
        _wait_for(lock)
        if _fresh(BINARY):  # built from these very inputs (by .ci/run or another session)
            print(f"kubeharness up to date ({time.monotonic() - started:.1f}s)")
            return BINARY
        build = subprocess.run(
            ["go", "test", "-trimpath", "-c", "-o", str(BINARY), "."],
            cwd=HERE,
            env={**os.environ, "CGO_ENABLED": "0"},
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
            check=False,
        )
    if build.returncode != 0:
        pytest.fail(f"go test -c failed:\n{build.stdout}{build.stderr}", pytrace=False)
    print(f"kubeharness built in {time.monotonic() - started:.1f}s")
    return BINARY


def _wait_for(lock: IO[str]) -> None:
    """Take the build lock, saying so when another build holds it; fail after LOCK_WAIT."""
    deadline = time.monotonic() + LOCK_WAIT
    waited = False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not waited:
                print(f"waiting for the build that holds {BUILD_LOCK} (.ci/run's pre-build)")
                waited = True
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{BUILD_LOCK} still held after {LOCK_WAIT}s: .ci/run's Go pre-build "
                    "(its cluster-build.log and kubeharness-build.log say why)",
                    pytrace=False,
                )
            time.sleep(1)


def _fresh(binary: Path) -> bool:
    """Whether ``binary`` is newer than every input of its build (the harness's Go files,
    go.mod, go.sum). In CI two sessions ran ``go test -c`` after the background pre-build,
    and each took 190-300 s under load where a relink takes seconds."""
    try:
        built = binary.stat().st_mtime_ns
    except FileNotFoundError:
        return False
    inputs = [*HERE.glob("*.go"), HERE / "go.mod", HERE / "go.sum"]
    return all(path.stat().st_mtime_ns < built for path in inputs)


def _env(python: str, config: str, workdir: str, **settings: object) -> dict[str, str]:
    env = {"FLEXHUB_KH_PYTHON": python, "FLEXHUB_KH_CONFIG": config, "FLEXHUB_KH_WORKDIR": workdir}
    for key, value in settings.items():
        if value is None:
            continue
        text = value if isinstance(value, str) else json.dumps(value)
        env[f"FLEXHUB_KH_{key.upper()}"] = text
    return env


def _argv(binary: Path, run: str | None) -> list[str]:
    argv = [str(binary), "-test.v", "-test.count=1", f"-test.timeout={RUN_TIMEOUT - 30}s"]
    return argv + ([f"-test.run=^({run})$"] if run else [])


def assert_all_ran(output: str) -> None:
    """Every test of the committed list (required.txt) ran and passed: a harness run that
    skipped or lost one fails, though Go's exit code was 0."""
    __tracebackhide__ = True
    missing = runlist.problems(output, runlist.required())
    assert missing == [], f"{'; '.join(missing)}:\n{_summary(output)}"


def _summary(output: str) -> str:
    lines = output.splitlines()
    keep = [line for line in lines if line.lstrip().startswith(("---", "FAIL", "ok", "PASS"))]
    return "\n".join(keep)


def test_build_lock_wait_is_bounded_and_said(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A build lock held by another build is waited for (and said so), then a failure naming
    the pre-build's logs; once released it is taken."""
    path = tmp_path / ".lock"
    monkeypatch.setitem(globals(), "LOCK_WAIT", 1.5)
    monkeypatch.setitem(globals(), "BUILD_LOCK", path)
    with open(path, "a") as holder, open(path, "a") as lock:
        fcntl.flock(holder, fcntl.LOCK_EX)
        started = time.monotonic()
        with pytest.raises(pytest.fail.Exception, match=r"still held after 1.5s.*cluster-build"):
            _wait_for(lock)
        assert time.monotonic() - started >= 1.5
        assert f"waiting for the build that holds {path}" in capsys.readouterr().out
        fcntl.flock(holder, fcntl.LOCK_UN)
        _wait_for(lock)
        with open(path, "a") as other, pytest.raises(BlockingIOError):  # `lock` holds it now
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _requirements(gomod: str) -> dict[str, str]:
    """Every ``module version`` that ``gomod`` requires (single lines and blocks)."""
    found = re.findall(r"^\s*(?:require )?([\w.~/-]+) (v[\w.+-]+)(?: // indirect)?$", gomod, re.M)
    return dict(found)


def test_pinned_release_is_the_control_planes() -> None:
    """go.mod requires k8s.io/kubernetes at the control-plane tier's one pin, every module at
    the version the cluster's go.mod requires (so that the two builds share Go's build cache),
    and replaces every staging module at the matching v0.x (what pin.py writes)."""
    release = cluster_build.KUBERNETES_VERSION
    gomod = (HERE / "go.mod").read_text()
    cluster = _requirements((HERE.parent / "cluster" / "go.mod").read_text())
    harness = _requirements(gomod)
    assert harness["k8s.io/kubernetes"] == release
    assert {m: v for m, v in harness.items() if cluster.get(m) != v} == {}
    replaces = re.findall(r"^\s*(k8s\.io/\S+) => (k8s\.io/\S+) (\S+)$", gomod, re.M)
    assert len(replaces) >= 30, gomod
    staging = "v0." + release.split(".", 1)[1]
    assert [r for r in replaces if r[0] != r[1] or r[2] != staging] == []


# -- loopfile on this host --------------------------------------------------------------------


def loopfile_env(tmp_path: Path, workdir: Path) -> dict[str, str]:
    """The harness's kubelet root and plugin directory go to ``workdir``, which only root may
    write (``flexhub install`` refuses a plugin directory below /tmp); the rest to tmp_path."""
    config = tmp_path / "flexhub.toml"
    config.write_text(
        f'state_dir = "{tmp_path}/state"\nlog_dir = "{tmp_path}/log"\n'
        f'[loopfile]\nroot = "{tmp_path}/loopfiles"\n'
    )
    return _env(
        sys.executable,
        str(config),
        str(workdir),
        options={"backend": "loopfile", "file": "kh.img", "size": "1Gi"},
        inline_options={"backend": "loopfile", "file": "kh-inline.img", "size": "1Gi"},
        fstype="xfs",  # online ext4 growth needs CAP_SYS_RESOURCE, which this host lacks
        capacity=str(1024 * MiB),
        new_size=str(1536 * MiB),
        fsgroup_root="1",
    )


def run_host(binary: Path, env: Mapping[str, str], run: str | None = None) -> tuple[int, str]:
    result = subprocess.run(
        _argv(binary, run),
        env={**os.environ, **env},
        cwd="/",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    return result.returncode, result.stdout


def leftovers(*roots: Path) -> list[str]:
    """Mounts under the roots and loop devices backed by a file under them."""
    found = []
    prefixes = tuple(f"{root}/" for root in roots)
    for line in Path("/proc/self/mounts").read_text().splitlines():
        mountpoint = line.split()[1]
        if mountpoint.startswith(prefixes):
            found.append(mountpoint)
    loops = subprocess.run(["losetup", "-nO", "NAME,BACK-FILE"], capture_output=True, text=True)
    for line in loops.stdout.splitlines():
        name, _, backing = line.strip().partition(" ")
        if backing.strip().startswith(prefixes):
            found.append(name)
    return found


def scrub(*roots: Path) -> None:
    """Undo whatever a (deliberately) broken run left: unmount, detach the loop devices."""
    for item in reversed(leftovers(*roots)):
        if item.startswith("/dev/loop"):
            subprocess.run(["losetup", "-d", item], check=False)
        else:
            subprocess.run(["umount", "-l", item], check=False)


def test_loopfile(harness: Path, tmp_path: Path, trusted_dir: Path) -> None:
    """Every harness test (required.txt) runs and passes for loopfile (xfs) with the real
    kubelet code."""
    try:
        rc, output = run_host(harness, loopfile_env(tmp_path, trusted_dir))
        assert rc == 0, output
        assert_all_ran(output)
        assert leftovers(tmp_path, trusted_dir) == [], output
    finally:
        scrub(tmp_path, trusted_dir)
    print(_summary(output))


#: (broken driver, the harness test that must catch it, what its failure says)
BROKEN = [
    ("stderr", "TestLifecycle", "init: not a JSON object"),
    ("twojson", "TestLifecycle", "init: more than one JSON object"),
    ("nomount", "TestLifecycle", "answered Success but"),
    ("noro", "TestLifecycle", "read-only pod wrote to the volume"),
    ("nometrics", "TestLifecycle", "GetMetrics: "),
    ("noexpand", "TestLifecycle", "after NodeExpand"),
    ("nounmount", "TestLifecycle", "TearDown(pv-kh) of pod c"),
    ("notsupported", "TestLifecycle", "unmount: Not supported"),
    ("needsoptions", "TestLifecycle", "unmount needs options"),
    ("nofsgroup", "TestLifecycle", "volume root: gid"),
    ("unmountstrict", "TestUnmountNotMounted", "TearDown(pv-never) of pod gone"),
    ("plainfail", "TestFailureReply", "want the real code's parsed Failure"),
    ("badname", "TestDriverDirectory", 'FindPluginByName("k8s/flexhub")'),
]


@pytest.mark.parametrize(("mode", "test", "says"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_driver_is_caught(
    harness: Path, tmp_path: Path, trusted_dir: Path, mode: str, test: str, says: str
) -> None:
    """The check fails against a driver broken in exactly that way (loopfile on this host)."""
    env = {**loopfile_env(tmp_path, trusted_dir), "FLEXHUB_KH_BREAK": mode}
    try:
        rc, output = run_host(harness, env, run=test)
    finally:
        scrub(tmp_path, trusted_dir)
    assert rc != 0, f"the harness passed a driver broken as {mode!r}:\n{output}"
    assert says in output, f"broken as {mode!r}, but the failure is not the expected one:\n{output}"


# -- NFS and iSCSI in the VM rig ----------------------------------------------------------------

GUEST_ROOT = "/var/lib/flexhub-kubeharness"


def run_guest(vm: VM, binary: Path, env: Mapping[str, str]) -> tuple[int, str]:
    result = vm.run(
        _argv(binary, None),
        timeout=RUN_TIMEOUT,
        check=False,
        env_add=dict(env),
        merge=True,
        cwd="/",
    )
    return result.rc, result.output


def guest_config(vm: VM, name: str, extra: str = "") -> str:
    base = f"{GUEST_ROOT}/{name}"
    vm.run(["mkdir", "-p", base])
    config = f"{base}/flexhub.toml"
    vm.write_file(config, f'state_dir = "{base}/state"\nlog_dir = "{base}/log"\n{extra}')
    return config


def test_nfs(harness: Path, vm: VM) -> None:
    """Every harness test passes for NFS (v4.2, the kernel server) in the VM."""
    server = services.start_nfs_server(vm, size="256m")
    try:
        options = {"backend": "nfs", "server": server.host, "share": server.v4_path}
        env = _env(
            vm.flexhub_python,
            guest_config(vm, "nfs"),
            GUEST_ROOT,
            options=options,
            inline_options=options,
            capacity=str(256 * MiB),
            new_size="0",  # an NFS volume's size is the server's: expandfs is Success, no change
        )
        rc, output = run_guest(vm, harness, env)
        assert rc == 0, output
        assert_all_ran(output)
        print(_summary(output))
    finally:
        services.stop_nfs_server(vm)


def test_iscsi(harness: Path, vm: VM) -> None:
    """Every harness test passes for iSCSI (ext4, CHAP from the Secret) in the VM, with an
    online NodeExpand after the LUN grew on the target."""
    chap = services.Chap("kh-user", "Kh-Pw-9d2fQ7")
    target = services.iscsi_target(vm, lun_sizes=[128 * MiB, 128 * MiB], session_chap=chap)
    try:
        options = {
            "backend": "iscsi",
            "targetPortal": target.portal,
            "iqn": target.iqn,
            "chapAuthSession": "true",
        }
        grow = [
            ["truncate", "-s", "{size}", target.lun_paths[0]],
            [
                services.SYSTEM_PYTHON,
                services.LIO,
                "resize",
                json.dumps({"iqn": target.iqn, "lun": 0, "size": 0}).replace(
                    '"size": 0', '"size": {size}'
                ),
            ],
        ]
        env = _env(
            vm.flexhub_python,
            guest_config(vm, "iscsi", "[iscsi]\ndevice_timeout = 30\n"),
            GUEST_ROOT,
            options={**options, "lun": "0"},
            inline_options={**options, "lun": "1"},
            secret={
                "node.session.auth.username": chap.userid,
                "node.session.auth.password": chap.password,
            },
            fstype="ext4",
            capacity=str(128 * MiB),
            new_size=str(192 * MiB),
            grow=grow,
            fsgroup_root="1",
        )
        rc, output = run_guest(vm, harness, env)
        assert chap.password not in output, "a CHAP secret reached the output"
        assert rc == 0, output
        assert_all_ran(output)
        print(_summary(output))
    finally:
        services.reset_iscsi(vm)
        services.delete_iscsi_target(vm, target)
