"""Unit tests of the iscsi backend: masking, reference counts, bad input, journal details.

Nothing here touches the machine: sysfs is a tree under ``tmp_path`` and iscsiadm is played
by :class:`FakeIscsi`, whose effects (sessions, disks, maps, open-iscsi's record files) the
tests check. What a real node shows (the node record's settings, the LUNs scanned, logouts,
node records removed, sessions kept for another LUN) is checked on a real kernel in
``tests/vm/test_iscsi*.py``; the few argv checks left here are for logic no real system here
shows (a command that must not run, the order of a flush), and their docstrings say so.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from pathlib import Path

import pytest
from flexhub_iscsi import IscsiBackend
from flexhub_iscsi._options import Portal, dedicated_iface, parse_portal, parse_target
from flexhub_iscsi._reservation import format_key, node_key
from flexhub_iscsi._sysfs import Sysfs

from flexhub.backend import (
    Attachment,
    CommandTimeout,
    InvalidOptions,
    ReleaseDeferred,
    Volume,
    VolumeError,
)
from flexhub.driver.validation import validate_options
from flexhub.errors import FlexhubError
from flexhub.node import Node
from flexhub.node.journal import VolumeRecord
from flexhub.node.runner import Result
from flexhub.volume import PodInfo

from .conftest import IQN, FakeIscsi, FakeSysfs, MiB

PASSWORD = "s3cr3t-Pa55word"
USERNAME = "chap-user-7"
PASSWORD_IN = "mutual-Pa55-in"
USERNAME_IN = "target-user-in"
DISC_PASSWORD = "d1sc-Pa55word"
DISC_USERNAME = "disc-user-3"
ALL_SECRETS = (PASSWORD, USERNAME, PASSWORD_IN, USERNAME_IN, DISC_PASSWORD, DISC_USERNAME)

SESSION_SECRETS = {
    "node.session.auth.username": USERNAME,
    "node.session.auth.password": PASSWORD,
}
DISCOVERY_SECRETS = {
    "discovery.sendtargets.auth.username": DISC_USERNAME,
    "discovery.sendtargets.auth.password": DISC_PASSWORD,
}


def options(**extra: str) -> dict[str, str]:
    base = {"backend": "iscsi", "targetPortal": "127.0.0.1", "iqn": IQN, "lun": "0"}
    base.update(extra)
    return base


def make_volume(secrets: dict[str, str] | None = None, *, pod: bool = True, **extra: str) -> Volume:
    from flexhub.volume import Secret, Secrets

    return Volume(
        options=options(**extra),
        fs_type="ext4",
        pod=PodInfo(name="p", namespace="ns", uid="u") if pod else None,
        secrets=Secrets({k: Secret(v) for k, v in (secrets or {}).items()}),
    )


def flat(calls: list[list[str]]) -> str:
    return "\n".join(" ".join(c) for c in calls)


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("text", "portal"),
    [
        ("10.0.0.5", Portal("10.0.0.5", 3260)),
        ("10.0.0.5:3261", Portal("10.0.0.5", 3261)),
        ("[fd00::5]", Portal("fd00::5", 3260)),
        ("[FD00::5]:3262", Portal("fd00::5", 3262)),
        ("storage.example.com", Portal("storage.example.com", 3260)),
    ],
)
def test_parse_portal(text: str, portal: Portal) -> None:
    assert parse_portal(text) == portal


def test_portal_str_brackets_ipv6() -> None:
    assert str(Portal("fd00::5", 3260)) == "[fd00::5]:3260"
    assert str(Portal("10.0.0.5", 3260)) == "10.0.0.5:3260"


@pytest.mark.parametrize("text", ["fd00::5", "[fd00::5", "host:0", "host:70000", ":3260"])
def test_parse_portal_refuses(text: str) -> None:
    with pytest.raises(InvalidOptions):
        parse_portal(text)


def test_target_portals_deduplicated_first_is_target_portal() -> None:
    target = parse_target(
        options(targetPortal="10.0.0.1", portals="10.0.0.2:3260, 10.0.0.1:3260,[fd00::1]")
    )
    assert [str(p) for p in target.portals] == ["10.0.0.1:3260", "10.0.0.2:3260", "[fd00::1]:3260"]
    assert target.volume_id == f"iscsi:{IQN}:0"


def test_volume_id_ignores_portals(backend: IscsiBackend) -> None:
    one = make_volume(targetPortal="10.0.0.1")
    two = make_volume(targetPortal="10.0.0.2", portals="10.0.0.1")
    assert backend.volume_id(one) == backend.volume_id(two) == f"iscsi:{IQN}:0"


GOOD = [
    options(),
    options(
        targetPortal="[fd00::1]:3260",
        portals="10.0.0.2,10.0.0.3:3261",
        iqn="iqn.2001-05.com.example:storage.disk2.sys1.xyz",
        lun="16383",
        iscsiInterface="iface0",
        initiatorName="iqn.2024-02.io.node:worker-1",
        chapAuthDiscovery="true",
        chapAuthSession="false",
        mountOptions="noatime,discard",
    ),
    options(iqn="eui.02004567A425678D"),
    options(iqn="naa.52004567BA64678D"),
    options(iqn="naa.6001405c0f7e8e2b4e2b4f6a8bb9f3c1"),
]

BAD = [
    ({"lun": "16384"}, "lun"),
    ({"lun": "-1"}, "lun"),
    ({"lun": "01"}, "lun"),
    ({"iqn": "iqn.2024-13.org.example:x"}, "iqn"),
    ({"iqn": "iqn.24-01.org.example"}, "iqn"),
    ({"iqn": "eui.1234"}, "iqn"),
    ({"iqn": "naa.123"}, "iqn"),
    ({"iqn": f"{IQN} -o delete"}, "iqn"),
    ({"targetPortal": "fd00::1"}, "targetPortal"),
    ({"targetPortal": "10.0.0.1:99999"}, "targetPortal"),
    ({"targetPortal": "-p"}, "targetPortal"),
    ({"portals": "10.0.0.1;10.0.0.2"}, "portals"),
    ({"chapAuthSession": "yes"}, "chapAuthSession"),
    ({"iscsiInterface": "../x"}, "iscsiInterface"),
    ({"initiatorName": "worker-1"}, "initiatorName"),
    ({"mountOptions": "remount"}, "mountOptions"),
    ({"secretRef": "x"}, "secretRef"),
]


@pytest.mark.parametrize("opts", GOOD)
def test_schema_accepts(opts: dict[str, str]) -> None:
    validate_options(IscsiBackend, {**opts, "kubernetes.io/fsType": "xfs"})


@pytest.mark.parametrize(("change", "key"), BAD)
def test_schema_refuses(change: dict[str, str], key: str) -> None:
    with pytest.raises(InvalidOptions) as info:
        validate_options(IscsiBackend, {**options(), **change})
    assert key in str(info.value)


@pytest.mark.parametrize("missing", ["targetPortal", "iqn", "lun"])
def test_schema_requires(missing: str) -> None:
    opts = options()
    del opts[missing]
    with pytest.raises(InvalidOptions, match=missing):
        validate_options(IscsiBackend, opts)


def test_schema_file_is_the_shared_one() -> None:
    import flexhub_iscsi

    link = Path(flexhub_iscsi.__file__).parent / "schema.json"
    assert link.is_symlink() and os.readlink(link) == "../../../schemas/iscsi.json"
    assert IscsiBackend.schema()["$id"] == "https://flexhub.invalid/schemas/iscsi.json"


# --------------------------------------------------------------------------- check


@pytest.mark.parametrize(
    ("flags", "secrets", "missing"),
    [
        ({"chapAuthSession": "true"}, {}, "node.session.auth.username"),
        (
            {"chapAuthSession": "true"},
            {"node.session.auth.username": USERNAME},
            "node.session.auth.password",
        ),
        (
            {"chapAuthDiscovery": "true"},
            {"discovery.sendtargets.auth.username": DISC_USERNAME},
            "discovery.sendtargets.auth.password",
        ),
        (
            {"chapAuthSession": "true"},
            {**SESSION_SECRETS, "node.session.auth.username_in": USERNAME_IN},
            "node.session.auth.password_in",
        ),
        (
            {"chapAuthDiscovery": "true", "chapAuthSession": "true"},
            {**SESSION_SECRETS, "discovery.sendtargets.auth.password": DISC_PASSWORD},
            "discovery.sendtargets.auth.username",
        ),
    ],
)
def test_check_names_missing_chap_key_not_values(
    backend: IscsiBackend,
    runner: FakeIscsi,
    flags: dict[str, str],
    secrets: dict[str, str],
    missing: str,
) -> None:
    with pytest.raises(InvalidOptions) as info:
        backend.check(make_volume(secrets, **flags))
    assert missing in str(info.value)
    for value in ALL_SECRETS:
        assert value not in str(info.value)
    assert runner.calls == []


def test_check_without_pod_does_not_need_secrets(backend: IscsiBackend) -> None:
    # expandfs carries no secrets (kubelet sends them to mount only)
    backend.check(make_volume({}, pod=False, chapAuthSession="true", chapAuthDiscovery="true"))


def test_check_refuses_bad_node_config(tmp_path: Path) -> None:
    from flexhub.config import NodeConfig

    config = NodeConfig(state_dir=tmp_path, backends={"iscsi": {"device_timeout": -1}})
    with pytest.raises(FlexhubError, match="device_timeout"):
        IscsiBackend(Node(config, backend="iscsi")).check(make_volume())
    config = NodeConfig(state_dir=tmp_path, backends={"iscsi": {"device_timout": 3}})
    with pytest.raises(FlexhubError, match="device_timout"):
        IscsiBackend(Node(config, backend="iscsi")).check(make_volume())


def test_bad_options_fail_before_any_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through kubelet's entry point: an invalid iqn is a Failure and runs nothing."""
    import subprocess

    from flexhub.driver import kubelet

    ran: list[object] = []
    # the runner imports subprocess when its first command runs: patch the module itself
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: ran.append(a))
    config = tmp_path / "flexhub.toml"
    config.write_text(f'state_dir = "{tmp_path}/state"\nlog_dir = "{tmp_path}/log"\n')
    monkeypatch.setenv("FLEXHUB_CONFIG", str(config))
    monkeypatch.setattr(kubelet, "_CONFIG", [])
    target = tmp_path / "pod"
    target.mkdir()
    for bad in ({"iqn": "not-an-iqn"}, {"lun": "99999"}, {"chapAuthSession": "true"}):
        opts = {
            **options(**bad),
            "kubernetes.io/pod.uid": "u",
            "kubernetes.io/secret/node.session.auth.username": "dXNlcg==",
        }
        call = kubelet.Call(operation="mount")
        reply = kubelet.handle([str(target), json.dumps(opts)], call)
        assert reply.status == "Failure", reply
        assert ran == []
    assert "node.session.auth.password" in reply.message


