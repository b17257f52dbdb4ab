"""The relocatable runtime serves kubelet with every Python of the host hidden, loads no
library from outside itself, and `flexhub daemonset` installs and upgrades it atomically on a
host root (a real mount namespace with the host's /usr bind-mounted and its Pythons masked)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, needs_root

pytestmark = needs_root

LOOP_OPTIONS = {
    "backend": "loopfile",
    "file": "rt.img",
    "size": "64Mi",
    "kubernetes.io/fsType": "",
    "kubernetes.io/readwrite": "rw",
    "kubernetes.io/pvOrVolumeName": "pv",
    "kubernetes.io/pod.uid": "u1",
    "kubernetes.io/pod.name": "p",
    "kubernetes.io/pod.namespace": "default",
    "kubernetes.io/serviceAccount.name": "sa",
}


def host_pythons() -> list[str]:
    """Every place a Python of this machine lives (directories and executables)."""
    places = {sys.base_prefix, sys.prefix, "/usr/lib/python3", "/usr/local/lib/python3.11"}
    if "/.pyenv/" in sys.base_prefix:  # pyenv: its shims are on PATH too
        places.add(sys.base_prefix.split("/.pyenv/")[0] + "/.pyenv")
    places.update(str(p) for p in Path("/usr/lib").glob("python3*"))
    for directory in ("/usr/bin", "/usr/local/bin", "/bin", *os.environ["PATH"].split(":")):
        if directory:
            places.update(str(p) for p in Path(directory).glob("python*"))
    return sorted(p for p in places if os.path.exists(p) and not p.startswith("/tmp/"))


HIDE = "\n".join(
    f"if [ -d {p} ]; then mount -t tmpfs hidden {p}; "
    f"elif [ -e {p} ]; then mount --bind /dev/null {p}; fi"
    for p in host_pythons()
)


@pytest.fixture(scope="session")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runtime")
    proc = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "build_runtime.py"), str(out)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert (path / "flexhub-runtime.json").is_file()
    return path


def in_namespace(script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with bash in a private mount namespace where no host Python exists."""
    body = "set -eu\n" + HIDE + "\n" + textwrap.dedent(script)
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "bash", "-c", body],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.fixture
def node(tmp_path: Path, runtime: Path) -> Iterator[dict[str, Path]]:
    tree = {name: tmp_path / name for name in ("plugins", "state", "log", "loop", "kubelet")}
    config = tmp_path / "flexhub.toml"
    config.write_text(
        f'state_dir = "{tree["state"]}"\nlog_dir = "{tree["log"]}"\n'
        f'[loopfile]\nroot = "{tree["loop"]}"\n'
    )
    subprocess.run(
        [str(runtime / "bin" / "flexhub"), "install", "--plugin-dir", str(tree["plugins"]),
         "--config", str(config)],
        check=True, capture_output=True,
    )  # fmt: skip
    tree["driver"] = tree["plugins"] / "k8s~flexhub" / "flexhub"
    tree["target"] = tree["kubelet"] / "pods/u1/volumes/k8s~flexhub/pv"
    tree["target"].mkdir(parents=True)
    yield tree
    subprocess.run([str(tree["driver"]), "unmount", str(tree["target"])], capture_output=True)


def test_the_shim_runs_the_runtime_through_its_own_loader(
    node: dict[str, Path], runtime: Path
) -> None:
    text = node["driver"].read_text()
    assert f"exec {runtime}/lib/ld-linux-x86-64.so.2 --library-path {runtime}/lib " in text
    assert "LD_LIBRARY_PATH" not in text


