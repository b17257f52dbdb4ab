"""`flexhub doctor` reports each failure it knows, on real state: real files, modes, mounts,
processes and an installed driver; the exit status follows the failures. The plugin and state
directories live in a directory only root may write (a doctor runs no driver from anywhere
else); a planted driver proves, by the marker file it would write, that it never ran."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from flexhub.admin.install import install
from flexhub.node.journal import Journal, PodRecord, VolumeRecord
from tests.conftest import KUBELET_ENV, PYTHON, TEST_SITE, needs_root
from tests.deploy.conftest import running, wait_for_cmdline

pytestmark = needs_root  # root-owned trees, chown, setpriv


def doctor(
    node: dict[str, Path], *extra: str, site: bool = False, plugin_dir: Path | None = None
) -> tuple[int, list[dict[str, str]]]:
    env = dict(KUBELET_ENV)
    if site:
        env["PYTHONPATH"] = str(TEST_SITE)
    argv = [PYTHON, "-m", "flexhub", "doctor", "--json"]
    if plugin_dir is not None or "--no-plugin-dir" not in extra:
        argv += ["--plugin-dir", str(plugin_dir or node["plugins"])]
    extra = tuple(e for e in extra if e != "--no-plugin-dir")
    if "--host-root" in extra:  # --config is a host path: the node's config is in that host
        seen = Path(extra[extra.index("--host-root") + 1]) / str(node["config"]).lstrip("/")
        if not seen.exists():
            seen.parent.mkdir(parents=True, exist_ok=True)
            seen.write_text(node["config"].read_text())
    proc = subprocess.run(
        [*argv, "--config", str(node["config"]), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return proc.returncode, json.loads(proc.stdout)


def status(checks: list[dict[str, str]], name: str) -> list[tuple[str, str]]:
    return [(c["status"], c["detail"]) for c in checks if c["name"] == name]


@pytest.fixture
def node(node_tree: dict[str, Path], trusted_dir: Path) -> dict[str, Path]:
    node_tree["state"] = trusted_dir / "state"
    node_tree["plugins"] = trusted_dir / "plugins"
    node_tree["config"].write_text(
        f'state_dir = "{node_tree["state"]}"\nlog_dir = "{node_tree["log"]}"\n'
        f'lock_timeout = 20\n[loopfile]\nroot = "{node_tree["loopfiles"]}"\n'
    )
    for key in ("state", "log"):
        node_tree[key].mkdir(mode=0o700)
    node_tree["plugins"].mkdir(mode=0o755)
    return node_tree


def plant(directory: Path, marker: Path) -> Path:
    """A driver that proves it ran: it writes ``id`` into ``marker``, and answers init."""
    driver = directory / "k8s~flexhub" / "flexhub"
    driver.parent.mkdir(parents=True, exist_ok=True)
    driver.write_text(
        f"#!/bin/sh\nid > {marker}\n"
        """echo '{"status":"Success","capabilities":{"attach":false}}'\n"""
    )
    driver.chmod(0o755)
    return driver


def cli_install(node: dict[str, Path]) -> None:
    subprocess.run(
        [PYTHON, "-m", "flexhub", "install", "--plugin-dir", str(node["plugins"]),
         "--config", str(node["config"])],
        env=dict(KUBELET_ENV), check=True, capture_output=True, timeout=120,
    )  # fmt: skip


def test_the_probe_checks_the_directory_recorded_at_install(node: dict[str, Path]) -> None:
    code, checks = doctor(node, "--probe", "--no-plugin-dir")
    assert code == 1
    record = node["state"] / "installed-k8s~flexhub.json"
    assert status(checks, "plugin directory") == [("fail", f"not installed: no record {record}")]
    assert status(checks, "init") == []
    cli_install(node)
    code, checks = doctor(node, "--probe", "--no-plugin-dir")
    assert code == 0, checks
    ((state, detail),) = status(checks, "plugin directory")
    assert state == "ok" and detail.startswith(f"{node['plugins']} (recorded at install: {record}")
    assert status(checks, "init") == [("ok", "Success, capabilities as documented")]


def test_the_probe_never_runs_a_driver_an_impostor_points_at(
    node: dict[str, Path], tmp_path: Path
) -> None:
    """The issue's attack: nobody runs `exec -a kubelet ... --volume-plugin-dir=/tmp/evil`
    with a planted driver there; the liveness probe (no --plugin-dir) must not run it."""
    evil, marker = tmp_path / "evil", tmp_path / "ran"
    plant(evil, marker)
    evil.chmod(0o777)
    script = f"exec -a kubelet bash -c 'sleep 60; :' kubelet --volume-plugin-dir={evil}"
    nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    with running([*nobody, "bash", "-c", script]) as impostor:
        wait_for_cmdline(impostor.pid, "kubelet")
        code, no_record = doctor(node, "--probe", "--no-plugin-dir")
        cli_install(node)
        _, recorded = doctor(node, "--probe", "--no-plugin-dir")
        _, given = doctor(node, "--probe", plugin_dir=evil)
    assert not marker.exists(), marker.read_text()
    assert code == 1 and "not installed" in status(no_record, "plugin directory")[0][1]
    assert status(recorded, "plugin directory")[0][0] == "ok"
    assert str(node["plugins"]) in status(recorded, "driver")[0][1]
    ((state, detail),) = status(given, "plugin directory")
    assert state == "fail" and "/tmp is writable by others (mode 1777)" in detail
    assert status(given, "init") == [] and status(given, "driver") == []


@pytest.mark.parametrize("weak", ["owned by nobody", "mode 0777", "driver dir 0777", "runtime"])
def test_a_driver_others_may_have_written_is_not_run(
    node: dict[str, Path], tmp_path: Path, weak: str
) -> None:
    marker = tmp_path / "ran"
    if weak == "runtime":  # the shim is root's, the interpreter it starts is not
        python = tmp_path / "python"
        python.write_text(f"#!/bin/sh\nid > {marker}\n")
        python.chmod(0o755)
        driver = install(node["plugins"], config=node["config"], python=str(python))
        offender = "/tmp is writable by others (mode 1777)"
    else:
        driver = plant(node["plugins"], marker)
        if weak == "owned by nobody":
            os.chown(driver, 65534, 65534)
            offender = f"{driver} is owned by uid 65534, not root"
        elif weak == "mode 0777":
            driver.chmod(0o777)
            offender = f"{driver} is writable by others (mode 0777)"
        else:
            driver.parent.chmod(0o777)
            offender = f"{driver.parent} is writable by others (mode 0777)"
    code, checks = doctor(node, "--probe")
    assert not marker.exists(), marker.read_text()
    assert code == 1
    assert status(checks, "driver") == [("fail", f"not run: {offender}")]
    assert status(checks, "init") == []


@pytest.mark.parametrize("weak", ["mode 0666", "mode 0755", "owned by nobody", "points at /tmp"])
def test_an_install_record_that_is_not_root_s_alone_is_refused(
    node: dict[str, Path], tmp_path: Path, weak: str
) -> None:
    marker = tmp_path / "ran"
    cli_install(node)
    record = node["state"] / "installed-k8s~flexhub.json"
    if weak == "mode 0666":
        record.chmod(0o666)
        expected = f"refusing the install record {record}: {record} is writable by others"
    elif weak == "mode 0755":
        record.chmod(0o755)
        expected = f"{record}: mode 0755, not a 0644 or stricter file"
    elif weak == "owned by nobody":
        os.chown(record, 65534, 65534)
        expected = f"refusing the install record {record}: {record} is owned by uid 65534"
    else:
        evil = tmp_path / "evil"
        plant(evil, marker)
        record.write_text(record.read_text().replace(str(node["plugins"]), str(evil)))
        expected = f"{evil} (recorded at install: {record}"
    code, checks = doctor(node, "--probe", "--no-plugin-dir")
    assert not marker.exists()
    assert code == 1
    ((state, detail),) = status(checks, "plugin directory")
    assert state == "fail" and expected in detail, detail
    assert status(checks, "init") == []


def test_a_healthy_node_passes_the_probe(node: dict[str, Path]) -> None:
    install(node["plugins"], config=node["config"])
    code, checks = doctor(node, "--probe")
    assert code == 0, checks
    assert {c["status"] for c in checks} == {"ok"}
    assert status(checks, "init") == [("ok", "Success, capabilities as documented")]


def test_missing_driver(node: dict[str, Path]) -> None:
    code, checks = doctor(node, "--probe")
    assert code == 1
    ((state, detail),) = status(checks, "driver")
    assert state == "fail" and "No such file" in detail
    assert status(checks, "init") == []


def test_driver_not_executable_and_stray_files(node: dict[str, Path]) -> None:
    driver = install(node["plugins"], config=node["config"])
    (driver.parent / "flexhub.log").write_text("a log in the plugin dir")
    code, checks = doctor(node, "--probe")
    assert code == 0  # a warning, not a failure
    assert status(checks, "driver")[0][0] == "warn"
    assert "flexhub.log" in status(checks, "driver")[0][1]
    driver.chmod(0o644)
    code, checks = doctor(node, "--probe")
    assert code == 1
    assert status(checks, "driver") == [("fail", f"{driver} is not an executable file")]


def test_init_that_kubelet_cannot_parse(node: dict[str, Path]) -> None:
    driver = install(node["plugins"], config=node["config"])
    driver.write_text('#!/bin/sh\necho "starting"\necho \'{"status":"Success"}\'\n')
    code, checks = doctor(node, "--probe")
    assert code == 1
    ((state, detail),) = status(checks, "init")
    assert state == "fail" and "kubelet cannot parse" in detail


def test_driver_whose_runtime_is_gone(node: dict[str, Path]) -> None:
    install(node["plugins"], config=node["config"], python="/nonexistent/python3")
    code, checks = doctor(node)
    assert code == 1
    assert status(checks, "init")[0][0] == "fail"
    assert status(checks, "runtime") == [
        ("fail", "the driver runs /nonexistent/python3, which is missing")
    ]


@needs_root
def test_state_and_log_directories(node: dict[str, Path], tmp_path: Path) -> None:
    install(node["plugins"], config=node["config"])
    node["state"].chmod(0o755)
    code, checks = doctor(node, "--probe")
    assert code == 1
    assert "mode 0755" in status(checks, "state directory")[0][1]
    node["state"].chmod(0o700)
    os.chown(node["log"], 65534, 65534)
    code, checks = doctor(node, "--probe")
    assert status(checks, "log directory")[0] == ("fail", f"{node['log']} is owned by uid 65534")
    os.chown(node["log"], 0, 0)
    subprocess.run(
        ["mount", "--bind", "-o", "ro", str(node["state"]), str(node["state"])], check=True
    )
    try:
        code, checks = doctor(node, "--probe")
    finally:
        subprocess.run(["umount", str(node["state"])], check=True)
    assert code == 1
    assert status(checks, "state directory")[0] == ("fail", f"{node['state']} is not writable")
    inside = node["plugins"] / "logs"
    inside.mkdir(mode=0o700)
    node["config"].write_text(node["config"].read_text().replace(str(node["log"]), str(inside)))
    code, checks = doctor(node, "--probe")
    assert "inside the plugin directory" in status(checks, "log directory")[0][1]


def test_broken_config(node: dict[str, Path]) -> None:
    install(node["plugins"], config=node["config"])
    node["config"].write_text("state_dir = 'relative'\n")
    code, checks = doctor(node, "--probe")
    assert code == 1
    assert status(checks, "config")[0][0] == "fail"
    assert "absolute path" in status(checks, "config")[0][1]


@pytest.mark.parametrize("extra", [(), ("--json",), ("--probe",)])
def test_a_config_named_that_does_not_exist_is_refused_in_one_line(
    node: dict[str, Path], tmp_path: Path, extra: tuple[str, ...]
) -> None:
    """A mistyped ``--config`` is not a node on defaults: no check is shown, one line. (The
    installed driver's own config may be missing: the DaemonSet's probe names it, and the
    defaults are what that driver uses; not run here: a driver on defaults writes the node's
    real /var/log/flexhub, which the tests' node-path guard refuses.)"""
    install(node["plugins"], config=node["config"])
    missing = tmp_path / "flexhub.tmol"
    proc = subprocess.run(
        [PYTHON, "-m", "flexhub", "doctor", "--plugin-dir", str(node["plugins"]),
         "--config", str(missing), *extra],
        env=dict(KUBELET_ENV), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"flexhub: --config {missing}: no such file (the installed driver reads {node['config']})"
    ]


def test_broken_backend_and_missing_node_tools(node: dict[str, Path], tmp_path: Path) -> None:
    install(node["plugins"], config=node["config"])
    host = tmp_path / "host"
    (host / "usr/sbin").mkdir(parents=True)
    (host / "sys/module/loop").mkdir(parents=True)
    for tool in ("losetup", "blkid", "mkfs.ext4", "fsck", "mount", "umount"):  # no mkfs.xfs
        real = next(
            p
            for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
            if os.path.exists(p := f"{d}/{tool}")
        )
        (host / "usr/sbin" / tool).symlink_to(real)
    code, checks = doctor(node, "--host-root", str(host), site=True)
    assert code == 1
    assert status(checks, "backend loopfile") == [("fail", "command mkfs.xfs not found")]
    assert status(checks, "backend broken")[0][0] == "fail"
    assert "libfrobnicate" in status(checks, "backend broken")[0][1]
    iscsi = status(checks, "backend iscsi")[0]
    assert iscsi[0] == "fail" and "iscsid is not running" in iscsi[1]


def test_kernel_module_missing_then_loadable(node: dict[str, Path], tmp_path: Path) -> None:
    install(node["plugins"], config=node["config"])
    host = tmp_path / "host"
    (host / "usr/sbin").mkdir(parents=True)
    for tool in ("mount.nfs", "mount", "umount"):
        (host / "usr/sbin" / tool).write_text("#!/bin/sh\n")
        (host / "usr/sbin" / tool).chmod(0o755)
    _, checks = doctor(node, "--host-root", str(host))
    ((state, detail),) = status(checks, "backend nfs")
    assert (state, detail) == ("fail", "the running kernel has no nfs module")
    fix = next(c["fix"] for c in checks if c["name"] == "backend nfs")
    assert fix.startswith("modprobe nfs") and "nfs-common" not in fix  # not a package
    # loadable from the running kernel's module tree (modules.dep), not loaded yet: fine
    tree = host / "lib/modules" / os.uname().release
    tree.mkdir(parents=True)
    (tree / "modules.dep").write_text("kernel/fs/nfs/nfs.ko.xz: kernel/net/sunrpc/sunrpc.ko.xz\n")
    _, checks = doctor(node, "--host-root", str(host))
    assert status(checks, "backend nfs")[0][0] == "ok"


def test_missing_plugin_directory(node: dict[str, Path], tmp_path: Path) -> None:
    missing = tmp_path / "no-such-plugins"
    env = dict(KUBELET_ENV)
    argv = [PYTHON, "-m", "flexhub", "doctor", "--json", "--plugin-dir", str(missing)]
    proc = subprocess.run(
        [*argv, "--config", str(node["config"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1
    checks = json.loads(proc.stdout)
    ((state, detail),) = status(checks, "plugin directory")
    assert state == "fail" and str(missing) in detail and "does not exist" in detail


def test_init_of_another_driver_version(node: dict[str, Path]) -> None:
    install(node["plugins"], config=node["config"])
    driver = node["plugins"] / "k8s~flexhub" / "flexhub"
    driver.write_text('#!/bin/sh\necho \'{"status":"Success","capabilities":{"attach":true}}\'\n')
    code, checks = doctor(node)
    assert code == 1
    ((state, detail),) = status(checks, "init")
    assert state == "fail" and "unexpected capabilities" in detail
    driver.write_text('#!/bin/sh\necho \'{"status":"Failure","message":"broken"}\'\nexit 1\n')
    _, checks = doctor(node)
    ((state, detail),) = status(checks, "init")
    assert state == "fail" and "init answered 'Failure' (exit 1): broken" in detail


@needs_root
def test_journal_and_mounts_that_disagree(node: dict[str, Path], tmp_path: Path) -> None:
    install(node["plugins"], config=node["config"])
    gone = tmp_path / "kubelet/pods/u1/volumes/k8s~flexhub/pv"
    Journal(node["state"]).put_pod(PodRecord(str(gone), "loopfile", "loopfile:x", None, False))
    stray = node["state"] / "staging" / ("a" * 32)
    # a CSI volume's staging mount repeats the kubelet's staging path below its hash
    nested = node["state"] / "staging" / ("b" * 32) / "var/lib/kubelet/plugins/x/globalmount"
    for path in (stray, nested):
        path.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "stray", str(path)], check=True)
    try:
        code, checks = doctor(node)
    finally:
        for path in (stray, nested):
            subprocess.run(["umount", str(path)], check=True)
    assert code == 1
    details = [d for s, d in status(checks, "journal") if s == "fail"]
    assert f"record of {gone} but nothing is mounted there" in details
    assert f"{stray} is mounted (stray) without a record" in details
    assert f"{nested} is mounted (stray) without a record" in details


@needs_root
def test_a_stray_mount_inside_a_recorded_staging_mount_is_found(node: dict[str, Path]) -> None:
    """A mount inside a volume's recorded staging mount (inside the volume's filesystem: a
    second mount of its device below its own, or anything else) is no staging of any record:
    reported like any other stray."""
    install(node["plugins"], config=node["config"])
    staging = node["state"] / "staging" / ("c" * 32)
    inner = staging / "var/lib/kubelet/plugins/kubernetes.io/csi/x/globalmount"
    Journal(node["state"]).put_volume(
        VolumeRecord("loopfile:c", "loopfile", "/dev/null", str(staging), "ext4", {})
    )
    staging.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "staged", str(staging)], check=True)
    try:
        inner.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "stray", str(inner)], check=True)
        try:
            _, checks = doctor(node)
        finally:
            subprocess.run(["umount", str(inner)], check=True)
    finally:
        subprocess.run(["umount", str(staging)], check=True)
    details = [d for s, d in status(checks, "journal") if s == "fail"]
    assert f"{inner} is mounted (stray) without a record" in details
    assert not any(d.startswith(f"{staging} is mounted") for d in details)