# --------------------------------------------------------------------------- attach


def test_attach_details_without_chap(backend: IscsiBackend, runner: FakeIscsi) -> None:
    """The journal details of an attach. Its effect on a node (the record's settings, one
    session, only the LUN asked for scanned) is in
    ``tests/vm/test_iscsi_attach.py::test_attach_sets_the_record_and_scans_only_its_lun``."""
    attachment = backend.attach(make_volume())
    assert len(backend.sysfs.sessions()) == 1
    assert attachment.device == str(backend.sysfs.dev / "sda")
    assert dict(attachment.details) == {
        "iqn": IQN,
        "lun": "0",
        "iface": "default",
        "portals": "127.0.0.1:3260",
        "devices": "sda",
        "multipath": "",
        "iface_created": "false",
        "reservation": format_key(node_key(backend.node.state_dir)),
    }
    # only the requested LUN was scanned, on the one session
    assert [lun for _, lun in backend.sysfs.scans] == [0]  # type: ignore[attr-defined]


def test_scan_writes_one_lun_triple(tmp_path: Path) -> None:
    fake = FakeSysfs(tmp_path / "sys", tmp_path / "dev")
    session = fake.add_session(IQN, "127.0.0.1:3260")
    Sysfs.scan(fake, session, 7)
    scan = tmp_path / "sys" / "class" / "scsi_host" / f"host{session.host}" / "scan"
    assert scan.read_text() == "0 0 7"


