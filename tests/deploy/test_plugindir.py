"""Plugin-directory detection, one test per rule: kubelet's rules against real processes (a
root-owned copy of bash called kubelet, in a directory only root may write), the others on fake
/proc trees and host roots; and the impostors: a process of another user, an executable in a
directory others may write, a plugin directory below one, through `flexhub install` too."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from flexhub.admin.plugindir import DEFAULT_PLUGIN_DIR, detect_plugin_dir
from flexhub.errors import UntrustedPath
from tests.conftest import KUBELET_ENV, PYTHON, needs_root
from tests.deploy.conftest import HostProc, fake_kubelet, running, wait_for_cmdline

FLAG = "--volume-plugin-dir"
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


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


def kubelet_argv(exe: Path, *flags: str) -> list[str]:
    """A command line that reads like kubelet's, for a copy of bash: it stays up 60 s."""
    return [str(exe), "-c", "sleep 60; :", "kubelet", *flags]


def detect_on_this_node(host_proc: HostProc, pid: int) -> tuple[str, str]:
    """What detection decides when the host runs process ``pid`` (with pid 1: the test)."""
    host_proc.show(pid)
    found = detect_plugin_dir(proc_root=host_proc.path)
    return found.path, found.rule


@needs_root
@pytest.mark.parametrize("form", ["--flag=value", "--flag value", "hyperkube kubelet"])
def test_kubelet_command_line(trusted_dir: Path, host_proc: HostProc, form: str) -> None:
    plugins = trusted_dir / "volumeplugins"
    if form == "hyperkube kubelet":
        exe = fake_kubelet(trusted_dir / "bin", "hyperkube")
        (trusted_dir / "kubelet").write_text("sleep 60\n")  # the script bash runs, from cwd
        argv = [str(exe), "kubelet", "--v=2", f"{FLAG}={plugins}"]
    else:
        exe = fake_kubelet(trusted_dir / "bin")
        flags = [f"{FLAG}={plugins}"] if "=" in form else [FLAG, str(plugins)]
        argv = kubelet_argv(exe, "--v=2", *flags)
    with running(argv, cwd=trusted_dir) as kubelet:
        wait_for_cmdline(kubelet.pid, argv[0])
        host_proc.show(kubelet.pid)
        found = detect_plugin_dir(proc_root=host_proc.path)
    assert (found.path, found.rule) == (str(plugins), "kubelet command line")
    assert f"pid {kubelet.pid}" in found.detail


@needs_root
@pytest.mark.parametrize(
    "text",
    [
        "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n"
        "volumePluginDir: {plugins}\n",
        '{{"kind": "KubeletConfiguration", "volumePluginDir": "{plugins}"}}',
    ],
)
def test_kubelet_config_file(trusted_dir: Path, host_proc: HostProc, text: str) -> None:
    plugins = trusted_dir / "etc/kubernetes/kubelet-plugins/volume/exec"
    config = trusted_dir / "config.yaml"
    config.write_text(text.format(plugins=plugins))
    config.chmod(0o644)
    argv = kubelet_argv(fake_kubelet(trusted_dir / "bin"), f"--config={config}")
    with running(argv) as kubelet:
        wait_for_cmdline(kubelet.pid, argv[0])
        host_proc.show(kubelet.pid)
        found = detect_plugin_dir(proc_root=host_proc.path)
    assert (found.path, found.rule) == (str(plugins), "kubelet config")
    assert str(config) in found.detail


@needs_root
def test_a_kubelet_config_that_others_may_write_is_refused(
    trusted_dir: Path, host_proc: HostProc
) -> None:
    config = trusted_dir / "conf" / "config.yaml"
    config.parent.mkdir(mode=0o755)
    config.write_text(f"volumePluginDir: {trusted_dir}/plugins\n")
    argv = kubelet_argv(fake_kubelet(trusted_dir / "bin"), "--config", str(config))
    for wide, offender in ((config, config), (config.parent, config.parent)):
        wide.chmod(0o666 if wide == config else 0o777)
        with running(argv) as kubelet:
            wait_for_cmdline(kubelet.pid, argv[0])
            host_proc.show(kubelet.pid)
            with pytest.raises(UntrustedPath) as refused:
                detect_plugin_dir(proc_root=host_proc.path)
        wide.chmod(0o644 if wide == config else 0o755)
        message = refused.value.message
        assert "\n" not in message and str(config) in message
        assert f"{offender} is writable by others" in message, message


