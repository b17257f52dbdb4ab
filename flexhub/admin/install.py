"""Install the driver executable into a kubelet plugin directory, atomically.

The executable is a small POSIX shell script that runs *this* installation of flexhub with
absolute paths, so it works under kubelet's bare environment (``env -i``, cwd ``/``, no
``HOME``). It is written under a dot-name (kubelet's prober ignores dot-files), made
executable, then renamed into place, so kubelet never runs a half-written driver.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from flexhub import DRIVER_NAME
from flexhub.admin.plugindir import Detection, detect_plugin_dir, driver_dir_name, write_record
from flexhub.errors import FlexhubError, UsageError

__all__ = [
    "RUNTIME_MARKER",
    "check_runnable",
    "current_runtime",
    "driver_dir_name",  # re-exported from flexhub.admin.plugindir (kubelet's layout of it)
    "driver_path",
    "install",
    "install_on_node",
    "mounted_volumes",
    "render_shim",
    "shim_config",
    "shim_python",
    "uninstall",
]


_START = """try:
    from flexhub.__main__ import main
except BaseException as exc:
    import json
    reason = "%s: %s" % (type(exc).__name__, exc)
    print(json.dumps({"status": "Failure", "message": "flexhub cannot start: " + reason}))
    sys.exit(1)
sys.exit(main())"""
_BOOTSTRAP = "import sys\n" + _START

#: A relocatable runtime whose build found no ``.pth`` file in its ``site-packages`` (or
#: ``dist-packages``, where it was built from a distribution's interpreter whose ``site``
#: reads that, as Debian's does) and no ``sitecustomize`` says where that directory is (its
#: marker's ``site_packages``); its shim
#: then starts Python without :mod:`site` (``-S``) and puts that one directory on ``sys.path``
#: itself, which is all ``site`` would have done there (``-I`` leaves out the user's).
#: Measured 2026-12-07: ``init`` 12.1 -> 11.6 ms on the CI host, a bare start 481 -> 433 ms and
#: the kubelet path's imports 1.42 -> 1.34 s in the test rig's emulated guest (medians).
_SITE_PACKAGES = re.compile(r"lib/python3\.[0-9]+/(?:site|dist)-packages")


def _runtime_start(site_packages: str) -> str:
    """How the shim starts a runtime's Python whose ``site-packages`` is ``site_packages``
    (relative to the runtime, checked against :data:`_SITE_PACKAGES`).

    Only when ``sys.prefix`` is the runtime, which its marker at the top says: with its
    standard library incomplete (no ``lib/python3.X/os.py``), Python falls back to the prefix
    its interpreter was built for, Debian's ``/usr`` (the node's own), whose directories are
    not the runtime's to read; flexhub is then not found and the call fails closed."""
    path = (
        f'import os\nif os.path.isfile(sys.prefix + "/{RUNTIME_MARKER}"):\n'
        f'    sys.path.append(sys.prefix + "/{site_packages}")'
    )
    return f"-I -S -c 'import sys\n{path}\n{_START}'"


#: The file that marks a relocatable runtime (``deploy/build_runtime.py``), at its top.
RUNTIME_MARKER = "flexhub-runtime.json"


def read_marker(runtime: Path) -> dict[str, str]:
    """The description a runtime build writes at its top."""
    import json

    data = json.loads((runtime / RUNTIME_MARKER).read_text("utf-8"))
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise UsageError(f"{runtime / RUNTIME_MARKER} is not a flexhub runtime description")
    return data


def current_runtime() -> Path | None:
    """The relocatable runtime this interpreter belongs to, or ``None`` (a plain Python)."""
    root = Path(sys.executable).parent.parent
    return root if (root / RUNTIME_MARKER).is_file() else None


def runtime_command(runtime: str, marker: Mapping[str, str]) -> tuple[str, str]:
    """``(check, command)`` for the shim: the file that must exist and how to start Python.

    A relocatable runtime starts through its own dynamic loader with an explicit library
    path, so that no library of the node is loaded and the path does not reach the
    commands flexhub runs (an ``LD_LIBRARY_PATH`` would).
    """
    python = f"{runtime}/{marker['python']}"
    loader = f"{runtime}/{marker['loader']}"
    library = f"{runtime}/{marker['library_path']}"
    quoted = " ".join(shlex.quote(p) for p in (loader, "--library-path", library, python))
    return python, quoted