def test_attach_with_chap_masks_every_value(backend: IscsiBackend, runner: FakeIscsi) -> None:
    """No CHAP value in the runner's log (masking) or on any argv, the values in the record
    files only. The argv check stays a transcript for the unit; on a real node
    ``tests/vm/test_iscsi_security.py`` samples every process's argv while flexhub runs."""
    secrets = {
        **SESSION_SECRETS,
        **DISCOVERY_SECRETS,
        "node.session.auth.username_in": USERNAME_IN,
        "node.session.auth.password_in": PASSWORD_IN,
    }
    volume = make_volume(secrets, chapAuthSession="true", chapAuthDiscovery="true")
    backend.check(volume)
    attachment = backend.attach(volume)
    text = flat(runner.calls)
    for value in ALL_SECRETS:
        assert value not in text
        assert value not in json.dumps(dict(attachment.details))
    # no CHAP value ever reached any command line: they are in open-iscsi's record files
    for raw in runner.raw:
        for value in ALL_SECRETS:
            assert value not in " ".join(raw)
    assert runner.etc is not None
    st_config = runner.etc / "send_targets" / "127.0.0.1,3260" / "st_config"
    text = st_config.read_text()
    assert DISC_PASSWORD not in text and DISC_USERNAME not in text  # forgotten afterwards
    record = runner.etc / "nodes" / IQN / "127.0.0.1,3260,1" / "default"
    lines = record.read_text().splitlines()
    assert f"node.session.auth.password = {PASSWORD}" in lines
    assert f"node.session.auth.username = {USERNAME}" in lines
    assert f"node.session.auth.password_in = {PASSWORD_IN}" in lines
    assert lines[-1] == "# END RECORD"
    assert record.stat().st_mode & 0o777 == 0o600
    assert not [p for p in (runner.etc / "nodes" / IQN).iterdir() if p.name.startswith(".")]