def test_volumes_recorded_but_not_staged_and_a_release_that_waits(
    node: dict[str, Path], tmp_path: Path
) -> None:
    install(node["plugins"], config=node["config"])
    journal = Journal(node["state"])
    for name in ("left", "waits"):
        journal.put_volume(
            VolumeRecord(f"kitblock:{name}", "iscsi", "/dev/sdq", str(tmp_path / name), "ext4", {})
        )
    journal.defer_release("kitblock:waits")
    code, checks = doctor(node)
    assert code == 1
    details = [d for s, d in status(checks, "journal") if s == "fail"]
    assert "volume kitblock:left is recorded but not staged" in details
    assert (
        "volume kitblock:waits stays attached: its release waits for its storage, which was "
        "unreachable" in details
    )
    shown = subprocess.run(
        [PYTHON, "-m", "flexhub", "state", "--config", str(node["config"])],
        env=dict(KUBELET_ENV),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    ).stdout
    (line,) = [x for x in shown.splitlines() if "kitblock:waits" in x]
    assert "RELEASE WAITS FOR ITS STORAGE" in line


def test_table_for_people(node: dict[str, Path]) -> None:
    proc = subprocess.run(
        [
            PYTHON,
            "-m",
            "flexhub",
            "doctor",
            "--probe",
            "--plugin-dir",
            str(node["plugins"]),
            "--config",
            str(node["config"]),
        ],
        env=dict(KUBELET_ENV),
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert "FAIL  driver" in proc.stdout
    assert "fix: flexhub install --plugin-dir" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].endswith("failed, 0 warnings")