def shim_python(text: str) -> str:
    """The interpreter a shim written by :func:`render_shim` runs (``""``: not such a shim)."""
    for line in text.splitlines():
        if line.startswith("PY="):
            return shlex.split(line[3:])[0] if line[3:] else ""
    return ""


def check_runnable(driver: str, host_root: Path = Path("/")) -> None:
    """Check, before flexhub runs the installed driver (host path ``driver``), that nobody but
    root can have written it or what it runs: the driver and, for a flexhub shim, the
    interpreter it starts (:mod:`flexhub.admin.trust`).

    :raises UntrustedPath: naming the first path that is not root's alone.
    """
    from flexhub.admin.trust import trusted_path

    resolved = trusted_path(driver, host_root)
    try:
        text = (host_root / resolved.lstrip("/")).read_text("utf-8", errors="replace")
    except OSError:
        return  # it will not run either
    python = shim_python(text)
    if python:
        trusted_path(python, host_root, missing_ok=True)  # a missing one is not run


def shim_config(text: str) -> str | None:
    """The node config a shim written by :func:`render_shim` exports, or ``None`` (none: the
    driver reads ``FLEXHUB_CONFIG`` from kubelet's environment, or the default)."""
    for line in text.splitlines():
        if line.startswith("FLEXHUB_CONFIG="):
            words = shlex.split(line[len("FLEXHUB_CONFIG=") :])
            return words[0] if words else None
    return None


def render_shim(
    python: str,
    config: Path | str | None,
    runtime: str | None = None,
    marker: Mapping[str, str] | None = None,
) -> str:
    """The text of the driver executable.

    :param python: the interpreter to run, or, with ``runtime``, ignored.
    :param runtime: a relocatable runtime's directory (as the node sees it).
    """
    start = f"-I -c '{_BOOTSTRAP}'"
    if runtime is not None:
        if marker is None:
            marker = read_marker(Path(runtime))
        check, command = runtime_command(runtime, marker)
        if _SITE_PACKAGES.fullmatch(marker.get("site_packages", "")):
            start = _runtime_start(marker["site_packages"])
    else:
        check, command = python, '"$PY"'
    lines = [
        "#!/bin/sh",
        "# flexhub FlexVolume driver; written by `flexhub install`. Do not edit.",
        f"PY={shlex.quote(check)}",
        'if [ ! -x "$PY" ]; then',
        '  printf \'{"status":"Failure","message":"flexhub runtime missing: %s"}\\n\' "$PY"',
        "  exit 1",
        "fi",
    ]
    if config is not None:
        lines.append(f"FLEXHUB_CONFIG={shlex.quote(str(config))}")
        lines.append("export FLEXHUB_CONFIG")
    # Python, not the shell, starts flexhub, so that even a broken installation answers
    # kubelet with one JSON object instead of a traceback or nothing.
    lines.append(f'exec {command} {start} "$@" 2>/dev/null')
    return "\n".join(lines) + "\n"