def test_login_error_echoing_secret_is_scrubbed(backend: IscsiBackend, runner: FakeIscsi) -> None:
    runner.answer(
        "--login",
        rc=24,
        stderr=f"iscsiadm: Login failed: user {USERNAME} password {PASSWORD} rejected",
    )
    volume = make_volume(SESSION_SECRETS, chapAuthSession="true")
    with pytest.raises(VolumeError) as info:
        backend.attach(volume)
    message = str(info.value)
    assert "authentication failed" in message and "CHAP" in message
    assert PASSWORD not in message and USERNAME not in message
    assert backend.sysfs.sessions() == []


def test_timeout_message_is_scrubbed(backend: IscsiBackend, runner: FakeIscsi) -> None:
    """Transcript (a timeout whose text holds a CHAP value cannot be provoked on a real target):
    the runner's timeout carries what iscsiadm had printed, here the session password; the
    VolumeError must not."""
    from flexhub.errors import CommandTimeout

    def hang(args: tuple[str, ...]) -> object:
        raise CommandTimeout(
            f"iscsiadm {' '.join(args)} timed out; output: node.session.auth.password = {PASSWORD}"
        )

    runner.answers.append((("--login",), hang))  # type: ignore[arg-type]
    with pytest.raises(VolumeError) as info:
        backend.attach(make_volume(SESSION_SECRETS, chapAuthSession="true"))
    assert PASSWORD not in str(info.value) and "timed out" in str(info.value)


def test_one_portal_failing_is_tolerated(backend: IscsiBackend, runner: FakeIscsi) -> None:
    runner.answer("127.0.0.2:3260", "discovery", rc=4, stderr="connection refused")
    attachment = backend.attach(make_volume(portals="127.0.0.2"))
    assert attachment.details["portals"] == "127.0.0.1:3260"
    assert attachment.device.endswith("/sda")


def test_sendtargets_discoveries_never_overlap(backend: IscsiBackend, runner: FakeIscsi) -> None:
    """Transcript, because the race needs load to show on a real target: open-iscsi opens every
    SendTargets session with the same initiator name and ISID, and LIO drops the first of two
    concurrent ones ("iSCSI PDU timed out"; seen in the VM rig, where the multipath test lost
    a path under load). The portals of one attach are discovered one at a time."""
    busy: list[tuple[float, float]] = []
    guard = threading.Lock()

    def slow_discovery(args: tuple[str, ...]) -> Result:
        started = time.monotonic()
        time.sleep(0.2)
        with guard:
            busy.append((started, time.monotonic()))
        return Result(args, 0, "", "")

    runner.answers.append((("discovery",), slow_discovery))
    attachment = backend.attach(make_volume(portals="127.0.0.2,127.0.0.3"))
    assert attachment.details["portals"] == "127.0.0.1:3260,127.0.0.2:3260,127.0.0.3:3260"
    busy.sort()
    assert len(busy) == 3
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(busy)), busy


def test_every_portal_failing_is_a_failure_naming_each(
    backend: IscsiBackend, runner: FakeIscsi
) -> None:
    runner.answer("discovery", rc=4, stderr="iscsiadm: cannot make connection")
    with pytest.raises(VolumeError) as info:
        backend.attach(make_volume(portals="127.0.0.2"))
    assert "127.0.0.1:3260" in str(info.value) and "127.0.0.2:3260" in str(info.value)
    assert backend.sysfs.sessions() == []  # on a node: test_iscsi_attach.py


def test_existing_session_is_reused(backend: IscsiBackend, runner: FakeIscsi) -> None:
    """No iscsiadm at all when the session and the disk are there: a command that must not
    run is logic (a transcript); the shared session itself is shown on a real node by
    ``tests/vm/test_iscsi.py::test_two_luns_refcount_and_remount``."""
    sysfs: FakeSysfs = backend.sysfs  # type: ignore[assignment]
    session = sysfs.add_session(IQN, "127.0.0.1:3260")
    sysfs.add_disk(session, 1)
    attachment = backend.attach(make_volume())
    assert runner.iscsiadm_calls() == []
    assert attachment.details["portals"] == "127.0.0.1:3260"
    # attach again (idempotent): same device, still no command
    again = backend.attach(make_volume())
    assert again.device == attachment.device and runner.iscsiadm_calls() == []


def test_missing_lun_times_out_and_logs_out(backend: IscsiBackend, runner: FakeIscsi) -> None:
    with pytest.raises(VolumeError, match=r"LUN 5 .* did not appear within 0.5s"):
        backend.attach(make_volume(lun="5"))
    assert backend.sysfs.sessions() == []
    assert runner.node_files(IQN) == []  # on a node: test_iscsi_attach.py