def test_checks_the_config_baked_into_the_driver(node: dict[str, Path], tmp_path: Path) -> None:
    """The driver's own config is checked, even when another one is named (or none)."""
    baked = tmp_path / "baked.toml"
    baked.write_text(
        f"state_dir = '{node['state']}'\nlog_dir = '{node['log']}'\n"
        "[loopfile]\nroot = '/var/lib/flexhub/loopfiles'\nisolation = 'tenant'\n"
    )
    install(node["plugins"], config=baked)
    code, checks = doctor(node)  # --config names the healthy session config
    assert code == 1
    ((state, detail),) = status(checks, "settings loopfile")
    assert state == "fail" and 'isolation must be "namespace" or "none"' in detail
    assert str(baked) in detail
    assert (
        "warn",
        f"the installed driver reads {baked}, not {node['config']}: checking {baked}",
    ) in status(checks, "config")
    argv = [PYTHON, "-m", "flexhub", "doctor", "--json", "--plugin-dir", str(node["plugins"])]
    proc = subprocess.run(argv, env=dict(KUBELET_ENV), capture_output=True, text=True, check=False)
    checks = json.loads(proc.stdout)
    assert status(checks, "config") == [("ok", str(baked))]
    assert status(checks, "settings loopfile")[0][0] == "fail"


