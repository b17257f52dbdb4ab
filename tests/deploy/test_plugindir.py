"""Plugin-directory detection, one test per rule, on fake /proc trees and config files, and
through `flexhub install` against a real process that looks like kubelet."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from flexhub.plugindir import DEFAULT_PLUGIN_DIR, detect_plugin_dir
from tests.conftest import KUBELET_ENV, PYTHON


def fake_process(proc: Path, pid: int, *argv: str) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    proc, host = tmp_path / "proc", tmp_path / "host"
    proc.mkdir()
    host.mkdir()
    fake_process(proc, 1, "/sbin/init")
    fake_process(proc, 77, "/usr/bin/containerd")
    (proc / "self").mkdir()
    return proc, host


def test_explicit_flag_wins(roots: tuple[Path, Path]) -> None:
    proc, host = roots
    fake_process(proc, 500, "/usr/bin/kubelet", "--volume-plugin-dir=/from/kubelet")
    found = detect_plugin_dir("/given", proc_root=proc, host_root=host)
    assert (found.path, found.rule) == ("/given", "explicit")


@pytest.mark.parametrize(
    "argv",
    [
        ["/usr/bin/kubelet", "--v=2", "--volume-plugin-dir=/var/lib/kubelet/volumeplugins"],
        ["/usr/local/bin/kubelet", "--volume-plugin-dir", "/var/lib/kubelet/volumeplugins"],
        ["/hyperkube", "kubelet", "--volume-plugin-dir=/var/lib/kubelet/volumeplugins"],
    ],
)
def test_kubelet_command_line(roots: tuple[Path, Path], argv: list[str]) -> None:
    proc, host = roots
    fake_process(proc, 4242, *argv)
    found = detect_plugin_dir(proc_root=proc, host_root=host)
    assert found.path == "/var/lib/kubelet/volumeplugins"
    assert found.rule == "kubelet command line"
    assert "pid 4242" in found.detail


@pytest.mark.parametrize(
    "text",
    [
        "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n"
        "volumePluginDir: /etc/kubernetes/kubelet-plugins/volume/exec\n",
        '{"kind": "KubeletConfiguration", "volumePluginDir": '
        '"/etc/kubernetes/kubelet-plugins/volume/exec"}',
    ],
)
def test_kubelet_config_file(roots: tuple[Path, Path], text: str) -> None:
    proc, host = roots
    (host / "var/lib/kubelet").mkdir(parents=True)
    (host / "var/lib/kubelet/config.yaml").write_text(text)
    fake_process(proc, 900, "/usr/bin/kubelet", "--config=/var/lib/kubelet/config.yaml")
    found = detect_plugin_dir(proc_root=proc, host_root=host)
    assert found.path == "/etc/kubernetes/kubelet-plugins/volume/exec"
    assert found.rule == "kubelet config"


def test_config_without_the_key_falls_through(roots: tuple[Path, Path]) -> None:
    proc, host = roots
    (host / "etc").mkdir()
    (host / "etc/kubelet.yaml").write_text("kind: KubeletConfiguration\nmaxPods: 10\n")
    (host / "etc/os-release").write_text('NAME="Flatcar"\nID=flatcar\n')
    fake_process(proc, 900, "/usr/bin/kubelet", "--config", "/etc/kubelet.yaml")
    found = detect_plugin_dir(proc_root=proc, host_root=host)
    assert (found.path, found.rule) == ("/var/lib/kubelet/volumeplugins", "distribution default")


@pytest.mark.parametrize(
    ("distribution", "expected"),
    [
        ("cos", "/home/kubernetes/flexvolume"),
        ("rhcos", "/etc/kubernetes/kubelet-plugins/volume/exec"),
        ("debian", DEFAULT_PLUGIN_DIR),
    ],
)
def test_distribution_defaults(roots: tuple[Path, Path], distribution: str, expected: str) -> None:
    proc, host = roots
    (host / "etc").mkdir()
    (host / "etc/os-release").write_text(f'ID="{distribution}"\n')
    found = detect_plugin_dir(proc_root=proc, host_root=host)
    assert found.path == expected
    assert found.rule == (
        "upstream default" if expected == DEFAULT_PLUGIN_DIR else "distribution default"
    )


def test_install_without_plugin_dir_follows_the_running_kubelet(tmp_path: Path) -> None:
    plugins = tmp_path / "volumeplugins"
    # a real process whose command line reads like kubelet's
    fake = subprocess.Popen(
        ["kubelet", "-c", "sleep 60; :", "kubelet", f"--volume-plugin-dir={plugins}"],
        executable="/bin/bash",
    )
    try:
        for _ in range(200):
            if Path(f"/proc/{fake.pid}/cmdline").read_bytes().startswith(b"kubelet\0"):
                break
            time.sleep(0.05)
        else:  # never install then: it would fall back to the real default plugin directory
            raise AssertionError("the fake kubelet never showed its command line")
        proc = subprocess.run(
            [PYTHON, "-m", "flexhub", "install", "--config", str(tmp_path / "none.toml")],
            env=dict(KUBELET_ENV),
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        fake.kill()
        fake.wait()
    assert proc.returncode == 0, proc.stderr
    assert f"plugin directory: {plugins} (kubelet command line: pid {fake.pid}" in proc.stdout
    assert (plugins / "k8s~flexhub" / "flexhub").is_file()