def test_failed_attach_keeps_session_of_other_lun(backend: IscsiBackend, runner: FakeIscsi) -> None:
    sysfs: FakeSysfs = backend.sysfs  # type: ignore[assignment]
    session = sysfs.add_session(IQN, "127.0.0.1:3260")
    sysfs.add_disk(session, 1)
    with pytest.raises(VolumeError):
        backend.attach(make_volume(lun="5"))
    assert len(sysfs.sessions()) == 1  # on a node: test_iscsi_attach.py


# --------------------------------------------------------------------------- multipath


def two_portal_attach(backend: IscsiBackend, runner: FakeIscsi, *, mpath: bool) -> Attachment:
    sysfs: FakeSysfs = backend.sysfs  # type: ignore[assignment]
    runner.multipathd = mpath

    def daemon(args: tuple[str, ...]) -> object:
        from flexhub.node.runner import Result

        disks = [d for s in sysfs.sessions() for d in sysfs.lun_disks(s, 0)]
        if len(disks) == 2 and sysfs.find_map("mpatha") is None:
            sysfs.add_map("mpatha", disks)
        return Result(args, 0, "pid 42 idle\n", "")

    if mpath:
        runner.answers.append((("show", "daemon"), daemon))  # type: ignore[arg-type]
    return backend.attach(make_volume(portals="127.0.0.2:3260"))


def test_two_paths_with_multipathd_use_the_map(backend: IscsiBackend, runner: FakeIscsi) -> None:
    attachment = two_portal_attach(backend, runner, mpath=True)
    assert attachment.device == str(backend.sysfs.dev / "dm-0")
    assert attachment.details["multipath"] == "mpatha"
    assert attachment.details["devices"] == "sda,sdb"
    assert attachment.details["portals"] == "127.0.0.1:3260,127.0.0.2:3260"
    backend.detach(attachment)
    assert backend.sysfs.find_map("mpatha") is None
    # the map is flushed before anything else (an order no real system here shows)
    flushes = [c for c in runner.calls if c[:2] == ["blockdev", "--flushbufs"]]
    assert flushes[0][-1].endswith("/dm-0")
    assert backend.sysfs.sessions() == []


def test_two_paths_without_multipathd_use_the_first(
    backend: IscsiBackend, runner: FakeIscsi
) -> None:
    attachment = two_portal_attach(backend, runner, mpath=False)
    assert attachment.device == str(backend.sysfs.dev / "sda")
    assert attachment.details["multipath"] == ""
    assert attachment.details["devices"] == "sda,sdb"


# --------------------------------------------------------------------------- detach


def journal_staged(node: Node, lun: int, staging: str) -> None:
    node.journal.put_volume(
        VolumeRecord(
            f"iscsi:{IQN}:{lun}",
            "iscsi",
            "/dev/sdz",
            staging,
            "ext4",
            {"iqn": IQN, "lun": str(lun), "iface": "default"},
        )
    )


def test_detach_keeps_session_while_another_lun_is_used(
    backend: IscsiBackend, runner: FakeIscsi
) -> None:
    """On a real node: ``tests/vm/test_iscsi.py::test_two_luns_refcount_and_remount`` (and,
    with an attach in flight, ``tests/vm/test_iscsi_concurrency.py``)."""
    zero = backend.attach(make_volume(lun="0"))
    one = backend.attach(make_volume(lun="1"))
    assert len(backend.sysfs.sessions()) == 1
    backend.detach(zero)
    assert len(backend.sysfs.sessions()) == 1
    assert runner.node_files(IQN) == ["127.0.0.1,3260,1/default"]
    assert backend.sysfs.deleted == ["sda"]  # type: ignore[attr-defined]
    backend.detach(one)
    assert backend.sysfs.sessions() == []
    assert runner.node_files(IQN) == []


def test_detach_counts_journal_of_a_staged_lun(
    backend: IscsiBackend, runner: FakeIscsi, node: Node
) -> None:
    zero = backend.attach(make_volume(lun="0"))
    journal_staged(node, 1, "/")  # LUN 1 staged (its disk may be failing): "/" is a mount
    backend.detach(zero)
    assert len(backend.sysfs.sessions()) == 1


def test_detach_ignores_stale_journal_records(
    backend: IscsiBackend, runner: FakeIscsi, node: Node, tmp_path: Path
) -> None:
    zero = backend.attach(make_volume(lun="0"))
    journal_staged(node, 1, str(tmp_path / "not-mounted"))  # after a reboot, say
    backend.detach(zero)
    assert backend.sysfs.sessions() == [] and runner.node_files(IQN) == []


