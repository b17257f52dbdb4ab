"""Who owns a target's session: a volume of another LUN reuses it only with the same session
identity, also while the owner's mount is still in flight (its journal record only an intent,
its staging not mounted yet).

The fake iscsiadm plays the sessions (see ``conftest``); the real race, two mounts at once
in the guest, is ``tests/vm/test_iscsi_session_race.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

import pytest
from flexhub_iscsi import IscsiBackend
from flexhub_iscsi._records import RecordFiles

from flexhub.backend import VolumeError
from flexhub.node import Node
from flexhub.node.journal import VolumeRecord
from flexhub.node.runner import Result

from .conftest import IQN, FakeIscsi, FakeSysfs
from .test_iscsi import SESSION_SECRETS, make_volume

LUN0 = f"iscsi:{IQN}:0"


def chap_lun0(backend: IscsiBackend) -> dict[str, str]:
    return dict(backend.access(make_volume(SESSION_SECRETS, chapAuthSession="true")))


def test_an_intent_record_owns_the_session(
    backend: IscsiBackend, runner: FakeIscsi, tmp_path: Path
) -> None:
    """LUN 0's CHAP mount is in flight: logged in, its record an intent (the target only in
    what its attach reported), nothing staged. A LUN without CHAP must not reuse it."""
    backend.node.journal.put_volume(
        VolumeRecord(
            LUN0,
            "iscsi",
            "",
            str(tmp_path / "staging-lun0"),
            "ext4",
            {},
            options={"iqn": IQN, "lun": "0"},
            partial={"iqn": IQN, "lun": "0", "iface": "default", "portals": "127.0.0.1:3260"},
            access=chap_lun0(backend),
        )
    )
    assert isinstance(backend.sysfs, FakeSysfs)
    backend.sysfs.add_session(IQN, "127.0.0.1:3260")
    with pytest.raises(VolumeError) as info:
        backend.attach(make_volume(lun="1"))
    message = info.value.message
    assert "session CHAP" in message and "refusing to share its session" in message, message
    assert LUN0 in message
    assert runner.iscsiadm_calls() == []
    assert len(backend.sysfs.sessions()) == 1  # LUN 0's session untouched


def test_an_attached_lun_not_staged_yet_owns_the_session(
    backend: IscsiBackend, runner: FakeIscsi, tmp_path: Path
) -> None:
    """LUN 0 attached and journalled, its staging mount not made yet (or gone while its
    disk stays): it still owns the session."""
    assert isinstance(backend.sysfs, FakeSysfs)
    session = backend.sysfs.add_session(IQN, "127.0.0.1:3260")
    disk = backend.sysfs.add_disk(session, 0)
    backend.node.journal.put_volume(
        VolumeRecord(
            LUN0,
            "iscsi",
            f"/dev/{disk}",
            str(tmp_path / "staging-lun0"),
            "ext4",
            {"iqn": IQN, "lun": "0", "iface": "default", "portals": "127.0.0.1:3260"},
            access=chap_lun0(backend),
        )
    )
    with pytest.raises(VolumeError, match="refusing to share its session"):
        backend.attach(make_volume(lun="1"))
    assert runner.iscsiadm_calls() == []


def test_a_released_leftover_owns_nothing(
    backend: IscsiBackend, runner: FakeIscsi, tmp_path: Path
) -> None:
    """A record whose release finished (no disk, nothing staged, nothing waiting) but was
    not deleted (a crash right after the detach) blocks no one."""
    backend.node.journal.put_volume(
        VolumeRecord(
            LUN0,
            "iscsi",
            "/dev/sdq",
            str(tmp_path / "staging-lun0"),
            "ext4",
            {"iqn": IQN, "lun": "0", "iface": "default", "portals": "127.0.0.1:3260"},
            access=chap_lun0(backend),
        )
    )
    attachment = backend.attach(make_volume(lun="1"))
    assert attachment.details["lun"] == "1"


def _journalling(node: Node, volume_id: str) -> None:
    """What the core does around an attach: its intent, then each report merged into it."""
    intent = VolumeRecord(volume_id, "iscsi", "", f"/nonexistent/{volume_id}", "ext4", {})
    node.journal.put_volume(intent)

    def journal(details: Mapping[str, str]) -> None:
        current = node.journal.get_volume(volume_id) or intent
        node.journal.put_volume(current.replace(partial={**current.partial, **details}))

    node.progress = journal


def test_two_attaches_at_once_never_share_a_session_of_another_identity(
    node: Node, runner: FakeIscsi, sysfs: FakeSysfs, tmp_path: Path
) -> None:
    """LUN 0 with CHAP is held in flight after its login (in its fencing step); LUN 1
    without CHAP attaches meanwhile through another node object on the same state (as a
    second driver process would): refused, never riding LUN 0's session."""

    def backend_of(own: Node) -> IscsiBackend:
        instance = IscsiBackend(own)
        instance.sysfs = sysfs
        assert runner.etc is not None
        instance._records = RecordFiles(runner.etc)
        return instance

    other = Node(node.config, backend="iscsi", runner=runner)
    first, second = backend_of(node), backend_of(other)
    chap = make_volume(SESSION_SECRETS, chapAuthSession="true")
    _journalling(node, LUN0)
    node.journal.put_volume(
        node.journal.get_volume(LUN0).replace(access=chap_lun0(first))  # type: ignore[union-attr]
    )
    _journalling(other, f"iscsi:{IQN}:1")

    in_flight, go_on = threading.Event(), threading.Event()
    pr = runner.pr

    def holding(args: tuple[str, ...]) -> Result:
        if "--read-reservation" in args and not in_flight.is_set():
            in_flight.set()
            assert go_on.wait(10)
        return pr(args)

    runner.pr = holding  # type: ignore[assignment]
    errors: list[BaseException] = []

    def attach_first() -> None:
        try:
            first.attach(chap)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=attach_first)
    thread.start()
    try:
        assert in_flight.wait(10), "LUN 0's attach never reached its fencing"
        assert len(sysfs.sessions()) == 1
        logins = sum("--login" in c for c in runner.iscsiadm_calls())
        with pytest.raises(VolumeError, match=r"session CHAP.*refusing to share its session"):
            second.attach(make_volume(lun="1"))
        assert sum("--login" in c for c in runner.iscsiadm_calls()) == logins
        assert [lun for _, lun in sysfs.scans] == [0]  # LUN 1 never scanned
    finally:
        go_on.set()
        thread.join(10)
    assert errors == []


