"""``flexhub doctor``'s checks of the storage side: each backend imports, finds its node tools
(commands, kernel modules, daemons) and accepts its table of the node config; and iSCSI
fencing's identity (a reservation key of this machine's own). Paths are host paths read under
``host_root``, as in :mod:`flexhub.admin.doctor`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flexhub.admin.check import Check
from flexhub.config import NodeConfig
from flexhub.errors import FlexhubError
from flexhub.node.kernel import has_module

__all__ = ["TOOL_DIRS", "check_backends", "check_fencing_identity"]

#: Where the runner looks for node tools (:data:`flexhub.node.runner.DEFAULT_ENV`).
TOOL_DIRS = ("usr/sbin", "usr/bin", "sbin", "bin")


def _on_host(host_root: Path, path: str | Path) -> Path:
    return host_root / str(path).lstrip("/")


def check_backends(config: NodeConfig | None, host_root: Path, proc_root: Path) -> list[Check]:
    """Every backend imports and finds its node tools. The doctor writes nothing on the
    node: stevedore's cache goes to a temporary directory, and no memo is used."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="flexhub-doctor-") as cache:
        previous = os.environ.get("XDG_CACHE_HOME")
        os.environ["XDG_CACHE_HOME"] = cache
        try:
            return _check_backends(config, host_root, proc_root)
        finally:
            if previous is None:
                del os.environ["XDG_CACHE_HOME"]
            else:
                os.environ["XDG_CACHE_HOME"] = previous


def _check_backends(config: NodeConfig | None, host_root: Path, proc_root: Path) -> list[Check]:
    from flexhub.driver.loader import describe_backends, load_backend

    infos = describe_backends()
    if not infos:
        return [Check("backends", "fail", "no backend installed", "install flexhub's backends")]
    checks = []
    for info in infos:
        name = f"backend {info.name}"
        if info.error:
            checks.append(Check(name, "fail", info.error, f"reinstall {info.distribution}"))
            continue
        backend = load_backend(info.name)
        settings = _check_settings(config, info.name, backend)
        if settings is not None:
            checks.append(settings)
        needs = backend.node_requirements
        missing = [c for c in needs.commands if not _has_command(host_root, c)]
        modules = [m for m in needs.kernel_modules if not has_module(m, host_root)]
        daemons = [d for d in needs.daemons if not _running(proc_root, d)]
        problems = [f"command {c} not found" for c in missing]
        problems += [f"the running kernel has no {m} module" for m in modules]
        problems += [f"{d} is not running" for d in daemons]
        if problems:
            fixes = [needs.hint or "install the backend's node packages"] if missing else []
            fixes += [
                f"modprobe {m} (or install the modules of kernel {os.uname().release})"
                for m in modules
            ]
            if daemons or not fixes:
                fixes.append(needs.hint or f"start {', '.join(daemons)}")
            checks.append(Check(name, "fail", "; ".join(problems), "; ".join(fixes)))
        else:
            checks.append(
                Check(name, "ok", f"{info.distribution} {info.version}, node tools present")
            )
    return checks


def _check_settings(config: NodeConfig | None, name: str, backend: Any) -> Check | None:
    """The backend's table of the node config, as its volume calls check it."""
    if config is None:
        return None
    from flexhub.settings import check_backend_table

    table = config.backend_table(name)
    where = f"[{name}] of {config.source}"
    try:
        check_backend_table(config, name, backend)
    except FlexhubError as exc:
        return Check(f"settings {name}", "fail", exc.message, f"fix {where}")
    if backend.settings_keys is None and table:
        return Check(
            f"settings {name}",
            "warn",
            f"backend {name} declares no settings keys: the keys of {where} are not checked",
            "check them against the backend's documentation",
        )
    if table:
        return Check(f"settings {name}", "ok", f"{where}: {', '.join(sorted(table))}")
    return None