def test_init_mount_unmount_with_every_host_python_hidden(node: dict[str, Path]) -> None:
    driver, target = node["driver"], node["target"]
    result = in_namespace(
        f"""
        for p in $(compgen -c python | sort -u) {sys.executable}; do
            if "$p" -c pass 2>/dev/null; then echo "python runs: $p"; exit 1; fi
        done
        K="env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8"
        echo "init $($K {driver} init)"
        echo "mount $($K {driver} mount {target} '{json.dumps(LOOP_OPTIONS)}')"
        echo "fs $(findmnt -n -o FSTYPE {target})"
        echo data > {target}/file
        echo "unmount $($K {driver} unmount {target})"
        echo "after $(findmnt -n {target} || echo none)"
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert json.loads(lines["init"])["capabilities"]["attach"] is False
    assert json.loads(lines["mount"]) == {"status": "Success"}
    assert lines["fs"] == "ext4"
    assert json.loads(lines["unmount"]) == {"status": "Success"}
    assert lines["after"] == "none"


def test_the_running_driver_maps_no_library_of_the_node(
    node: dict[str, Path], runtime: Path, tmp_path: Path
) -> None:
    driver, target = node["driver"], node["target"]
    real = shutil.which("losetup")
    assert real is not None
    saved = tmp_path / "losetup.real"
    shutil.copy2(real, saved)
    slow = tmp_path / "losetup.slow"
    slow.write_text(f'#!/bin/bash\nenv > {tmp_path}/child-env\nsleep 2\nexec {saved} "$@"\n')
    slow.chmod(0o755)
    result = in_namespace(
        f"""
        mount --bind {slow} {real}
        env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin {driver} mount {target} '{json.dumps(LOOP_OPTIONS)}' > {tmp_path}/reply &
        pid=$!
        sleep 1.2
        cat /proc/$pid/maps > {tmp_path}/maps
        wait $pid
        env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin {driver} unmount {target} > /dev/null
        """
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "reply").read_text()) == {"status": "Success"}
    libraries = {
        line.split()[-1]
        for line in (tmp_path / "maps").read_text().splitlines()
        if ".so" in line.split()[-1]
    }
    assert any("libpython" in lib for lib in libraries)
    outside = sorted(lib for lib in libraries if not lib.startswith(f"{runtime}/"))
    assert outside == []
    child_env = (tmp_path / "child-env").read_text()
    assert "LD_LIBRARY_PATH" not in child_env
    assert "PATH=/usr/sbin:/usr/bin:/sbin:/bin" in child_env.splitlines()


def fake_host(tmp_path: Path) -> tuple[Path, str]:
    """A host root for `flexhub daemonset`: the real /usr (bind-mounted in the script),
    merged-/usr links, its own /etc, /var and plugin directory."""
    host = tmp_path / "host"
    for directory in ("usr", "dev", "proc", "sys", "tmp", "etc/flexhub", "var/lib", "plugins"):
        (host / directory).mkdir(parents=True)
    for link in ("bin", "sbin", "lib", "lib64"):
        (host / link).symlink_to(f"usr/{link}")
    (host / "etc/os-release").write_text("ID=debian\n")
    (host / "etc/flexhub/flexhub.toml").write_text(
        'state_dir = "/var/lib/flexhub"\nlog_dir = "/var/log/flexhub"\n'
    )
    mounts = f"""
        mount --bind /usr {host}/usr
        mount --bind /dev {host}/dev
        mount --bind /proc {host}/proc
        mount --bind /sys {host}/sys
        {HIDE.replace(" /usr/", f" {host}/usr/")}
    """
    return host, mounts


def daemonset(runtime: Path, host: Path) -> str:
    return (
        f"{runtime}/bin/flexhub daemonset --once --host-root {host} --plugin-dir /plugins "
        "--config /etc/flexhub/flexhub.toml"
    )


def test_daemonset_installs_and_upgrades_atomically(runtime: Path, tmp_path: Path) -> None:
    host, mounts = fake_host(tmp_path)
    second = tmp_path / "second"
    shutil.copytree(runtime, second, symlinks=True)
    marker = json.loads((second / "flexhub-runtime.json").read_text())
    marker["name"] = marker["name"] + "-next"
    (second / "flexhub-runtime.json").write_text(json.dumps(marker))
    third = tmp_path / "third"
    shutil.copytree(runtime, third, symlinks=True)
    marker["name"] = marker["name"] + "-last"
    (third / "flexhub-runtime.json").write_text(json.dumps(marker))
    runtimes = host / "var/lib/flexhub/runtime"
    shim = host / "plugins/k8s~flexhub/flexhub"
    result = in_namespace(
        f"""
        {mounts}
        echo "first $({daemonset(runtime, host)})"
        echo "init1 $(chroot {host} env -i PATH=/usr/bin:/bin /plugins/k8s~flexhub/flexhub init)"
        echo "second $({daemonset(second, host)})"
        # a call still running on the first runtime keeps it
        {runtimes}/{runtime.name}/bin/flexhub version > /dev/null
        {runtimes}/{runtime.name}/lib/ld-linux-x86-64.so.2 --library-path {runtimes}/{runtime.name}/lib {runtimes}/{runtime.name}/bin/python3.11 -I -c 'import time; time.sleep(20)' &
        busy=$!
        sleep 0.5
        echo "third $({daemonset(third, host)})"
        kill $busy
        wait $busy || true
        echo "fourth $({daemonset(third, host)})"
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    first, second_run = json.loads(lines["first"]), json.loads(lines["second"])
    third_run, fourth = json.loads(lines["third"]), json.loads(lines["fourth"])
    assert first["runtime"] == f"/var/lib/flexhub/runtime/{runtime.name}"
    assert first["driver"] == "/plugins/k8s~flexhub/flexhub"
    assert "explicit" in first["plugin_dir"]
    assert json.loads(lines["init1"])["status"] == "Success"
    assert second_run["runtime"].endswith("-next") and second_run["removed"] == []
    # the oldest runtime was in use: kept; once free, removed; the previous one always stays
    assert third_run["removed"] == []
    assert fourth["removed"] == [f"/var/lib/flexhub/runtime/{runtime.name}"], (third_run, fourth)
    assert sorted(p.name for p in runtimes.iterdir()) == sorted(
        [marker["name"], marker["name"].removesuffix("-last")]
    )
    text = shim.read_text()
    assert f"/var/lib/flexhub/runtime/{marker['name']}/bin/python3.11" in text
    assert "FLEXHUB_CONFIG=/etc/flexhub/flexhub.toml" in text
    assert [p.name for p in shim.parent.iterdir()] == ["flexhub"]  # no temporary left
