"""``flexhub doctor``: is this node able to serve flexhub volumes, and if not, what to do.

Each check gives ``ok``, ``warn`` or ``fail`` with a one-line detail and, unless ``ok``, the
fix. ``--probe`` (the DaemonSet's liveness probe) runs only the cheap checks: the driver is
installed where kubelet looks, ``init`` answers as kubelet parses it, and the state
directory is usable.

All paths are host paths read under ``host_root`` (``/`` on the node, the hostPath mount in
the DaemonSet), so that the same code checks the host from inside a container.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from flexhub import DRIVER_NAME
from flexhub.admin.check import Check, render  # re-exported: doctor's result and its table
from flexhub.admin.storagecheck import TOOL_DIRS, check_backends, check_fencing_identity
from flexhub.config import NodeConfig, load_config
from flexhub.errors import FlexhubError

__all__ = ["TOOL_DIRS", "Check", "Doctor", "render"]

EXPECTED_CAPABILITIES = {
    "attach": False,
    "selinuxRelabel": True,
    "fsGroup": False,
    "supportsMetrics": True,
    "requiresFSResize": True,
}


class Doctor:
    """Runs the checks.

    :param plugin_dir: kubelet's plugin directory (host path); detected when ``None``.
    :param config: the node config file; ``FLEXHUB_CONFIG`` or the default when ``None``.
    :param host_root: where the host's ``/`` is visible.
    :param proc_root: a ``/proc`` that shows the host's processes.
    """

    def __init__(
        self,
        plugin_dir: str | None = None,
        config: Path | None = None,
        driver: str = DRIVER_NAME,
        host_root: Path = Path("/"),
        proc_root: Path = Path("/proc"),
    ) -> None:
        self.plugin_dir = plugin_dir
        self.config_path = config
        self.driver = driver
        self.host_root = host_root
        self.proc_root = proc_root
        self.config: NodeConfig | None = None
        self._config_used: str | None = None
        self._plugin_dir_ok = False

    def host(self, path: str | Path) -> Path:
        return self.host_root / str(path).lstrip("/")

    # -- the runs -------------------------------------------------------------------------------

    def probe(self) -> list[Check]:
        """The liveness checks: cheap, and each one is a reason to restart the installer.

        :raises FlexhubError: the config file named (``config``) does not exist and is not
            the one the installed driver reads (for that driver a missing file means the
            defaults, as for the DaemonSet's probe of a node without a config; any other
            missing file is a mistyped path, not a node on defaults).
        """
        checks = self.check_config()  # first: the plugin directory's record is in state_dir
        plugin = self.check_plugin_dir()
        asked = self.config_path
        if asked is not None and not self.host(asked).exists():
            used = self._shim_config() if plugin.status == "ok" else None
            if used != str(asked):
                reads = f" (the installed driver reads {used})" if used else ""
                raise FlexhubError(f"--config {asked}: no such file{reads}")
        if plugin.status == "ok" and self._shim_config() not in (None, self._config_used):
            checks = self.check_config()  # the installed driver's own, now that it is known
        checks.append(plugin)
        if plugin.status == "ok":  # never a driver from a directory others may write
            driver = self.check_driver()
            checks.append(driver)
            if driver.status != "fail":
                checks.append(self.check_init())
        checks.extend(self.check_dirs())
        return checks

    def run(self) -> list[Check]:
        """Every check."""
        checks = self.probe()
        if self._plugin_dir_ok and self._driver_path().is_file():
            checks.append(self.check_shim_runtime())
        checks.extend(self.check_backends())
        checks.extend(self.check_fencing_identity())
        checks.extend(self.check_journal())
        return checks

    # -- checks ---------------------------------------------------------------------------------

    def _shim_config(self) -> str | None:
        """The config path baked into the installed driver (``None``: no driver, its
        directory not known yet, or it exports none)."""
        from flexhub.admin.install import shim_config

        if self.plugin_dir is None:
            return None
        try:
            return shim_config(self._driver_path().read_text("utf-8", errors="replace"))
        except OSError:
            return None

    def check_config(self) -> list[Check]:
        """The node config the installed driver reads (the one its shim exports), checked as
        a volume call checks it: values, top-level keys, and every table naming a backend."""
        from flexhub.config import DEFAULT_CONFIG_PATH, config_path

        checks = []
        used = self._shim_config()
        if used is None and self.plugin_dir is not None and self._driver_path().is_file():
            used = str(DEFAULT_CONFIG_PATH)  # kubelet runs the driver without FLEXHUB_CONFIG
        asked = self.config_path or (None if used else config_path())
        if asked is not None and used is not None and str(asked) != used:
            checks.append(
                Check(
                    "config",
                    "warn",
                    f"the installed driver reads {used}, not {asked}: checking {used}",
                    f"flexhub install --config {asked}, or edit {used}",
                )
            )
        path = Path(used) if used is not None else Path(asked or config_path())
        self._config_used = str(path)
        try:
            self.config = load_config(self.host(path))
        except FlexhubError as exc:
            self.config = None
            checks.append(
                Check("config", "fail", exc.message, "fix the file, or remove it for defaults")
            )
            return checks
        if self.config.backends:
            from flexhub.driver.loader import installed_backends
            from flexhub.settings import check_sections

            try:
                check_sections(self.config, installed_backends())
            except FlexhubError as exc:
                checks.append(Check("config", "fail", exc.message, "rename or remove the table"))
                return checks
        source = path if self.config.source is not None else f"{path}: no file, defaults"
        checks.append(Check("config", "ok", f"{source}"))
        return checks

    def check_plugin_dir(self) -> Check:
        """The directory given, else the one recorded at install (never a fresh guess: a
        process that only looks like kubelet must not choose what the probe runs), checked
        to be root's alone (:mod:`flexhub.admin.trust`)."""
        from flexhub.admin.plugindir import Detection, read_record, record_path
        from flexhub.admin.trust import trusted_path
        from flexhub.errors import UntrustedPath

        name = "plugin directory"
        reinstall = "flexhub install (it records the plugin directory), or pass --plugin-dir"
        if self.plugin_dir:
            found: Detection | None = Detection(self.plugin_dir, "explicit", "--plugin-dir")
        elif self.config is None:
            return Check(name, "fail", "no install record without a usable config", reinstall)
        else:
            try:
                found = read_record(self.config.state_dir, self.driver, self.host_root)
            except FlexhubError as exc:
                return Check(name, "fail", exc.message, reinstall)
            if found is None:
                where = record_path(self.config.state_dir, self.driver)
                return Check(name, "fail", f"not installed: no record {where}", reinstall)
        assert found is not None
        self.plugin_dir = found.path
        if not self.host(found.path).is_dir():
            return Check(
                name,
                "fail",
                f"{found.describe()} does not exist",
                "install the driver (flexhub install), or pass kubelet's --volume-plugin-dir",
            )
        try:
            trusted_path(found.path, self.host_root)
        except UntrustedPath as exc:
            return Check(
                name,
                "fail",
                f"{found.describe()}: {exc.message}; its driver is not run",
                "make it and every directory above it root's and not writable by others",
            )
        self._plugin_dir_ok = True
        return Check(name, "ok", found.describe())

    def _driver_host_path(self) -> str:
        from flexhub.admin.install import driver_dir_name

        dir_name, exe_name = driver_dir_name(self.driver)
        assert self.plugin_dir is not None
        return f"{self.plugin_dir.rstrip('/')}/{dir_name}/{exe_name}"

    def _driver_path(self) -> Path:
        return self.host(self._driver_host_path())

    def check_driver(self) -> Check:
        path = self._driver_path()
        fix = f"flexhub install --plugin-dir {self.plugin_dir}"
        try:
            info = os.stat(path)
        except OSError as exc:
            return Check("driver", "fail", f"{path}: {exc.strerror}", fix)
        if not stat.S_ISREG(info.st_mode) or not info.st_mode & stat.S_IXUSR:
            return Check("driver", "fail", f"{path} is not an executable file", fix)
        from flexhub.admin.install import check_runnable
        from flexhub.errors import UntrustedPath

        try:
            check_runnable(self._driver_host_path(), self.host_root)
        except UntrustedPath as exc:
            return Check(
                "driver", "fail", f"not run: {exc.message}", f"chown root, chmod go-w; {fix}"
            )
        strays = sorted(
            p.name
            for p in path.parent.iterdir()
            if p.name != path.name and not p.name.startswith(".")
        )
        if strays:
            return Check(
                "driver",
                "warn",
                f"{path.parent} also holds {', '.join(strays)}: kubelet re-probes on each change",
                f"remove them; only {path.name} belongs there",
            )
        return Check("driver", "ok", str(path))

    def check_init(self) -> Check:
        from flexhub.admin.deploy import run_in_host
        from flexhub.admin.harness import ReplyError, parse_reply
        from flexhub.admin.install import check_runnable
        from flexhub.errors import UntrustedPath

        path, driver = self._driver_path(), self._driver_host_path()
        try:  # again, right before running it
            check_runnable(driver, self.host_root)
        except UntrustedPath as exc:
            return Check("init", "fail", f"not run: {exc.message}", "reinstall the driver")
        try:
            returncode, output = run_in_host(self.host_root, [driver, "init"], timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Check("init", "fail", f"{path} init: {exc}", "reinstall the driver")
        try:
            reply = parse_reply(output)
        except ReplyError as exc:
            return Check("init", "fail", f"kubelet cannot parse the reply: {exc}", "reinstall")
        if reply.get("status") != "Success" or returncode != 0:
            return Check(
                "init",
                "fail",
                f"init answered {reply.get('status')!r} (exit {returncode}): "
                f"{reply.get('message', '')}",
                "reinstall the driver; check that its runtime exists",
            )
        if reply.get("capabilities") != EXPECTED_CAPABILITIES:
            return Check(
                "init",
                "fail",
                f"unexpected capabilities {reply.get('capabilities')}",
                "the installed driver is another flexhub version: reinstall",
            )
        return Check("init", "ok", "Success, capabilities as documented")

    def check_dirs(self) -> list[Check]:
        if self.config is None:
            return []
        return [
            self._check_dir("state directory", self.config.state_dir, private=True),
            self._check_dir("log directory", self.config.log_dir, private=False),
        ]

    def _check_dir(self, name: str, path: Path, private: bool) -> Check:
        where = self.host(path)
        try:
            info = os.stat(where)
        except FileNotFoundError:
            return Check(name, "warn", f"{path} does not exist yet (made on the first call)")
        except OSError as exc:
            return Check(name, "fail", f"{path}: {exc.strerror}", f"make {path} usable by root")
        if not stat.S_ISDIR(info.st_mode):
            return Check(name, "fail", f"{path} is not a directory", f"remove it or move {name}")
        try:
            readonly = bool(os.statvfs(where).f_flag & os.ST_RDONLY)
        except OSError:
            readonly = False
        if readonly or not os.access(where, os.W_OK):
            return Check(name, "fail", f"{path} is not writable", f"make {path} writable by root")
        if self.plugin_dir and str(path).startswith(self.plugin_dir.rstrip("/") + "/"):
            return Check(
                name,
                "fail",
                f"{path} is inside the plugin directory: every write re-probes the driver",
                f"move {name} out of {self.plugin_dir}",
            )
        if info.st_uid != 0 and os.geteuid() == 0:
            return Check(
                name, "fail", f"{path} is owned by uid {info.st_uid}", f"chown root {path}"
            )
        mode = stat.S_IMODE(info.st_mode)
        if private and mode & 0o077:
            return Check(
                name,
                "fail",
                f"{path} has mode {mode:04o}: other users can read volumes",
                f"chmod 0700 {path}",
            )
        if mode & 0o022:
            return Check(
                name,
                "fail",
                f"{path} has mode {mode:04o}: writable by others",
                f"chmod go-w {path}",
            )
        return Check(name, "ok", f"{path} ({mode:04o})")

    def check_shim_runtime(self) -> Check:
        path = self._driver_path()
        try:
            text = path.read_text("utf-8", errors="replace")
        except OSError:
            return Check("runtime", "fail", f"{path} unreadable", "reinstall the driver")
        from flexhub.admin.install import shim_python

        python = shim_python(text)
        if not python:
            return Check("runtime", "fail", f"{path} is not a flexhub shim", "reinstall the driver")
        if not os.access(self.host(python), os.X_OK):
            return Check(
                "runtime",
                "fail",
                f"the driver runs {python}, which is missing",
                "reinstall the runtime and the driver",
            )
        return Check("runtime", "ok", f"the driver runs {python}")

    def check_backends(self) -> list[Check]:
        """Every backend imports, finds its node tools and accepts its settings."""
        return check_backends(self.config, self.host_root, self.proc_root)

    def check_fencing_identity(self) -> list[Check]:
        """iSCSI fencing's reservation key is this machine's own."""
        return check_fencing_identity(self.config, self.host_root)

    def check_journal(self) -> list[Check]:
        if self.config is None:
            return []
        from flexhub.admin.state import node_state
        from flexhub.node.mounts import MountTable

        state = node_state(self.config)
        checks = []
        for pod in state["pods"]:
            if not pod["mounted"]:
                checks.append(
                    Check(
                        "journal",
                        "fail",
                        f"record of {pod['target']} but nothing is mounted there",
                        f"let kubelet finish, or run the driver's unmount {pod['target']}",
                    )
                )
        for volume in state["volumes"]:
            if not volume["mounted"] and volume["release_deferred"]:
                checks.append(
                    Check(
                        "journal",
                        "fail",
                        f"volume {volume['volume_id']} stays attached: its release waits for "
                        "its storage, which was unreachable",
                        "bring the storage back; the node's next unmount call releases it",
                    )
                )
            elif not volume["mounted"]:
                checks.append(
                    Check(
                        "journal",
                        "fail",
                        f"volume {volume['volume_id']} is recorded but not staged",
                        "unmount its pod directories through the driver, then check again",
                    )
                )
        staging = str(self.config.state_dir / "staging") + "/"
        recorded = {v["staging"] for v in state["volumes"]}
        for entry in MountTable().entries():
            point = entry.mount_point
            if point.startswith(staging) and point not in recorded:
                checks.append(
                    Check(
                        "journal",
                        "fail",
                        f"{point} is mounted ({entry.source}) without a record",
                        f"umount {point} once no pod uses it",
                    )
                )
        if not checks:
            checks.append(
                Check(
                    "journal",
                    "ok",
                    f"{len(state['pods'])} pod directories, "
                    f"{len(state['volumes'])} staged volumes, all mounted",
                )
            )
        return checks