def check_fencing_identity(config: NodeConfig | None, host_root: Path) -> list[Check]:
    """iSCSI fencing tells nodes apart by their reservation key, derived from
    ``/etc/machine-id`` and the initiator name unless configured: a machine id that is
    a placeholder (an image prepared for cloning, never booted as itself) derives none.
    (A key that another machine also holds is caught at every read-write attach, which
    reads the holder's initiator back from the target.)"""
    try:
        from flexhub_iscsi import _reservation as reservation
    except ImportError:
        return []  # no iscsi backend here
    name = "iscsi fencing identity"
    table = config.backend_table("iscsi") if config is not None else {}
    if table.get("reservation_key"):
        return [Check(name, "ok", "[iscsi] reservation_key is set in the node config")]
    machine_id = _on_host(host_root, reservation.MACHINE_ID)
    problem = reservation.machine_id_problem(machine_id)
    if problem:
        return [
            Check(
                name,
                "warn",
                f"{problem}: read-write iSCSI mounts are refused (no reservation key), "
                "and clones of this image would share one",
                "give this machine its own id (systemd-machine-id-setup), or set "
                "[iscsi] reservation_key",
            )
        ]
    initiator = reservation.initiator_name(_on_host(host_root, reservation.INITIATOR_FILE))
    return _check_registrants(config, host_root, reservation) or [
        Check(
            name,
            "ok",
            f"key derived from {reservation.MACHINE_ID}, the initiator name "
            f"{initiator or '(none)'} and the state directory",
        )
    ]


def _check_registrants(config: NodeConfig | None, host_root: Path, reservation: Any) -> list[Check]:
    """Each LUN this node holds for writing (journalled with its key): is the key also
    registered through an initiator that is not the one of the LUN's sessions here?
    Then another machine has this node's key. One ``sg_persist`` per such LUN."""
    if config is None:
        return []
    from flexhub_iscsi._sysfs import Sysfs

    from flexhub.node.journal import Journal
    from flexhub.node.runner import SubprocessRunner

    sysfs = Sysfs(_on_host(host_root, "/sys"), _on_host(host_root, "/dev"))
    checks = []
    try:
        records = Journal(config.state_dir).volumes()
    except FlexhubError:
        return []  # check_journal reports an unreadable journal
    for record in records:
        key_text = record.details.get("reservation", "")
        disks = [d for d in record.details.get("devices", "").split(",") if d]
        paths = [str(sysfs.dev / d) for d in disks if sysfs.node_exists(d)]
        if record.backend != "iscsi" or not key_text or not paths:
            continue
        iqn, iface = record.details.get("iqn", ""), record.details.get("iface", "default")
        mine = [s.initiator for s in sysfs.sessions_of(iqn, iface) if s.initiator]
        key = reservation.parse_key(key_text)
        fence = reservation.Fence(SubprocessRunner(timeout=10.0), 10.0, key, paths)
        try:
            registrations = fence.full_status() or []
        except FlexhubError as exc:
            checks.append(
                Check(
                    "iscsi fencing identity",
                    "warn",
                    f"{record.volume_id}: {exc.message}",
                    "check the target and the node's sessions",
                )
            )
            continue
        foreign = reservation.foreign_registrations(registrations, key, mine)
        if foreign and mine:
            others = ", ".join(sorted({r.initiator for r in foreign}))
            checks.append(
                Check(
                    "iscsi fencing identity",
                    "fail",
                    f"{record.volume_id}: this node's key {key_text} is also registered "
                    f"through initiator {others}, not this node's ({', '.join(mine)}): "
                    "another machine has this node's key and may write to the LUN",
                    "give that machine its own /etc/machine-id and initiator name (or "
                    "[iscsi] reservation_key), and check the LUN's data",
                )
            )
    return checks


def _has_command(host_root: Path, command: str) -> bool:
    return any(os.access(_on_host(host_root, f"/{d}/{command}"), os.X_OK) for d in TOOL_DIRS)


def _running(proc_root: Path, name: str) -> bool:
    try:
        pids = [p for p in os.listdir(proc_root) if p.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            if (proc_root / pid / "comm").read_text().strip() == name:
                return True
        except OSError:
            continue
    return False