def test_config_without_the_key_falls_through(roots: tuple[Path, Path]) -> None:
    proc, host = roots
    (host / "etc").mkdir()
    (host / "etc/os-release").write_text('NAME="Flatcar"\nID=flatcar\n')
    found = detect_plugin_dir(proc_root=proc, host_root=host)
    assert (found.path, found.rule) == ("/var/lib/kubelet/volumeplugins", "distribution default")


@needs_root
@pytest.mark.parametrize("where", ["trusted", "/tmp"])
def test_an_unprivileged_process_called_kubelet_is_not_kubelet(
    trusted_dir: Path, tmp_path: Path, host_proc: HostProc, where: str
) -> None:
    """The impostor of the issue: `exec -a kubelet` by nobody, naming a plugin directory;
    as nobody, even the real (root-owned) kubelet executable is not kubelet."""
    evil = trusted_dir / "evil" if where == "trusted" else tmp_path / "evil"
    script = f"exec -a kubelet bash -c 'sleep 60; :' kubelet {FLAG}={evil}"
    with running([*NOBODY, "bash", "-c", script]) as impostor:
        wait_for_cmdline(impostor.pid, "kubelet")
        assert detect_on_this_node(host_proc, impostor.pid)[1] != "kubelet command line"
    real = fake_kubelet(trusted_dir / "bin")
    with running([*NOBODY, *kubelet_argv(real, f"{FLAG}={evil}")]) as impostor:
        wait_for_cmdline(impostor.pid, str(real))
        host_proc.show(impostor.pid)
        found = detect_plugin_dir(proc_root=host_proc.path)
    assert found.rule != "kubelet command line" and found.path != str(evil)
    assert f"pid {impostor.pid}: runs as uid 65534" in found.detail


PAUSE = "#include <unistd.h>\nint main(void){for(;;)pause();}\n"
CHOSEN_BY_A_POD = "/etc/chosen-by-a-pod"


def container_rootfs(base: Path) -> Path:
    """What any container image looks like from the host: a root-owned 0755 tree, here with
    a static /usr/bin/kubelet that waits forever."""
    root = base / "ctr"
    (root / "usr/bin").mkdir(parents=True)
    (root / "old").mkdir()
    for directory in (root, root / "usr", root / "usr/bin", root / "old"):
        directory.chmod(0o755)
    (base / "pause.c").write_text(PAUSE)
    exe = root / "usr/bin/kubelet"
    subprocess.run(["gcc", "-static", "-O1", "-o", str(exe), str(base / "pause.c")], check=True)
    exe.chmod(0o755)
    return root


def pod_argv(how: str, root: Path, trusted_dir: Path) -> list[str]:
    """A root process calling itself kubelet and naming a plugin directory, in a container:
    its own mount namespace whose root is the image (pivot_root, as runc does), its own root
    only (chroot), or its own mount namespace only (unshare -m, the host's root-owned
    kubelet executable)."""
    flag = f"{FLAG}={CHOSEN_BY_A_POD}"
    if how == "pivot_root":
        script = (
            f"mount --bind {root} {root} && cd {root} && pivot_root . old && "
            f"exec -a /usr/bin/kubelet /usr/bin/kubelet {flag}"
        )
        return ["unshare", "-m", "--propagation", "private", "bash", "-c", script]
    if how == "chroot":
        return ["chroot", str(root), "/usr/bin/kubelet", flag]
    exe = fake_kubelet(trusted_dir / "bin")
    return ["unshare", "-m", "--propagation", "private", *kubelet_argv(exe, flag)]


@needs_root
@pytest.mark.parametrize("how", ["pivot_root", "chroot", "unshare -m"])
def test_a_root_process_in_a_container_is_not_the_hosts_kubelet(
    trusted_dir: Path, tmp_path: Path, host_proc: HostProc, how: str
) -> None:
    """A pod runs as uid 0 by default and its image is root's: believed as kubelet, its
    command line would override the real kubelet, which sets its plugin directory in its
    --config (the modern default). Only a process in pid 1's root and mount namespace is
    kubelet; the detail names the container and says a containerized kubelet needs
    --plugin-dir."""
    root = container_rootfs(tmp_path)
    plugins = trusted_dir / "from-config"
    config = trusted_dir / "config.yaml"
    config.write_text(f"volumePluginDir: {plugins}\n")
    config.chmod(0o644)
    real = kubelet_argv(fake_kubelet(trusted_dir / "bin"), f"--config={config}")
    pod = pod_argv(how, root, trusted_dir)
    pod_argv0 = "/usr/bin/kubelet" if how != "unshare -m" else pod[4]
    with running(pod) as container, running(real) as kubelet:
        wait_for_cmdline(container.pid, pod_argv0)
        wait_for_cmdline(kubelet.pid, real[0])
        host_proc.show(container.pid)
        host_proc.show(kubelet.pid)
        found = detect_plugin_dir(proc_root=host_proc.path)
        assert (found.path, found.rule) == (str(plugins), "kubelet config"), found.describe()
        kubelet.kill()
        kubelet.wait()
        found = detect_plugin_dir(proc_root=host_proc.path)
    assert found.path != CHOSEN_BY_A_POD and found.rule != "kubelet command line"
    why = f"pid {container.pid}: runs in another root or mount namespace than pid 1"
    assert why in found.detail and "needs --plugin-dir" in found.detail, found.detail
    assert "\n" not in found.detail