@pytest.mark.parametrize(
    ("table", "check", "needle"),
    [
        (
            "[loopfle]\nroot = '/x'\n",
            "config",
            "unknown section [loopfle] (did you mean [loopfile]?)",
        ),
        (
            "[loopfile]\nrot = '/x'\n",
            "settings loopfile",
            "unknown setting 'rot' in [loopfile] (did you mean root?)",
        ),
        (
            "[loopfile]\nlegacy = 'keep'\n",
            "settings loopfile",
            '[loopfile] legacy must be "adopt" or "refuse"',
        ),
        (
            "[loopfile]\nroot = 'relative'\n",
            "settings loopfile",
            "[loopfile] root must be an absolute path",
        ),
        (
            "[nfs]\nmount_timeout = 0\n",
            "settings nfs",
            "[nfs] mount_timeout must be a positive number",
        ),
        ("[iscsi]\nlogin_timout = 5\n", "settings iscsi", "(did you mean login_timeout?)"),
    ],
)
def test_backend_settings_are_checked(
    node: dict[str, Path], table: str, check: str, needle: str
) -> None:
    install(node["plugins"], config=node["config"])
    node["config"].write_text(f"state_dir = '{node['state']}'\nlog_dir = '{node['log']}'\n{table}")
    code, checks = doctor(node)
    assert code == 1
    ((state, detail),) = status(checks, check)
    assert state == "fail" and needle in detail, detail