def test_detach_after_reboot_tolerates_no_session(backend: IscsiBackend, runner: FakeIscsi) -> None:
    attachment = Attachment(
        "/dev/sdq", {"iqn": IQN, "lun": "0", "iface": "default", "portals": "127.0.0.1:3260"}
    )
    backend.detach(attachment)  # No matching sessions (21): fine
    backend.detach(attachment)
    assert backend.sysfs.deleted == []  # type: ignore[attr-defined]


def test_detach_never_deletes_a_disk_of_another_target(
    backend: IscsiBackend, runner: FakeIscsi
) -> None:
    sysfs: FakeSysfs = backend.sysfs  # type: ignore[assignment]
    other = sysfs.add_session("iqn.2024-01.org.example:other", "127.0.0.1:3260")
    sysfs.add_disk(other, 0)  # sda now belongs to another target
    attachment = Attachment("/dev/sda", {"iqn": IQN, "lun": "0", "devices": "sda"})
    backend.detach(attachment)
    assert sysfs.deleted == []


def test_detach_failed_logout_is_reported(backend: IscsiBackend, runner: FakeIscsi) -> None:
    attachment = backend.attach(make_volume())
    runner.answer("--logout", rc=10, stderr="iscsiadm: logout failed")
    with pytest.raises(VolumeError, match="still logged in"):
        backend.detach(attachment)


def test_detach_without_details_is_an_error(backend: IscsiBackend) -> None:
    with pytest.raises(VolumeError, match="no target"):
        backend.detach(Attachment("/dev/sda", {}))


# --------------------------------------------------------------------------- iface


def test_initiator_name_makes_and_removes_a_dedicated_iface(
    backend: IscsiBackend, runner: FakeIscsi
) -> None:
    """Which settings of the base iface are copied (tcp, not an unset MTU) is logic, checked
    on the argv; the iface's effect (the session logs in under the name, the iface is gone
    after the unmount) is in ``tests/vm/test_iscsi_attach.py``."""
    name = "iqn.2024-02.io.node:worker-1"
    iface = dedicated_iface("default", name)
    runner.answer("iface", iface, "show", rc=21, stderr="iscsiadm: Could not read iface")
    runner.answer(
        "iface",
        "default",
        "show",
        stdout="iface.iscsi_ifacename = default\niface.transport_name = tcp\n"
        "iface.initiatorname = <empty>\niface.mtu = 0\n",
    )
    attachment = backend.attach(make_volume(initiatorName=name))
    assert attachment.details["iface"] == iface and attachment.details["iface_created"] == "true"
    cmds = runner.iscsiadm_calls()
    upd = ["iscsiadm", "-m", "iface", "-I", iface, "-o", "update", "-n"]
    assert ["iscsiadm", "-m", "iface", "-I", iface, "-o", "new"] in cmds
    assert [*upd, "iface.transport_name", "-v", "tcp"] in cmds
    assert [*upd, "iface.initiatorname", "-v", name] in cmds
    assert not any("iface.mtu" in c for c in cmds)
    assert all(c[c.index("-I") + 1] == iface for c in cmds if "-m" in c and "node" in c)
    backend.detach(attachment)
    assert runner.iscsiadm_calls()[-1] == ["iscsiadm", "-m", "iface", "-I", iface, "-o", "delete"]


def test_missing_iface_is_invalid_options(backend: IscsiBackend, runner: FakeIscsi) -> None:
    runner.answer("iface", "eth9", "show", rc=21, stderr="iscsiadm: Could not read iface eth9")
    with pytest.raises(InvalidOptions, match="eth9"):
        backend.attach(make_volume(iscsiInterface="eth9"))
    assert backend.sysfs.sessions() == []  # on a node: test_iscsi_attach.py


# --------------------------------------------------------------------------- expand


def test_expand_rescans_and_checks_the_size(backend: IscsiBackend, runner: FakeIscsi) -> None:
    sysfs: FakeSysfs = backend.sysfs  # type: ignore[assignment]
    attachment = backend.attach(make_volume())
    sysfs.exported[IQN][0] = 128 * MiB
    backend.expand(attachment, make_volume(pod=False), 128 * MiB)
    assert sysfs.size("sda") == 128 * MiB


def test_expand_refuses_when_the_lun_did_not_grow(backend: IscsiBackend, runner: FakeIscsi) -> None:
    attachment = backend.attach(make_volume())
    with pytest.raises(VolumeError, match="grow the LUN on the target first"):
        backend.expand(attachment, make_volume(pod=False), 128 * MiB)