@needs_root
def test_no_process_is_kubelet_when_pid_1_cannot_be_read(
    trusted_dir: Path, host_proc: HostProc
) -> None:
    """Without the host's init to compare with, a kubelet on the host cannot be told from one
    in a container: none is believed, and the detail says to pass --plugin-dir."""
    (host_proc.path / "1").unlink()
    argv = kubelet_argv(fake_kubelet(trusted_dir / "bin"), f"{FLAG}={trusted_dir}/plugins")
    with running(argv) as kubelet:
        wait_for_cmdline(kubelet.pid, argv[0])
        host_proc.show(kubelet.pid)
        found = detect_plugin_dir(proc_root=host_proc.path)
    assert found.rule != "kubelet command line"
    assert f"pid {kubelet.pid}: pid 1 cannot be read" in found.detail
    assert "pass --plugin-dir" in found.detail


@needs_root
@pytest.mark.parametrize("weak", ["directory 0777", "directory 1777", "executable 0775"])
def test_a_root_owned_kubelet_that_others_may_replace_is_not_kubelet(
    trusted_dir: Path, host_proc: HostProc, weak: str
) -> None:
    exe = fake_kubelet(trusted_dir / "bin")
    if weak.startswith("directory"):
        exe.parent.chmod(int(weak.split()[1], 8))
    else:
        exe.chmod(0o775)
    offender = exe.parent if weak.startswith("directory") else exe
    argv = kubelet_argv(exe, f"{FLAG}={trusted_dir}/plugins")
    with running(argv) as kubelet:
        wait_for_cmdline(kubelet.pid, argv[0])
        host_proc.show(kubelet.pid)
        found = detect_plugin_dir(proc_root=host_proc.path)
    assert found.rule != "kubelet command line"
    assert f"pid {kubelet.pid}: {offender} is writable by others" in found.detail


@needs_root
@pytest.mark.parametrize("parent_mode", [0o777, 0o775, 0o1777])
def test_a_plugin_directory_below_a_directory_others_may_write_is_refused(
    trusted_dir: Path, host_proc: HostProc, parent_mode: int
) -> None:
    parent = trusted_dir / "open"
    parent.mkdir(mode=0o755)
    parent.chmod(parent_mode)
    plugins = parent / "kubernetes" / "volumeplugins"
    argv = kubelet_argv(fake_kubelet(trusted_dir / "bin"), f"{FLAG}={plugins}")
    with running(argv) as kubelet:
        wait_for_cmdline(kubelet.pid, argv[0])
        host_proc.show(kubelet.pid)
        with pytest.raises(UntrustedPath) as refused:
            detect_plugin_dir(proc_root=host_proc.path)
    message = refused.value.message
    assert "\n" not in message
    assert message.startswith(f"refusing the plugin directory {plugins} (kubelet command line")
    assert f"{parent} is writable by others (mode {parent_mode:04o})" in message


@needs_root
def test_a_plugin_directory_through_a_symlink_to_tmp_or_owned_by_a_user_is_refused(
    trusted_dir: Path, tmp_path: Path
) -> None:
    (trusted_dir / "link").symlink_to(tmp_path)
    with pytest.raises(UntrustedPath) as refused:
        detect_plugin_dir(f"{trusted_dir}/link/plugins")
    assert "/tmp is writable by others (mode 1777)" in refused.value.message
    owned = trusted_dir / "owned"
    owned.mkdir(mode=0o755)
    os.chown(owned, 65534, 65534)
    with pytest.raises(UntrustedPath) as refused:
        detect_plugin_dir(f"{owned}/plugins")
    assert f"{owned} is owned by uid 65534, not root" in refused.value.message


