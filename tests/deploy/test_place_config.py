"""`flexhub daemonset --config-from`: the chart's ConfigMap reaches the host, where the
driver kubelet runs reads it; a config flexhub would refuse never gets there, nor one cut
short by a full disk; the path is held to the trust rule inside the host root; and a deploy
that fails leaves the host's config alone."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from flexhub.admin import deploy as deploy_mod
from flexhub.admin.deploy import place_config
from flexhub.config import load_config
from flexhub.errors import FlexhubError, UntrustedPath
from tests.conftest import needs_root


def test_the_config_is_written_whole_where_the_host_reads_it(tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    source = tmp_path / "flexhub.toml"
    source.write_text('state_dir = "/var/lib/flexhub"\n[loopfile]\nroot = "/srv/lf"\n')
    place_config(host, source, "/etc/flexhub/flexhub.toml")
    placed = host / "etc/flexhub/flexhub.toml"
    assert placed.read_bytes() == source.read_bytes()
    assert placed.stat().st_mode & 0o777 == 0o644
    # again, with another text, after a run killed midway: replaced, nothing left beside it
    (placed.parent / ".flexhub.toml.4242.partial").write_text("state_dir = ")
    source.write_text('log_level = "debug"\n')
    place_config(host, source, "/etc/flexhub/flexhub.toml")
    assert placed.read_text() == 'log_level = "debug"\n'
    assert [p.name for p in placed.parent.iterdir()] == ["flexhub.toml"]


@pytest.mark.parametrize(
    ("text", "says"),
    [("state_dir = relative\n", "not valid TOML"), ("state_dri = '/x'\n", "state_dri")],
)
def test_a_config_flexhub_refuses_never_reaches_the_host(
    tmp_path: Path, text: str, says: str
) -> None:
    host = tmp_path / "host"
    (host / "etc/flexhub").mkdir(parents=True)
    (host / "etc/flexhub/flexhub.toml").write_text("# the node's config so far\n")
    source = tmp_path / "flexhub.toml"
    source.write_text(text)
    with pytest.raises(FlexhubError, match=says) as caught:
        place_config(host, source, "/etc/flexhub/flexhub.toml")
    assert "\n" not in str(caught.value)
    assert (host / "etc/flexhub/flexhub.toml").read_text() == "# the node's config so far\n"
    assert [p.name for p in (host / "etc/flexhub").iterdir()] == ["flexhub.toml"]


def test_a_missing_configmap_file_and_a_relative_host_path_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(FlexhubError, match="cannot read the node config"):
        place_config(tmp_path, tmp_path / "absent.toml", "/etc/flexhub/flexhub.toml")
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(FlexhubError, match="absolute"):
        place_config(tmp_path, tmp_path / "c.toml", "etc/flexhub.toml")


@needs_root
def test_a_short_write_never_replaces_the_config(tmp_path: Path) -> None:
    """On a nearly full /etc the write is cut after one page: a config cut at a line end is
    still valid TOML with other settings, so it must never be renamed over the good one."""
    host = tmp_path / "host"
    etc = host / "etc/flexhub"
    etc.mkdir(parents=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k,mode=0755", "tiny", str(etc)], check=True
    )
    try:
        good = 'state_dir = "/srv/flexhub-state"\n'
        (etc / "flexhub.toml").write_text(good)
        (etc / "filler").write_bytes(b"\0" * 8192)  # one page left
        source = tmp_path / "flexhub.toml"
        source.write_text("# " + "x" * 4093 + "\n" + good)
        with pytest.raises(FlexhubError, match="No space left on device") as caught:
            place_config(host, source, "/etc/flexhub/flexhub.toml")
        assert "\n" not in str(caught.value)
        assert (etc / "flexhub.toml").read_text() == good
        assert load_config(etc / "flexhub.toml").state_dir == Path("/srv/flexhub-state")
        assert sorted(p.name for p in etc.iterdir()) == ["filler", "flexhub.toml"]
    finally:
        subprocess.run(["umount", str(etc)], check=True)


def test_a_host_symlink_is_followed_inside_the_host_root(tmp_path: Path) -> None:
    """/etc/flexhub -> /srv/flexhub-etc on the host (absolute, as an admin or ostree makes
    it) is /host/srv/flexhub-etc, never the DaemonSet container's own /srv; the missing
    directories are made 0755 whatever the umask."""
    host = tmp_path / "host"
    (host / "etc").mkdir(parents=True)
    os.symlink("/srv/flexhub-etc", host / "etc/flexhub")
    source = tmp_path / "flexhub.toml"
    source.write_text('state_dir = "/var/lib/flexhub"\n')
    old = os.umask(0o077)
    try:
        place_config(host, source, "/etc/flexhub/flexhub.toml")
    finally:
        os.umask(old)
    placed = host / "srv/flexhub-etc/flexhub.toml"
    assert placed.read_bytes() == source.read_bytes()
    assert not os.path.lexists("/srv/flexhub-etc/flexhub.toml")
    made = [host / "srv", host / "srv/flexhub-etc"]
    assert {f"{d.stat().st_mode & 0o7777:04o}" for d in made} == {"0755"}
    assert placed.stat().st_mode & 0o7777 == 0o644


@needs_root
@pytest.mark.parametrize("weak", ["owned by nobody", "mode 0777"])
def test_a_config_directory_others_may_write_is_refused(tmp_path: Path, weak: str) -> None:
    """The config decides state_dir and the loopfile root of the root driver: a directory in
    which another user may rename a file over it is refused, like a plugin directory."""
    host = tmp_path / "host"
    etc = host / "etc/flexhub"
    etc.mkdir(parents=True)
    (etc / "flexhub.toml").write_text("# the node's config so far\n")
    if weak == "owned by nobody":
        os.chown(etc, 65534, 65534)
    else:
        etc.chmod(0o777)
    source = tmp_path / "flexhub.toml"
    source.write_text('state_dir = "/var/lib/flexhub"\n')
    with pytest.raises(UntrustedPath) as refused:
        place_config(host, source, "/etc/flexhub/flexhub.toml")
    message = refused.value.message
    says = "is owned by uid 65534, not root" if weak == "owned by nobody" else "mode 0777"
    assert "\n" not in message and says in message and "/etc/flexhub" in message
    assert (etc / "flexhub.toml").read_text() == "# the node's config so far\n"
    assert [p.name for p in etc.iterdir()] == ["flexhub.toml"]


def test_a_failed_deploy_leaves_the_hosts_config_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the install fails (here the plugin directory is refused) the host keeps the
    config the running driver reads: the new one is written only after the new driver's
    init answered. The runtime copy is stubbed (no runtime is built here); the plugin
    directory rule and place_config are real."""
    host = tmp_path / "host"
    (host / "etc/flexhub").mkdir(parents=True)
    host.chmod(0o755)
    (host / "tmp").mkdir()
    (host / "tmp").chmod(0o1777)
    old = "# the config the running driver reads\n"
    (host / "etc/flexhub/flexhub.toml").write_text(old)
    source = tmp_path / "new.toml"
    source.write_text('state_dir = "/srv/new-state"\n')
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    monkeypatch.setattr(deploy_mod, "current_runtime", lambda: runtime)
    monkeypatch.setattr(deploy_mod, "copy_runtime", lambda *a: "/var/lib/flexhub/runtime/r1")
    monkeypatch.setattr(deploy_mod, "read_marker", lambda p: {"name": "r1"})
    with pytest.raises(UntrustedPath, match="/tmp is writable by others"):
        deploy_mod.deploy(
            host_root=host,
            plugin_dir="/tmp/not-trusted",
            config="/etc/flexhub/flexhub.toml",
            config_from=source,
        )
    assert (host / "etc/flexhub/flexhub.toml").read_text() == old
    assert [p.name for p in (host / "etc/flexhub").iterdir()] == ["flexhub.toml"]
    # a config flexhub refuses stops the deploy before anything is copied
    source.write_text("state_dri = '/x'\n")
    monkeypatch.setattr(deploy_mod, "copy_runtime", lambda *a: pytest.fail("copied"))
    with pytest.raises(FlexhubError, match="state_dri"):
        deploy_mod.deploy(host_root=host, config="/etc/flexhub/flexhub.toml", config_from=source)