def test_undeclared_backend_settings_warn(node: dict[str, Path]) -> None:
    install(node["plugins"], config=node["config"])
    with node["config"].open("a") as handle:
        handle.write("[echo]\nanything = 1\n")
    _, checks = doctor(node, site=True)
    ((state, detail),) = status(checks, "settings echo")
    assert state == "warn" and "declares no settings keys" in detail


@pytest.mark.parametrize("machine_id", ["", "uninitialized"])
def test_a_placeholder_machine_id_is_flagged_for_iscsi_fencing(
    node: dict[str, Path], tmp_path: Path, machine_id: str
) -> None:
    """An image prepared for cloning keeps /etc/machine-id empty or 'uninitialized': no
    reservation key derives from it, and clones would share one. A configured key is fine."""
    install(node["plugins"], config=node["config"])
    host = tmp_path / "host"
    (host / "etc").mkdir(parents=True)
    (host / "etc/machine-id").write_text(machine_id + "\n")
    _, checks = doctor(node, "--host-root", str(host))
    ((state, detail),) = status(checks, "iscsi fencing identity")
    assert state == "warn" and "machine-id" in detail, detail
    fix = next(c["fix"] for c in checks if c["name"] == "iscsi fencing identity")
    assert "reservation_key" in fix

    (host / "etc/machine-id").write_text("3d1219c7c4c5404aaa1f6d2a48adfda4\n")
    (host / "etc/iscsi").mkdir()
    (host / "etc/iscsi/initiatorname.iscsi").write_text("InitiatorName=iqn.2004-10.com.x:w1\n")
    _, checks = doctor(node, "--host-root", str(host))
    ((state, detail),) = status(checks, "iscsi fencing identity")
    assert state == "ok" and "iqn.2004-10.com.x:w1" in detail, detail

    seen = host / str(node["config"]).lstrip("/")  # the doctor reads the host's file
    seen.write_text(node["config"].read_text() + '[iscsi]\nreservation_key = "0xabc"\n')
    (host / "etc/machine-id").write_text("uninitialized\n")
    _, checks = doctor(node, "--host-root", str(host))
    assert status(checks, "iscsi fencing identity")[0][0] == "ok"