def test_a_distribution_default_below_a_wide_directory_is_refused(
    roots: tuple[Path, Path],
) -> None:
    proc, host = roots
    (host / "etc").mkdir()
    (host / "etc/os-release").write_text("ID=flatcar\n")
    (host / "var/lib").mkdir(parents=True)
    (host / "var").chmod(0o775)
    with pytest.raises(UntrustedPath) as refused:
        detect_plugin_dir(proc_root=proc, host_root=host)
    assert "/var is writable by others (mode 0775)" in refused.value.message


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


@needs_root
def test_install_without_plugin_dir_follows_the_running_kubelet(
    trusted_dir: Path, tmp_path: Path
) -> None:
    plugins = trusted_dir / "volumeplugins"
    config = tmp_path / "flexhub.toml"
    config.write_text(f'state_dir = "{trusted_dir}/state"\nlog_dir = "{tmp_path}/log"\n')
    argv = kubelet_argv(fake_kubelet(trusted_dir / "bin"), f"{FLAG}={plugins}")
    pid_file = tmp_path / "kubelet.pid"
    # a pid namespace of its own whose init is the install (as systemd is on a node), the
    # kubelet beside it in its root and mount namespace; both end with it
    script = (
        f"{shlex.join(argv)} & k=$!; echo $k > {pid_file}; "
        f"until tr '\\0' ' ' < /proc/$k/cmdline | grep -q '^{argv[0]} '; do sleep 0.05; done; "
        f"exec {PYTHON} -m flexhub install --config {config}"
    )
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "bash", "-c", script],
        env=dict(KUBELET_ENV),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    pid = pid_file.read_text().strip()
    assert f"plugin directory: {plugins} (kubelet command line: pid {pid}" in proc.stdout
    assert (plugins / "k8s~flexhub" / "flexhub").is_file()
    record = trusted_dir / "state" / "installed-k8s~flexhub.json"
    assert f'"plugin_dir": "{plugins}"' in record.read_text()
    assert record.stat().st_mode & 0o7777 == 0o644


@needs_root
def test_install_refuses_a_plugin_directory_others_may_write(tmp_path: Path) -> None:
    evil = tmp_path / "evil"
    config = tmp_path / "flexhub.toml"
    config.write_text(f'state_dir = "{tmp_path}/state"\n')
    proc = subprocess.run(
        [PYTHON, "-m", "flexhub", "install", "--plugin-dir", str(evil), "--config", str(config)],
        env=dict(KUBELET_ENV),
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert "/tmp is writable by others (mode 1777)" in proc.stdout + proc.stderr
    assert not evil.exists() and not (tmp_path / "state").exists()


@needs_root
def test_dot_dot_below_a_missing_directory_is_refused(trusted_dir: Path) -> None:
    """What kubelet reports is not normalised: a missing directory's '..' is not followed."""
    from flexhub.admin.trust import trusted_path

    with pytest.raises(UntrustedPath) as refused:
        trusted_path(f"{trusted_dir}/missing/../../../tmp/plugins", missing_ok=True)
    assert "'..' below the missing" in refused.value.message
    (trusted_dir / "bin").mkdir()
    (trusted_dir / "up").symlink_to("/tmp")
    assert (
        trusted_path(f"{trusted_dir}/bin/../plugins", missing_ok=True) == f"{trusted_dir}/plugins"
    )
    with pytest.raises(UntrustedPath, match="/tmp is writable by others"):
        trusted_path(f"{trusted_dir}/up/../run", missing_ok=True)  # '..' of /tmp is /


@needs_root
def test_install_makes_missing_directories_0755_whatever_the_umask(
    trusted_dir: Path, tmp_path: Path
) -> None:
    plugins = trusted_dir / "a" / "b" / "plugins"
    config = tmp_path / "flexhub.toml"
    config.write_text(f'state_dir = "{trusted_dir}/state"\n')
    proc = subprocess.run(
        [PYTHON, "-m", "flexhub", "install", "--plugin-dir", str(plugins), "--config", str(config)],
        env=dict(KUBELET_ENV),
        capture_output=True,
        text=True,
        check=False,
        preexec_fn=lambda: os.umask(0),
    )
    assert proc.returncode == 0, proc.stderr
    made = [trusted_dir / "a", trusted_dir / "a/b", plugins, plugins / "k8s~flexhub"]
    assert {f"{d.stat().st_mode & 0o7777:04o}" for d in made} == {"0755"}
    assert (trusted_dir / "state").stat().st_mode & 0o7777 == 0o700
    detect_plugin_dir(str(plugins))  # what it made is root's alone