def test_expand_resizes_the_multipath_map(backend: IscsiBackend, runner: FakeIscsi) -> None:
    """A transcript: no VM test grows a LUN under multipath yet (growth of a plain LUN is in
    ``tests/vm/test_iscsi.py`` and ``test_iscsi_crash_xfs.py``)."""
    sysfs: FakeSysfs = backend.sysfs  # type: ignore[assignment]
    attachment = two_portal_attach(backend, runner, mpath=True)
    sysfs.exported[IQN][0] = 96 * MiB

    def resize(args: tuple[str, ...]) -> object:
        from flexhub.node.runner import Result

        sysfs.set_size("dm-0", 96 * MiB)
        return Result(args, 0, "ok\n", "")

    runner.answers.append((("resize", "map"), resize))  # type: ignore[arg-type]
    backend.expand(attachment, make_volume(pod=False), 96 * MiB)
    assert ["multipathd", "resize", "map", "mpatha"] in runner.calls


# --------------------------------------------------------------------------- interrupted attach


def test_attach_reports_its_progress_without_a_secret(
    backend: IscsiBackend, node: Node, runner: FakeIscsi
) -> None:
    reports: list[tuple[int, dict[str, str]]] = []
    node.progress = lambda details: reports.append((len(runner.calls), dict(details)))
    volume = make_volume(SESSION_SECRETS, chapAuthSession="true", portals="127.0.0.2:3260")
    backend.attach(volume)
    # the target before any command (a crash in the login is undone), then the device, and
    # the reservation key before it is registered (a crash in the fencing unregisters it)
    assert reports[0] == (
        0,
        {"iqn": IQN, "lun": "0", "iface": "default", "portals": "127.0.0.1:3260,127.0.0.2:3260"},
    )
    assert reports[-2][1] == {"multipath": ""}
    at, last = reports[-1]
    assert list(last) == ["reservation"]
    registering = next(i for i, c in enumerate(runner.calls) if "--register-ignore" in c)
    assert at <= registering
    for value in ALL_SECRETS:
        assert value not in json.dumps(reports)


def test_an_attach_killed_after_login_is_released_without_logging_in_again(
    backend: IscsiBackend, node: Node, runner: FakeIscsi, sysfs: FakeSysfs, tmp_path: Path
) -> None:
    # A CHAP mount was SIGKILLed after the login, before its journal record: the journal
    # holds the intent and what the attach reported. unmount has no secret to log in with.
    from flexhub.node.journal import PodRecord
    from flexhub.node.volumes import staging_dir, unmount_volume

    reports: dict[str, str] = {}
    node.progress = reports.update
    volume = make_volume(SESSION_SECRETS, chapAuthSession="true", portals="127.0.0.2:3260")
    volume_id = backend.volume_id(volume)
    backend.attach(volume)
    node.progress = None
    assert len(sysfs.sessions_of(IQN, "default")) == 2
    target = tmp_path / "pod" / "vol"
    target.mkdir(parents=True)
    staging = str(staging_dir(node, volume_id))
    node.journal.put_pod(PodRecord(str(target), "iscsi", volume_id, staging))
    node.journal.put_volume(
        VolumeRecord(
            volume_id, "iscsi", "", staging, "ext4", options=dict(volume.options), partial=reports
        )
    )
    runner.calls.clear()

    after_restart = IscsiBackend(node)
    after_restart.sysfs = sysfs
    assert unmount_volume(node, target, lambda name: after_restart) == ""
    # never a login (kubelet gave unmount no secret): a command that must not run, a transcript;
    # the real crash is tests/vm/test_iscsi_crash_xfs.py (its attached case)
    assert not any("--login" in c for c in runner.iscsiadm_calls())
    assert sysfs.sessions_of(IQN, "default") == [] and runner.node_files(IQN) == []
    assert node.journal.volumes() == [] and node.journal.pods() == []


def test_detach_waits_while_the_target_is_unreachable(
    backend: IscsiBackend, runner: FakeIscsi
) -> None:
    """Logic only (fake sysfs): every session holding the LUN's disk is down, so nothing is
    flushed, deleted, unregistered or logged out; the release waits. On a real node with a
    dead target: ``tests/vm/test_kit_iscsi.py`` (the kit's ``bounded`` check)."""
    attachment = backend.attach(make_volume())
    (session,) = backend.sysfs.sessions()
    state = backend.sysfs.root / "class" / "iscsi_session" / f"session{session.sid}" / "state"
    state.write_text("FAILED\n")
    before = len(runner.calls)
    with pytest.raises(ReleaseDeferred, match=r"unreachable \(127\.0\.0\.1:3260 failed\)"):
        backend.detach(attachment)
    assert runner.calls[before:] == []
    assert backend.sysfs.deleted == []  # type: ignore[attr-defined]
    assert len(backend.sysfs.sessions()) == 1

    state.write_text("LOGGED_IN\n")  # back: the retry releases everything
    backend.detach(attachment)
    assert backend.sysfs.sessions() == [] and runner.node_files(IQN) == []


