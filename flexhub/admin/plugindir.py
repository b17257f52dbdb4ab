"""Find the directory kubelet loads FlexVolume drivers from (``--volume-plugin-dir``), and
remember where the driver was installed.

Distributions differ and a driver installed anywhere else is silently never found, so
``flexhub install`` and the DaemonSet ask, in this order:

1. an explicit ``--plugin-dir``;
2. the running kubelet's command line (``--volume-plugin-dir``), from ``/proc/*/cmdline``;
3. the kubelet config file its ``--config`` names (``volumePluginDir``);
4. the distribution's default (``/etc/os-release``), else the upstream default.

Whatever the rule, the answer is a directory kubelet will run a driver from as root, so it is
trusted only as far as :mod:`flexhub.admin.trust` allows:

* **only the real kubelet counts.** A process is kubelet when its command line reads like
  kubelet's (``kubelet ...`` or ``hyperkube kubelet ...``) *and* it runs as root (every uid of
  ``/proc/<pid>/status`` is 0) *and* it runs on the host: its root (``/proc/<pid>/root``,
  device and inode) and its mount namespace (``/proc/<pid>/ns/mnt``) are those of pid 1 of
  ``proc_root`` (the host's init) — a root process in any container, whose image is root's
  too, is not kubelet, and a containerized kubelet needs an explicit ``--plugin-dir`` —
  *and* its executable, resolved through ``/proc/<pid>/exe`` inside that root, is a regular
  file called ``kubelet`` or ``hyperkube`` that is trusted (root's, nothing on the way
  writable by others) and is the very file the process runs (same device and inode).
  Any other process is ignored and named in the answer's detail: anybody can start a
  process whose ``argv[0]`` is ``kubelet``. When pid 1 cannot be read, no process is kubelet;
* the **config file** of the real kubelet is read in the same root as its executable, and
  only when trusted; one that is not is a refusal (kubelet reads it too, so it cannot be
  skipped);
* the **directory** itself, and every directory above it, must be trusted; else detection
  refuses, with one line naming the offending path. A missing tail is fine: root creates it.

``flexhub install`` and the DaemonSet record the directory they installed into in
``<state_dir>/installed-<vendor~name>.json`` (root's, 0644); ``doctor`` probes that directory,
never a fresh guess, and refuses a record that is not root's and 0644 or stricter.

Every path is a host path. Run inside a container (the DaemonSet), pass ``host_root`` (where
the host's ``/`` is mounted) and a ``proc_root`` that shows the host's processes
(``hostPID: true``); the answer is still the host's path, which is what the caller turns
into ``host_root/<path>`` to write there.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from flexhub import DRIVER_NAME
from flexhub.admin.trust import check_owner_and_mode, trusted_path
from flexhub.errors import StateError, UntrustedPath, UsageError

__all__ = [
    "DEFAULT_PLUGIN_DIR",
    "DISTRIBUTION_DIRS",
    "Detection",
    "detect_plugin_dir",
    "driver_dir_name",
    "kubelet_processes",
    "read_record",
    "record_path",
    "write_record",
]

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


def _looks_like_kubelet(argv: list[str]) -> bool:
    program = os.path.basename(argv[0])
    return program == "kubelet" or (program in _KUBELET_NAMES and "kubelet" in argv[1:2])


def _read_at(dir_fd: int, name: str) -> bytes:
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return _read_at_fd(fd)
    finally:
        os.close(fd)


#: A process's root (device, inode) and mount namespace (device, inode).
_Place = tuple[tuple[int, int], tuple[int, int]]


def _place(dir_fd: int) -> _Place:
    """Where the process whose ``/proc/<pid>`` is open as ``dir_fd`` lives.

    :raises OSError: it went away, or its root or namespace cannot be read.
    """
    root = os.stat("root", dir_fd=dir_fd)
    mnt = os.stat("ns/mnt", dir_fd=dir_fd)
    return (root.st_dev, root.st_ino), (mnt.st_dev, mnt.st_ino)


def _host_place(proc_root: Path) -> _Place | str:
    """The root and mount namespace of pid 1 of ``proc_root`` (the host's init), or why
    they cannot be read."""
    try:
        dir_fd = os.open(proc_root / "1", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return f"pid 1 cannot be read ({exc.strerror})"
    try:
        return _place(dir_fd)
    except OSError as exc:
        return f"pid 1's root and mount namespace cannot be read ({exc.strerror})"
    finally:
        os.close(dir_fd)


def _not_kubelet(dir_fd: int, argv: list[str], host: _Place | str) -> str | None:
    """Why the process (its ``/proc/<pid>`` open as ``dir_fd``) is not the real kubelet, or
    ``None`` when it is. It must live where pid 1 does (``host``); its executable is checked
    inside its own root (``/proc/<pid>/root``, through ``dir_fd``: the same process), which
    is then the host's ``/``.

    :raises OSError: the process went away meanwhile.
    """
    root = Path(f"/proc/self/fd/{dir_fd}/root")
    status = _read_at(dir_fd, "status").decode("utf-8", "replace")
    uids = next((line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")), [])
    strangers = [u for u in uids if u != "0"]
    if not uids or strangers:
        return f"runs as uid {strangers[0] if strangers else '?'}"
    if isinstance(host, str):
        return f"{host}, so no process can be told to run on the host: pass --plugin-dir"
    if _place(dir_fd) != host:
        return (
            "runs in another root or mount namespace than pid 1 (a container; "
            "a containerized kubelet needs --plugin-dir)"
        )
    link = os.readlink("exe", dir_fd=dir_fd)
    if not link.startswith("/") or link.endswith(" (deleted)"):
        return f"runs {link}, which is gone"
    try:
        resolved = trusted_path(link, root)
    except UntrustedPath as exc:
        return exc.message
    runs = os.stat("exe", dir_fd=dir_fd)  # the file the process runs, in any namespace
    try:
        seen = os.stat(_on_host(root, resolved))
    except OSError:
        return f"runs {link}, which its root does not show"
    if not stat.S_ISREG(seen.st_mode) or (seen.st_dev, seen.st_ino) != (runs.st_dev, runs.st_ino):
        return f"runs a file that is not {resolved}"
    name = os.path.basename(resolved)
    if name not in _KUBELET_NAMES or (name == "hyperkube" and argv[1:2] != ["kubelet"]):
        return f"runs {resolved}, not kubelet"
    return None


@dataclass(frozen=True)
class _Kubelet:
    """A real kubelet, its ``/proc/<pid>`` held open as ``dir_fd`` (the same process
    throughout), until the caller closes it."""

    pid: int
    argv: list[str]
    dir_fd: int

    @property
    def root(self) -> Path:
        """Its root (the host's ``/``), as this process reaches it."""
        return Path(f"/proc/self/fd/{self.dir_fd}/root")


def _scan(proc_root: Path, keep: contextlib.ExitStack) -> tuple[list[_Kubelet], list[str]]:
    """The real kubelets (their directories closed by ``keep``) and, for each other process
    whose command line reads like kubelet's, ``"pid N: why not"``."""
    found: list[_Kubelet] = []
    ignored: list[str] = []
    try:
        names = sorted((n for n in os.listdir(proc_root) if n.isdigit()), key=int)
    except OSError:
        return [], []
    host: _Place | str | None = None
    for name in names:
        try:  # every file is read through this one directory: the same process throughout
            dir_fd = os.open(proc_root / name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        kept = False
        try:
            raw = _read_at(dir_fd, "cmdline")
            argv = [a.decode("utf-8", "surrogateescape") for a in raw.split(b"\0") if a]
            if not argv or not _looks_like_kubelet(argv):
                continue
            if host is None:
                host = _host_place(proc_root)
            reason = _not_kubelet(dir_fd, argv, host)
            if reason is None:
                found.append(_Kubelet(int(name), argv, dir_fd))
                keep.callback(os.close, dir_fd)
                kept = True
            else:
                ignored.append(f"pid {name}: {reason}")
        except OSError:
            continue  # it ended
        finally:
            if not kept:
                os.close(dir_fd)
    return found, ignored


def kubelet_processes(proc_root: Path) -> tuple[list[tuple[int, list[str]]], list[str]]:
    """``(pid, argv)`` of every real kubelet (module docstring), by pid; and, for each other
    process whose command line reads like kubelet's, ``"pid N: why not"``."""
    with contextlib.ExitStack() as keep:
        found, ignored = _scan(proc_root, keep)
        return [(k.pid, k.argv) for k in found], ignored


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


def _kubelet_config(pid: int, config: str, root: Path) -> str | None:
    """``volumePluginDir`` of the real kubelet's config file, when it has one, read in
    ``root``: the kubelet's own, where its executable was checked.

    :raises UntrustedPath: the file (or a directory above it) is not root's alone.
    """
    if config.startswith("/") and not os.path.lexists(_on_host(root, config)):
        return None  # kubelet cannot have read it either
    try:
        resolved = trusted_path(config, root)
    except UntrustedPath as exc:
        raise UntrustedPath(
            f"refusing kubelet's config file {config} (pid {pid}): {exc.message}"
        ) from None
    try:
        text = _on_host(root, resolved).read_text("utf-8", errors="replace")
    except OSError:
        return None
    return _config_value(text)


def _guess(explicit: str | None, proc_root: Path, host_root: Path) -> Detection:
    if explicit:
        return Detection(os.path.abspath(explicit), "explicit", "--plugin-dir")
    with contextlib.ExitStack() as keep:
        kubelets, ignored = _scan(proc_root, keep)
        for kubelet in kubelets:
            value = _flag_value(kubelet.argv, _FLAG)
            if value:
                detail = f"pid {kubelet.pid} {_FLAG}={value}"
                return Detection(value, "kubelet command line", detail)
        for kubelet in kubelets:
            config = _flag_value(kubelet.argv, "--config")
            value = _kubelet_config(kubelet.pid, config, kubelet.root) if config else None
            if value:
                detail = f"volumePluginDir in {config} (pid {kubelet.pid})"
                return Detection(value, "kubelet config", detail)
    not_kubelet = f" (not kubelet: {'; '.join(ignored[:3])})" if ignored else ""
    distribution = _os_release_id(host_root)
    if distribution in DISTRIBUTION_DIRS:
        return Detection(
            DISTRIBUTION_DIRS[distribution],
            "distribution default",
            f"os-release ID={distribution}{not_kubelet}",
        )
    why = "no running kubelet found" if not kubelets else "kubelet sets no plugin directory"
    return Detection(DEFAULT_PLUGIN_DIR, "upstream default", why + not_kubelet)


def detect_plugin_dir(
    explicit: str | None = None,
    *,
    proc_root: Path = Path("/proc"),
    host_root: Path = Path("/"),
) -> Detection:
    """Decide the plugin directory by the rules in the module docstring.

    :raises UntrustedPath: the directory, a directory above it or kubelet's config file is
        not root's alone (one line naming the offending path).
    """
    found = _guess(explicit, proc_root, host_root)
    try:
        trusted_path(found.path, host_root, missing_ok=True)
    except UntrustedPath as exc:
        raise UntrustedPath(
            f"refusing the plugin directory {found.describe()}: {exc.message}"
        ) from None
    return found


def driver_dir_name(driver: str) -> tuple[str, str]:
    """``vendor/name`` → (``vendor~name``, ``name``), checked like kubelet's IsQualifiedName:
    kubelet runs the driver ``vendor/name`` as ``<plugin dir>/vendor~name/name``."""
    import re

    match = re.fullmatch(
        r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?)/([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)", driver
    )
    if not match or len(match.group(3)) > 63:
        raise UsageError(f"driver name {driver!r} must look like vendor/name (e.g. {DRIVER_NAME})")
    return driver.replace("/", "~"), match.group(3)


# -- the install record ---------------------------------------------------------------------------


def record_path(state_dir: Path | str, driver: str) -> Path:
    """``<state_dir>/installed-<vendor~name>.json``."""
    return Path(state_dir) / f"installed-{driver_dir_name(driver)[0]}.json"


def write_record(state_dir: Path, driver: str, found: Detection) -> Path:
    """Record (atomically, root's, 0644) that ``driver`` was installed into ``found``.

    :param state_dir: the state directory as this process sees it (under the host root).
    """
    from flexhub.node.statedir import private_dir

    path = record_path(state_dir, driver)
    payload = json.dumps(
        {"driver": driver, "plugin_dir": found.path, "rule": found.rule, "detail": found.detail},
        sort_keys=True,
    ).encode("utf-8")
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        private_dir(state_dir)
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
        try:
            os.fchmod(fd, 0o644)
            os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise StateError(f"cannot record the install in {path}: {exc.strerror}") from None
    return path


def read_record(
    state_dir: Path | str, driver: str, host_root: Path = Path("/")
) -> Detection | None:
    """The plugin directory recorded at install (``None``: no record).

    :param state_dir: the state directory's host path.
    :raises UntrustedPath: the record, or a directory above it, is not root's alone, or its
        mode is not 0644 or stricter.
    :raises StateError: it is not an install record of ``driver``.
    """
    path = str(record_path(state_dir, driver))
    if not os.path.lexists(_on_host(host_root, path)):
        return None
    try:
        resolved = trusted_path(path, host_root)
        fd = os.open(_on_host(host_root, resolved), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except UntrustedPath as exc:
        raise UntrustedPath(f"refusing the install record {path}: {exc.message}") from None
    except OSError as exc:
        raise StateError(f"cannot read the install record {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        mode = stat.S_IMODE(info.st_mode)
        if not stat.S_ISREG(info.st_mode) or mode & ~0o644:
            raise UntrustedPath(
                f"refusing the install record {path}: mode {mode:04o}, not a 0644 or stricter file"
            )
        check_owner_and_mode(path, info)
        raw = _read_at_fd(fd)
    finally:
        os.close(fd)
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    value = data.get("plugin_dir") if isinstance(data, dict) else None
    if not isinstance(value, str) or not value.startswith("/") or data.get("driver") != driver:
        raise StateError(f"{path} is not an install record of {driver}")
    return Detection(value, "recorded at install", f"{path}, decided by {data.get('rule')}")


def _read_at_fd(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)
