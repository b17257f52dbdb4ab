"""Install the running relocatable runtime onto a node and point kubelet's driver at it.

What the DaemonSet's entrypoint (``flexhub daemonset``, whose ``--runtime-dir`` names where
runtimes live on the host) does, with every host path under ``host_root`` (the hostPath mount
of ``/``):

1. copy this runtime to ``<runtime_dir>/<name>`` (a new name per build: a dot-named copy,
   then a rename, so a half-copied runtime is never used);
2. write the shim into the detected plugin directory (dot-file, rename): calls that start
   from now on use the new runtime, calls already running keep the one they started with;
   the directory must be root's alone (:mod:`flexhub.admin.plugindir`, :mod:`flexhub.admin.trust`);
3. run the shim's ``init`` as kubelet would (inside the host's root), once the shim and the
   interpreter it starts are checked to be root's alone, and fail if kubelet could not parse
   it; then, with ``--config-from`` (checked before step 1), write the node config to the
   host (:func:`place_config`), and record the plugin directory in
   ``<state_dir>/installed-<vendor~name>.json``, which ``doctor`` probes;
4. remove runtimes older than the previous one (the newest other), unless a process still
   maps a file of them.

Nothing is ever removed when the DaemonSet is deleted: kubelet needs the driver to unmount
volumes that are still mounted, so uninstalling is an explicit ``flexhub uninstall``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flexhub import DRIVER_NAME
from flexhub.admin.install import RUNTIME_MARKER, current_runtime, install, read_marker
from flexhub.admin.plugindir import Detection, detect_plugin_dir, write_record
from flexhub.admin.trust import trusted_path
from flexhub.config import DEFAULT_CONFIG_PATH, load_config, parse_config
from flexhub.errors import FlexhubError, UntrustedPath

__all__ = [
    "DEFAULT_RUNTIME_DIR",
    "Deployment",
    "check_config",
    "deploy",
    "place_config",
    "prune_runtimes",
]

DEFAULT_RUNTIME_DIR = "/var/lib/flexhub/runtime"


@dataclass(frozen=True)
class Deployment:
    """What :func:`deploy` did (host paths)."""

    runtime: str
    driver: str
    plugin_dir: Detection
    removed: tuple[str, ...]


def _host(host_root: Path, path: str) -> Path:
    return host_root / path.lstrip("/")


def copy_runtime(source: Path, host_root: Path, runtime_dir: str) -> str:
    """Copy ``source`` to ``<runtime_dir>/<its name>`` on the host; return the host path."""
    name = read_marker(source)["name"]
    target_dir = _host(host_root, runtime_dir)
    for directory in (*reversed(target_dir.relative_to(host_root).parents), target_dir):
        if str(directory) != ".":  # new directories are root's alone, like state_dir
            (host_root / directory).mkdir(mode=0o700, exist_ok=True)
    final = target_dir / name
    if not (final / RUNTIME_MARKER).is_file():
        partial = target_dir / f".{name}.{os.getpid()}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(source, partial, symlinks=True)
        if final.exists():  # a copy without its marker: never complete
            shutil.rmtree(final)
        partial.rename(final)
    os.utime(final)  # install order is mtime order: the previous version is the newest other
    return f"{runtime_dir.rstrip('/')}/{name}"


def check_config(source: Path) -> bytes:
    """The bytes of the node config ``source`` (the chart's ConfigMap, mounted in the pod),
    once they are a config flexhub accepts.

    :raises FlexhubError: ``source`` cannot be read or is not a valid node config.
    """
    try:
        text = source.read_bytes()
    except OSError as exc:
        raise FlexhubError(f"cannot read the node config {source}: {exc.strerror}") from None
    parse_config(text, source)  # one line naming what is wrong
    return text


def place_config(host_root: Path, source: Path | bytes, host_path: str) -> None:
    """Write the node config ``source`` (a file, or its bytes from :func:`check_config`) to
    ``host_path`` on the host, where the driver that kubelet runs reads it.

    It is checked first (a config flexhub would refuse fails here, before any driver uses
    it). ``host_path`` must be trusted (:mod:`flexhub.admin.trust`: it decides where the
    root driver keeps state; a host symlink is followed inside the host root); missing
    directories are made 0755. The bytes are written whole beside the final name, read back
    and compared, then renamed over it, root's and 0644, and the directory synced: a driver
    call never reads half a file, and a write cut short (a full disk) leaves the old config
    and no partial file.

    :raises FlexhubError: ``source`` cannot be read or is not a valid node config,
        ``host_path`` is not absolute or cannot be written.
    :raises UntrustedPath: ``host_path`` or a directory above it is not root's alone.
    """
    if not host_path.startswith("/"):
        raise FlexhubError(f"--config {host_path!r} must be an absolute path on the host")
    text = source if isinstance(source, bytes) else check_config(source)
    try:
        resolved = trusted_path(host_path, host_root, missing_ok=True)
    except UntrustedPath as exc:
        raise UntrustedPath(f"refusing the node config path {host_path}: {exc.message}") from None
    final = _host(host_root, resolved)
    partial = final.with_name(f".{final.name}.{os.getpid()}.partial")
    try:
        missing = [d for d in final.parents if not os.path.lexists(d)]
        for directory in reversed(missing):  # 0755 whatever the umask, like install
            try:
                os.mkdir(directory, 0o700)
            except FileExistsError:
                continue  # made meanwhile, by root: its parent is trusted
            os.chmod(directory, 0o755)  # noqa: S103 - the driver, run as root, reads below
        _remove_partials(final)
        _write_whole(partial, text)
        os.rename(partial, final)
        dir_fd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise FlexhubError(
            f"cannot write the node config {host_path}: {exc.strerror or exc}"
        ) from None


def _remove_partials(final: Path) -> None:
    """Remove what a killed place_config left beside ``final`` (``.<name>.<pid>.partial``:
    the directory is root's alone, so only flexhub made them)."""
    prefix, suffix = f".{final.name}.", ".partial"
    for entry in os.listdir(final.parent):
        middle = entry[len(prefix) : -len(suffix)]
        if entry.startswith(prefix) and entry.endswith(suffix) and middle.isdigit():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(final.parent / entry)


def _write_whole(path: Path, text: bytes) -> None:
    """Create ``path`` (root's, 0644) holding exactly ``text``, on disk.

    :raises OSError: it could not, including a short write or a read-back that differs.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        view = memoryview(text)
        while view:
            written = os.write(fd, view)
            if written <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view = view[written:]
        os.fsync(fd)
        back = bytearray()
        while chunk := os.pread(fd, 65536, len(back)):
            back += chunk
        if bytes(back) != text:
            raise OSError(errno.EIO, "what was written reads back different")
    finally:
        os.close(fd)


def _in_use(directory: Path, proc_root: Path) -> bool:
    """Whether a process maps a file under ``directory`` (as seen through ``proc_root``)."""
    needle = str(directory).rstrip("/") + "/"
    for pid in os.listdir(proc_root):
        if not pid.isdigit():
            continue
        try:
            maps = (proc_root / pid / "maps").read_text("utf-8", errors="replace")
        except OSError:
            continue
        if needle in maps:
            return True
    return False


def prune_runtimes(
    host_root: Path, runtime_dir: str, current: str, proc_root: Path = Path("/proc")
) -> tuple[str, ...]:
    """Remove old runtimes under ``runtime_dir``: all but ``current`` and the newest other
    one (the previous version), and none that a process still maps."""
    base = _host(host_root, runtime_dir)
    others = sorted(
        (e for e in (base.iterdir() if base.is_dir() else ()) if e.is_dir() and e.name != current),
        key=lambda e: e.stat().st_mtime,
    )
    removed = []
    for entry in others[:-1]:
        if entry.name.startswith("."):
            continue
        host_path = f"{runtime_dir.rstrip('/')}/{entry.name}"
        if _in_use(Path(host_path), proc_root):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(host_path)
    return tuple(removed)


def run_in_host(
    host_root: Path, argv: list[str], timeout: float = 60, stdin_data: bytes | None = None
) -> tuple[int, bytes]:
    """Run ``argv`` the way kubelet runs a driver (bare environment, stdin /dev/null, stderr
    merged, cwd /), inside the host's root; return its exit status and output. With
    ``stdin_data``, stdin is a pipe holding those bytes instead (never a command line).

    For the host root ``/`` no Python code runs between fork and exec (``cwd`` alone): with
    gRPC loaded in this process (the CSI plugin, a test session), a ``preexec_fn`` let gRPC's
    fork handlers write ``Epoll1Poller ... epoll_wait error`` into about 1 child's output in 16
    (CI, 2026-12-05). Another host root (the DaemonSet's container, made absolute from this
    process's directory) is entered by a ``preexec_fn`` chroot: that process loads no gRPC,
    and a second interpreter cannot stand in (the node runtime's Python starts only through its
    own loader).

    :raises OSError: it could not start; :raises subprocess.TimeoutExpired: it hung.
    """
    root = str(host_root.absolute())  # as the caller's checks saw it, not from cwd /
    if root == "/":
        return _run(argv, timeout, stdin_data)

    def enter() -> None:
        os.chroot(root)
        os.chdir("/")

    return _run(argv, timeout, stdin_data, enter)


def _run(
    argv: list[str],
    timeout: float,
    stdin_data: bytes | None,
    preexec: Callable[[], None] | None = None,
) -> tuple[int, bytes]:
    from flexhub.admin.harness import KUBELET_ENV

    proc = subprocess.run(
        argv,
        stdin=None if stdin_data is not None else subprocess.DEVNULL,
        input=stdin_data,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(KUBELET_ENV),
        cwd="/",
        timeout=timeout,
        check=False,
        preexec_fn=preexec,
    )
    return proc.returncode, proc.stdout


def verify(host_root: Path, driver: str) -> None:
    """Run ``<driver> init`` as kubelet would, inside the host's root.

    :raises UntrustedPath: a user other than root may have written the driver or what it runs.
    :raises FlexhubError: the reply is not a Success that kubelet could parse.
    """
    from flexhub.admin.harness import ReplyError, parse_reply
    from flexhub.admin.install import check_runnable

    check_runnable(driver, host_root)
    code, output = run_in_host(host_root, [driver, "init"])
    try:
        reply = parse_reply(output)
    except ReplyError as exc:
        raise FlexhubError(
            f"the installed driver's init is not what kubelet parses: {exc}"
        ) from None
    if reply.get("status") != "Success" or code != 0:
        raise FlexhubError(f"the installed driver's init failed: {reply}")


def deploy(
    host_root: Path = Path("/"),
    plugin_dir: str | None = None,
    config: str | None = None,
    runtime_dir: str = DEFAULT_RUNTIME_DIR,
    driver: str = DRIVER_NAME,
    proc_root: Path = Path("/proc"),
    config_from: Path | None = None,
) -> Deployment:
    """Install this runtime and the driver onto the host; see the module docstring.

    With ``config_from``, that file is checked first and written to ``config`` on the host
    (:func:`place_config`) only once the new driver answered ``init`` (which reads none of
    the config's tables): a deploy that fails leaves the host's config to the driver that
    reads it.
    """
    source = current_runtime()
    if source is None:
        raise FlexhubError("not running from a flexhub runtime (deploy/build_runtime.py)")
    new_config = None
    if config_from is not None:
        if not config:
            raise FlexhubError("--config-from needs --config (where the host keeps it)")
        if not config.startswith("/"):
            raise FlexhubError(f"--config {config!r} must be an absolute path on the host")
        new_config = check_config(config_from)
        try:  # refused before anything changes; checked again when it is written
            trusted_path(config, host_root, missing_ok=True)
        except UntrustedPath as exc:
            raise UntrustedPath(f"refusing the node config path {config}: {exc.message}") from None
    runtime = copy_runtime(source, host_root, runtime_dir)
    marker = read_marker(_host(host_root, runtime))
    found = detect_plugin_dir(plugin_dir, proc_root=proc_root, host_root=host_root)
    from flexhub.admin.install import driver_dir_name

    dir_name, exe_name = driver_dir_name(driver)
    on_host = trusted_path(found.path, host_root, missing_ok=True)  # host-side symlinks
    install(
        _host(host_root, on_host),
        config=Path(config) if config else None,
        driver=driver,
        runtime=runtime,
        marker=marker,
    )
    verify(host_root, f"{found.path.rstrip('/')}/{dir_name}/{exe_name}")
    if new_config is not None and config:
        place_config(host_root, new_config, config)
    node_config = load_config(_host(host_root, config or str(DEFAULT_CONFIG_PATH)))
    write_record(_host(host_root, str(node_config.state_dir)), driver, found)
    removed = prune_runtimes(host_root, runtime_dir, Path(runtime).name, proc_root)
    return Deployment(runtime, f"{found.path}/{dir_name}/{exe_name}", found, removed)


def serve_forever(interval: float = 3600.0) -> None:  # pragma: no cover - the pod's main loop
    """Stay up (the DaemonSet's pod) until SIGTERM; the liveness probe runs ``doctor``."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        time.sleep(interval)