def install(
    plugin_dir: Path,
    config: Path | None = None,
    driver: str = DRIVER_NAME,
    python: str | None = None,
    runtime: str | None = None,
    marker: Mapping[str, str] | None = None,
) -> Path:
    """Write ``plugin_dir/<vendor>~<name>/<name>`` and return its path.

    :param python: the interpreter the shim runs (default: this one).
    :param runtime: a relocatable runtime's directory as the node sees it (default: the
        runtime this interpreter belongs to, if any); then ``python`` is not used.
    :param marker: that runtime's description, when ``runtime`` is not readable here (a
        host path seen from a container).
    """
    dir_name, exe_name = driver_dir_name(driver)
    if not plugin_dir.is_absolute():
        plugin_dir = plugin_dir.resolve()
    if config is not None and runtime is None:
        config = config.resolve()
    if runtime is None and python is None:
        here = current_runtime()
        runtime = str(here) if here is not None else None
    driver_dir = plugin_dir / dir_name
    missing = [d for d in (driver_dir, *driver_dir.parents) if not os.path.lexists(d)]
    for directory in reversed(missing):  # 0755 at most, whatever the umask: kubelet runs here
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o755)
    target = driver_dir / exe_name
    tmp = driver_dir / f".{exe_name}.{os.getpid()}.tmp"
    text = render_shim(python or sys.executable, config, runtime, marker)
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o755)  # noqa: S103 - kubelet must execute it
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    fd = os.open(driver_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return target


def check_config_file(path: Path) -> None:
    """Refuse a node config the driver could not use: missing, unreadable or wrong."""
    from flexhub.config import load_config
    from flexhub.driver.loader import installed_backends
    from flexhub.settings import check_sections

    if not path.is_file():
        raise FlexhubError(f"--config {path}: no such file")
    check_sections(load_config(path), installed_backends())


def install_on_node(
    plugin_dir: str | None, config: Path | None = None, driver: str = DRIVER_NAME
) -> tuple[Path, Detection]:
    """``flexhub install``: check the driver name and the node config, find the plugin
    directory (``plugin_dir``, or detected: kubelet's command line, its config file, the
    default) and refuse one another user can write, install the driver there and record the
    directory in the state directory, where ``doctor`` finds it.

    :returns: the driver's path and the plugin directory found (with the rule that chose it).
    """
    from flexhub.config import DEFAULT_CONFIG_PATH, load_config

    driver_dir_name(driver)  # a bad name is refused before anything else
    if config is not None:
        check_config_file(config)
    found = detect_plugin_dir(plugin_dir)
    node_config = load_config(config or DEFAULT_CONFIG_PATH)  # the driver's, for the record
    path = install(Path(found.path), config=config, driver=driver)
    write_record(node_config.state_dir, driver, found)
    return path, found


def driver_path(plugin_dir: Path, driver: str = DRIVER_NAME) -> Path:
    """Where :func:`install` writes the driver executable."""
    dir_name, exe_name = driver_dir_name(driver)
    return plugin_dir / dir_name / exe_name


def mounted_volumes(driver: Path, config: Path | None = None) -> list[str]:
    """What flexhub holds on this node, from the journal of the node config ``config``
    (default: the one the installed ``driver`` exports, else ``FLEXHUB_CONFIG``): each
    mounted pod directory, each staged volume no pod directory accounts for, and each volume
    still recorded without a staging mount (its release waits, or it is attached or its attach
    was interrupted): only the driver can release those.

    :raises FlexhubError: the config cannot be read.
    """
    from flexhub.admin.state import node_state
    from flexhub.config import load_config

    if config is None:
        try:
            baked = shim_config(driver.read_text("utf-8", errors="replace"))
        except OSError:
            baked = None
        config = Path(baked) if baked is not None else None
    state = node_state(load_config(config))
    pods = [p for p in state["pods"] if p["mounted"]]
    shown = [f"{p['target']} ({p['volume_id']})" for p in pods]
    used = {p["volume_id"] for p in pods}
    for vol in state["volumes"]:
        if vol["volume_id"] in used:
            continue
        if vol["mounted"]:
            shown.append(f"{vol['staging']} ({vol['volume_id']})")
        elif vol.get("release_deferred"):
            shown.append(f"{vol['volume_id']}: its release waits (a later unmount finishes it)")
        else:  # a record is removed when its release ends: anything else is unfinished
            shown.append(f"{vol['volume_id']}: attached or its attach interrupted")
    return shown


def uninstall(plugin_dir: Path, driver: str = DRIVER_NAME) -> bool:
    """Remove the driver executable and its directory; returns whether anything was removed."""
    dir_name, exe_name = driver_dir_name(driver)
    driver_dir = plugin_dir / dir_name
    target = driver_dir / exe_name
    removed = False
    if target.exists() or target.is_symlink():
        target.unlink()
        removed = True
    try:
        driver_dir.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        pass  # something else lives there; leave it
    return removed