def test_an_attach_during_a_detach_logs_in_on_its_own(
    node: Node, runner: FakeIscsi, sysfs: FakeSysfs
) -> None:
    """Ownership ends at the logout, not at the deletion of the disks. LUN 0 with CHAP is
    being detached: its staging unmounted, its disks deleted, its record still journalled
    and its logout not decided yet (held in ``_release``). LUN 1 without CHAP attaches then
    (another node object on the same state, as a second driver process): it waits for the
    detach's owner lock, the detach logs out, and LUN 1 logs in with its own session; it
    never rides LUN 0's CHAP-authenticated one (before the fix it reused it, no login).
    Fake iscsiadm and sysfs (see ``conftest``)."""

    def backend_of(own: Node) -> IscsiBackend:
        instance = IscsiBackend(own)
        instance.sysfs = sysfs
        assert runner.etc is not None
        instance._records = RecordFiles(runner.etc)
        return instance

    other = Node(node.config, backend="iscsi", runner=runner)
    first, second = backend_of(node), backend_of(other)
    chap = make_volume(SESSION_SECRETS, chapAuthSession="true")
    _journalling(node, LUN0)
    attachment = first.attach(chap)
    # what the core journals once the attach returned
    node.journal.put_volume(
        node.journal.get_volume(LUN0).replace(  # type: ignore[union-attr]
            device=attachment.device,
            details=dict(attachment.details),
            partial={},
            access=dict(first.access(chap)),
        )
    )
    (chap_session,) = sysfs.sessions()

    in_release, go_on = threading.Event(), threading.Event()
    original = first._release

    def paused(*args, **kwargs):  # type: ignore[no-untyped-def]
        in_release.set()
        assert go_on.wait(10)
        return original(*args, **kwargs)

    first._release = paused  # type: ignore[method-assign]
    detach = threading.Thread(target=first.detach, args=(attachment,))
    detach.start()
    _journalling(other, f"iscsi:{IQN}:1")
    outcome: list[object] = []

    def attach_second() -> None:
        try:
            outcome.append(second.attach(make_volume(lun="1")))
        except BaseException as exc:  # reported below
            outcome.append(exc)

    attach = threading.Thread(target=attach_second)
    try:
        assert in_release.wait(10)
        logins = sum("--login" in c for c in runner.iscsiadm_calls())
        attach.start()
        attach.join(0.5)
        assert attach.is_alive(), outcome  # waits for the detach's owner lock
        assert sum("--login" in c for c in runner.iscsiadm_calls()) == logins
    finally:
        go_on.set()
        detach.join(10)
        attach.join(10)
    assert node.journal.get_volume(LUN0) is not None  # the core deletes it only afterwards
    (result,) = outcome
    assert not isinstance(result, BaseException), result
    calls = runner.iscsiadm_calls()
    logout = max(i for i, c in enumerate(calls) if "--logout" in c)
    login = max(i for i, c in enumerate(calls) if "--login" in c)
    assert logout < login  # LUN 0 logged out, then LUN 1 logged in itself
    (session,) = sysfs.sessions()
    assert session.sid != chap_session.sid
    assert [lun for sid, lun in sysfs.scans if sid == session.sid] == [1]
