"""Find the directory kubelet loads FlexVolume drivers from (``--volume-plugin-dir``).

Distributions differ and a driver installed anywhere else is silently never found, so
``flexhub install`` and ``flexhub doctor`` ask, in this order:

1. an explicit ``--plugin-dir``;
2. the running kubelet's command line (``--volume-plugin-dir``), from ``/proc/*/cmdline``;
3. the kubelet config file its ``--config`` names (``volumePluginDir``);
4. the distribution's default (``/etc/os-release``), else the upstream default.

Every path is a host path. Run inside a container (the DaemonSet), pass ``host_root`` (where
the host's ``/`` is mounted) and a ``proc_root`` that shows the host's processes
(``hostPID: true``); the answer is still the host's path, which is what the caller turns
into ``host_root/<path>`` to write there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_PLUGIN_DIR", "DISTRIBUTION_DIRS", "Detection", "detect_plugin_dir"]

DEFAULT_PLUGIN_DIR = "/usr/libexec/kubernetes/kubelet-plugins/volume/exec"

#: ``ID`` of ``/etc/os-release`` → the plugin directory that distribution's kubelet uses.
DISTRIBUTION_DIRS: dict[str, str] = {
    "cos": "/home/kubernetes/flexvolume",  # GKE's Container-Optimized OS
    "flatcar": "/var/lib/kubelet/volumeplugins",  # kops, Typhoon, Rancher on Flatcar
    "fedora-coreos": "/var/lib/kubelet/volumeplugins",  # Typhoon
    "rhcos": "/etc/kubernetes/kubelet-plugins/volume/exec",  # OpenShift 4
    "k3os": "/var/lib/kubelet/volumeplugins",  # read-only /usr
}

_KUBELET_NAMES = ("kubelet", "hyperkube")
_FLAG = "--volume-plugin-dir"


@dataclass(frozen=True)
class Detection:
    """Where the driver goes and which rule decided it."""

    path: str
    rule: str
    detail: str

    def describe(self) -> str:
        return f"{self.path} ({self.rule}: {self.detail})"


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``--flag=value`` or ``--flag value`` (the last one wins, like kubelet)."""
    value = None
    for index, arg in enumerate(argv):
        if arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
        elif arg == flag and index + 1 < len(argv):
            value = argv[index + 1]
    return value


def kubelet_command_lines(proc_root: Path) -> list[tuple[int, list[str]]]:
    """``(pid, argv)`` of every process that looks like kubelet, by pid."""
    found = []
    try:
        names = os.listdir(proc_root)
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            raw = (proc_root / name / "cmdline").read_bytes()
        except OSError:
            continue
        argv = [a.decode("utf-8", "surrogateescape") for a in raw.split(b"\0") if a]
        if not argv:
            continue
        program = os.path.basename(argv[0])
        if program == "kubelet" or (program in _KUBELET_NAMES and "kubelet" in argv[1:2]):
            found.append((int(name), argv))
    return sorted(found)


def _config_value(text: str) -> str | None:
    """``volumePluginDir`` of a KubeletConfiguration in YAML or JSON."""
    try:
        data = json.loads(text)
    except ValueError:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            return None
    if isinstance(data, dict):
        value = data.get("volumePluginDir")
        if isinstance(value, str) and value:
            return value
    return None


def _on_host(host_root: Path, path: str) -> Path:
    return host_root / path.lstrip("/")


def _os_release_id(host_root: Path) -> str:
    for candidate in ("etc/os-release", "usr/lib/os-release"):
        try:
            text = (host_root / candidate).read_text("utf-8", errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("ID="):
                return line[3:].strip().strip("\"'")
    return ""


def detect_plugin_dir(
    explicit: str | None = None,
    *,
    proc_root: Path = Path("/proc"),
    host_root: Path = Path("/"),
) -> Detection:
    """Decide the plugin directory by the rules in the module docstring."""
    if explicit:
        return Detection(explicit, "explicit", "--plugin-dir")
    kubelets = kubelet_command_lines(proc_root)
    for pid, argv in kubelets:
        value = _flag_value(argv, _FLAG)
        if value:
            return Detection(value, "kubelet command line", f"pid {pid} {_FLAG}={value}")
    for pid, argv in kubelets:
        config = _flag_value(argv, "--config")
        if not config:
            continue
        try:
            text = _on_host(host_root, config).read_text("utf-8", errors="replace")
        except OSError:
            continue
        value = _config_value(text)
        if value:
            return Detection(value, "kubelet config", f"volumePluginDir in {config} (pid {pid})")
    distribution = _os_release_id(host_root)
    if distribution in DISTRIBUTION_DIRS:
        return Detection(
            DISTRIBUTION_DIRS[distribution], "distribution default", f"os-release ID={distribution}"
        )
    why = "no running kubelet found" if not kubelets else "kubelet sets no plugin directory"
    return Detection(DEFAULT_PLUGIN_DIR, "upstream default", why)
