"""CHAP values checked, the connection identity, and discovery's node records."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from flexhub_iscsi import IscsiBackend
from flexhub_iscsi._chap import KEY_FILE
from flexhub_iscsi._options import dedicated_iface

from flexhub.backend import Attachment
from flexhub.errors import InvalidOptions, VolumeError
from flexhub.node import Node
from flexhub.node.journal import VolumeRecord
from flexhub.node.runner import Result

from .conftest import IQN, FakeIscsi, FakeSysfs
from .test_iscsi import PASSWORD, SESSION_SECRETS, USERNAME, make_volume

KEY = "node.session.auth.password"


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("pass\nnode.startup = automatic", "control characters"),
        ("pass\rword", "control characters"),
        ("pass\x00word", "control characters"),
        (" padded", "whitespace"),
        ("padded\t", "control characters"),
        ("pass\u2028node.startup = automatic", "control characters"),
        ("pass\u2029word", "control characters"),
        ("pass\x85word", "control characters"),
        ("pass\x1cword", "control characters"),
        ("pass\x9bword", "control characters"),
        ("x" * 256, "255 bytes"),
        ("é" * 128, "255 bytes"),
    ],
)
def test_bad_chap_values_fail_naming_the_key(
    backend: IscsiBackend, runner: FakeIscsi, value: str, why: str
) -> None:
    volume = make_volume({**SESSION_SECRETS, KEY: value}, chapAuthSession="true")
    with pytest.raises(InvalidOptions) as info:
        backend.check(volume)
    message = info.value.message
    assert KEY in message and why in message and "\n" not in message
    assert value not in message and value.strip() not in message
    assert runner.calls == []


def test_a_record_file_is_split_on_newlines_only(tmp_path: Path) -> None:
    """A value open-iscsi wrote (or an operator typed) holding U+2028, U+0085 or a form feed
    stays one setting: re-writing the record neither splits it into two lines nor lets its
    tail replace a setting."""
    from flexhub_iscsi._records import RecordFiles

    path = tmp_path / "nodes" / IQN / "10.0.0.1,3260,1" / "default"
    path.parent.mkdir(parents=True)
    odd = "node.name = a\u2028node.startup = automatic\x85node.tpgt = 9\x0cz"
    path.write_text(f"# BEGIN RECORD 2.1.8\n{odd}\nnode.startup = manual\n# END RECORD\n")
    RecordFiles(tmp_path).set_values(path, {"node.startup": "onboot", KEY: "pw"})
    assert path.read_text().split("\n") == [
        "# BEGIN RECORD 2.1.8",
        odd,
        "node.startup = onboot",
        f"{KEY} = pw",
        "# END RECORD",
        "",
    ]


def test_longest_chap_value_open_iscsi_holds_is_accepted(backend: IscsiBackend) -> None:
    backend.check(make_volume({**SESSION_SECRETS, KEY: "x" * 255}, chapAuthSession="true"))


def test_access_names_the_parts_and_holds_no_secret(backend: IscsiBackend) -> None:
    right = backend.access(make_volume(SESSION_SECRETS, chapAuthSession="true"))
    wrong = backend.access(
        make_volume({**SESSION_SECRETS, KEY: "another-one"}, chapAuthSession="true")
    )
    none = backend.access(make_volume())
    assert [k for k in right if right[k] != wrong[k]] == ["session CHAP password"]
    assert {k for k in right if right[k] != none[k]} == {
        "session CHAP user name",
        "session CHAP password",
    }
    text = repr(right)
    assert PASSWORD not in text and USERNAME not in text
    key = Path(backend.node.state_dir) / KEY_FILE
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    # the same key (so the same digests) on every call
    assert backend.access(make_volume(SESSION_SECRETS, chapAuthSession="true")) == right


def _discovery_makes(runner: FakeIscsi, records: list[tuple[str, str]]) -> None:
    assert runner.etc is not None
    etc = runner.etc

    def discover(args: tuple[str, ...]) -> Result:
        for iqn, portal_dir in records:
            path = etc / "nodes" / iqn / portal_dir / "default"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("# BEGIN RECORD 2.1.8\n# END RECORD\n")
        return Result(args, 0, "", "")

    runner.answers.append((("--discover",), discover))  # type: ignore[arg-type]
    runner.answers.append((("-m", "discovery"), discover))  # type: ignore[arg-type]


def test_discovery_records_of_other_targets_are_deleted_only_when_new(
    backend: IscsiBackend, runner: FakeIscsi
) -> None:
    assert runner.etc is not None
    kept = runner.etc / "nodes" / "iqn.2024-01.org.example:operators" / "127.0.0.1,3260,1"
    kept.mkdir(parents=True)
    (kept / "default").write_text("# BEGIN RECORD 2.1.8\n# END RECORD\n")
    _discovery_makes(
        runner,
        [
            (IQN, "127.0.0.1,3260,1"),
            (IQN, "10.9.9.9,3260,1"),  # our target on a portal the PV does not name
            ("iqn.2024-01.org.example:other", "127.0.0.1,3260,1"),
            ("iqn.2024-01.org.example:operators", "127.0.0.1,3260,1"),
        ],
    )
    backend.attach(make_volume())
    # what is left of open-iscsi's records: ours on the PV's portal, and the record that was
    # there before (on a real node: tests/vm/test_iscsi_attach.py and test_iscsi_security.py)
    assert runner.node_files(IQN) == ["127.0.0.1,3260,1/default"]
    assert runner.node_files("iqn.2024-01.org.example:other") == []
    assert runner.node_files("iqn.2024-01.org.example:operators") == ["127.0.0.1,3260,1/default"]


def journal_lun0_logged_in(backend: IscsiBackend, staging: Path) -> None:
    """LUN 0 journalled with the identity of the right session CHAP, staged on ``staging``,
    its session logged in."""
    volume = make_volume(SESSION_SECRETS, chapAuthSession="true")
    backend.node.journal.put_volume(
        VolumeRecord(
            f"iscsi:{IQN}:0",
            "iscsi",
            "/dev/sda",
            str(staging),
            "ext4",
            {"iqn": IQN, "lun": "0", "iface": "default"},
            access=dict(backend.access(volume)),
        )
    )
    assert isinstance(backend.sysfs, FakeSysfs)
    backend.sysfs.add_session(IQN, "127.0.0.1:3260")


@pytest.fixture
def staged_lun0(backend: IscsiBackend, tmp_path: Path) -> Iterator[Path]:
    """LUN 0 staged (a real tmpfs mount stands in for its filesystem), journalled with the
    identity of the right session CHAP, its session logged in."""
    staging = tmp_path / "staging-lun0"
    staging.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(staging)], check=True)
    journal_lun0_logged_in(backend, staging)
    yield staging
    subprocess.run(["umount", str(staging)], check=True)


def test_a_session_kept_for_a_waiting_release_is_not_reused_with_other_chap(
    backend: IscsiBackend, runner: FakeIscsi, tmp_path: Path
) -> None:
    """LUN 0's release waits for the target (its staging is gone, its session stays): another
    LUN with other session CHAP must log in, not reuse that session."""
    journal_lun0_logged_in(backend, tmp_path / "staging-gone")
    backend.node.journal.defer_release(f"iscsi:{IQN}:0")
    with pytest.raises(VolumeError, match="session CHAP password differ"):
        backend.attach(
            make_volume({**SESSION_SECRETS, KEY: "guessed"}, chapAuthSession="true", lun="1")
        )
    assert runner.iscsiadm_calls() == []


@pytest.mark.root
def test_another_lun_reuses_the_session_only_with_the_same_session_chap(
    backend: IscsiBackend, runner: FakeIscsi, staged_lun0: Path
) -> None:
    wrong = make_volume({**SESSION_SECRETS, KEY: "guessed"}, chapAuthSession="true", lun="1")
    with pytest.raises(VolumeError) as info:
        backend.attach(wrong)
    assert "session CHAP password differ" in info.value.message
    assert "guessed" not in info.value.message and PASSWORD not in info.value.message
    assert runner.iscsiadm_calls() == []
    with pytest.raises(VolumeError):
        backend.attach(make_volume(lun="1"))  # no CHAP at all
    attachment = backend.attach(make_volume(SESSION_SECRETS, chapAuthSession="true", lun="1"))
    assert attachment.details["lun"] == "1"


def test_a_chap_user_name_equal_to_the_initiator_name_is_no_leak(
    backend: IscsiBackend, node: Node, runner: FakeIscsi, tmp_path: Path
) -> None:
    """The core's "no secret in the journal" check met the initiator name (a PV option) in
    the journalled options and the connection identity: a CHAP user name equal to it (a
    common set-up) could never mount. The core's journalling steps run for real here with
    the fake iSCSI runner; a volume's own non-secret option values are not secrets."""
    from flexhub.node.volumes import _attach_and_record, _Progress, staging_dir

    name = "iqn.2024-02.io.node:worker-1"
    runner.answer("iface", dedicated_iface("default", name), "show", rc=21, stderr="no iface")
    runner.answer("iface", "default", "show", stdout="iface.transport_name = tcp\niface.mtu = 0\n")
    secrets = {"node.session.auth.username": name, "node.session.auth.password": PASSWORD}
    volume = make_volume(secrets, chapAuthSession="true", initiatorName=name)
    volume_id = backend.volume_id(volume)
    staging = staging_dir(node, volume_id)
    record = _attach_and_record(
        node, backend, volume, volume_id, "iscsi", staging, None, _Progress()
    )
    assert record.options["initiatorName"] == name
    journalled = "".join(p.read_text() for p in (node.state_dir / "volumes").iterdir())
    assert json.loads(journalled)["options"]["initiatorName"] == name
    assert PASSWORD not in journalled
    backend.detach(Attachment(record.device, record.details))