def test_detach_waits_when_the_flush_cannot_finish(
    backend: IscsiBackend, runner: FakeIscsi
) -> None:
    """Logic only: a flush that times out (the target stopped answering before the session
    noticed) keeps the disk and the session instead of failing the unmount."""
    attachment = backend.attach(make_volume())

    def hang(args: tuple[str, ...]) -> Result:
        raise CommandTimeout(f"{' '.join(args)} timed out after 60s and was killed")

    runner.answers.append((("blockdev",), hang))  # type: ignore[arg-type]
    with pytest.raises(ReleaseDeferred, match="does not take its buffered writes"):
        backend.detach(attachment)
    assert backend.sysfs.deleted == []  # type: ignore[attr-defined]
    assert len(backend.sysfs.sessions()) == 1


def _set_state(backend: IscsiBackend, disk: str, state: str) -> None:
    sysfs = backend.sysfs
    (session,) = [s for s in sysfs.sessions() if disk in sysfs.lun_disks(s, 0)]
    (sysfs.root / "class" / "iscsi_session" / f"session{session.sid}" / "state").write_text(
        state + "\n"
    )


@pytest.mark.parametrize("mpath", [True, False])
def test_one_dead_path_is_released_without_flushing_it(
    backend: IscsiBackend, runner: FakeIscsi, mpath: bool
) -> None:
    """Logic only: with a path up that the volume used (the map, or the disk itself), the
    release goes on; the dead path's disk is deleted unflushed (its queue would only block).
    A real dead path under multipath: ``tests/vm/test_iscsi.py::test_multipath_over_two_portals``."""
    attachment = two_portal_attach(backend, runner, mpath=mpath)
    _set_state(backend, "sdb", "FAILED")
    backend.detach(attachment)
    flushed = [c[-1] for c in runner.calls if c[:2] == ["blockdev", "--flushbufs"]]
    assert not any(f.endswith("/sdb") for f in flushed)
    assert any(f.endswith("/sda") for f in flushed)
    assert backend.sysfs.deleted == ["sda", "sdb"]  # type: ignore[attr-defined]


def test_the_used_disk_on_a_dead_path_waits_even_with_another_path_up(
    backend: IscsiBackend, runner: FakeIscsi
) -> None:
    """Logic only: without multipath the volume wrote through sda alone; its session is
    down, so the release waits although sdb's session is up."""
    attachment = two_portal_attach(backend, runner, mpath=False)
    _set_state(backend, "sda", "FAILED")
    with pytest.raises(ReleaseDeferred, match="unreachable"):
        backend.detach(attachment)
    assert backend.sysfs.deleted == []  # type: ignore[attr-defined]


def test_still_attached_tells_a_reused_device_name(backend: IscsiBackend, sysfs: FakeSysfs) -> None:
    """The core's busy check of a release asks whether the journalled device still is the
    LUN's (fake sysfs): its disk or a map over it is; after the LUN's session is gone
    (a reboot) the same name given to a disk of another target is not, and a record naming
    no device or a device that is gone is unknown."""
    details = {"iqn": IQN, "lun": "0", "iface": "default"}
    session = sysfs.add_session(IQN, "127.0.0.1:3260")
    disk = sysfs.add_disk(session, 0)
    dm = sysfs.add_map("mpatha", [disk])
    assert backend.still_attached(Attachment(str(sysfs.dev / disk), details)) is True
    assert backend.still_attached(Attachment(str(sysfs.dev / dm), details)) is True
    sysfs.remove_map("mpatha")
    sysfs.remove_session(session.sid)
    assert backend.still_attached(Attachment(str(sysfs.dev / disk), details)) is None  # gone
    sysfs.next_disk = 0  # after boot the kernel names another target's disk the same
    other = sysfs.add_session("iqn.2024-01.test:other", "127.0.0.9:3260")
    assert sysfs.add_disk(other, 0) == disk
    assert backend.still_attached(Attachment(str(sysfs.dev / disk), details)) is False
    assert backend.still_attached(Attachment("", details)) is None


def test_a_detach_leaves_a_reused_multipath_map_name_alone(
    backend: IscsiBackend, runner: FakeIscsi, sysfs: FakeSysfs
) -> None:
    """After a reboot the friendly name the record journalled (``mpatha``) is another
    target's map: the stale record's detach neither flushes nor removes it (fake sysfs)."""
    other = sysfs.add_session("iqn.2024-01.test:other", "127.0.0.9:3260")
    dm = sysfs.add_map("mpatha", [sysfs.add_disk(other, 0)])
    details = {"iqn": IQN, "lun": "0", "iface": "default", "multipath": "mpatha"}
    attachment = Attachment(str(sysfs.dev / dm), details)
    assert backend.still_attached(attachment) is False
    backend.detach(attachment)
    assert not any(c[:2] == ["multipath", "-f"] for c in runner.calls), runner.calls
    assert sysfs.find_map("mpatha") == dm
