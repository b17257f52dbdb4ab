"""What an attached LUN lacks, from sysfs (flexhub_iscsi._health, the backend's ``health``
for CSI NodeGetVolumeHealth): sessions that are not LOGGED_IN or gone, disks that are not
running or gone. Units over the fake sysfs tree; the real kernel's states are checked in the
VM (tests/vm/test_csi_iscsi_fence_vm.py)."""

from __future__ import annotations

from pathlib import Path

from flexhub_iscsi import IscsiBackend

from flexhub.backend import Attachment, VolumeTrouble
from tests.iscsi.conftest import FakeSysfs

IQN = "iqn.2026-01.io.flexhub:health"
A, B = "10.0.0.1:3260", "10.0.0.2:3260"


def attached(sysfs: FakeSysfs, *portals: str) -> Attachment:
    """LUN 3 through a session on each portal: the attachment as attach journals it."""
    disks = [sysfs.add_disk(sysfs.add_session(IQN, portal), 3) for portal in portals]
    details = {
        "iqn": IQN,
        "lun": "3",
        "iface": "default",
        "portals": ",".join(portals),
        "devices": ",".join(disks),
        "multipath": "mpatha" if len(portals) > 1 else "",
    }
    return Attachment(f"/dev/{disks[0]}", details)


def state(sysfs: FakeSysfs, sid: int, value: str) -> None:
    (sysfs.root / "class" / "iscsi_session" / f"session{sid}" / "state").write_text(value + "\n")


def disk_state(sysfs: FakeSysfs, disk: str, value: str) -> None:
    (sysfs.root / "class" / "block" / disk / "device" / "state").write_text(value + "\n")


def test_every_path_up_is_healthy(backend: IscsiBackend, sysfs: FakeSysfs) -> None:
    assert backend.health(attached(sysfs, A, B)) == []


def test_one_failed_session_of_two_is_degraded(backend: IscsiBackend, sysfs: FakeSysfs) -> None:
    attachment = attached(sysfs, A, B)
    state(sysfs, 2, "FAILED")
    disk_state(sysfs, attachment.details["devices"].split(",")[1], "blocked")
    assert backend.health(attachment) == [
        VolumeTrouble(
            "degraded",
            "PathDown",
            f"iSCSI {IQN} lun 3: the session on {B} is FAILED; disk sdb is blocked "
            "(served by the other path(s))",
        )
    ]


def test_every_session_failed_is_inaccessible(backend: IscsiBackend, sysfs: FakeSysfs) -> None:
    attachment = attached(sysfs, A, B)
    state(sysfs, 1, "FAILED")
    state(sysfs, 2, "FREE")
    (trouble,) = backend.health(attachment)
    assert (trouble.status, trouble.reason) == ("inaccessible", "PathsDown")
    assert trouble.message == (
        f"iSCSI {IQN} lun 3: no path: the session on {A} is FAILED; the session on {B} is FREE"
    )


def test_a_single_path_whose_disk_went_offline_is_inaccessible(
    backend: IscsiBackend, sysfs: FakeSysfs
) -> None:
    """replacement_timeout passed: the session may be back, the disk stays transport-offline
    (I/O fails) until it is rescanned."""
    attachment = attached(sysfs, A)
    disk_state(sysfs, "sda", "transport-offline")
    (trouble,) = backend.health(attachment)
    assert (trouble.status, trouble.reason) == ("inaccessible", "PathsDown")
    assert "disk sda is transport-offline" in trouble.message


def test_a_session_or_disk_gone_is_a_path_down(backend: IscsiBackend, sysfs: FakeSysfs) -> None:
    attachment = attached(sysfs, A, B)
    sysfs.remove_session(1)  # logged out behind flexhub's back: its disk goes with it
    (trouble,) = backend.health(attachment)
    assert (trouble.status, trouble.reason) == ("degraded", "PathDown")
    assert trouble.message.startswith(f"iSCSI {IQN} lun 3: {A} has no session; disk sda is gone")
    sysfs.remove_session(2)
    assert [t.reason for t in backend.health(attachment)] == ["PathsDown"]


def test_a_record_naming_no_paths_says_nothing(backend: IscsiBackend, tmp_path: Path) -> None:
    """A journal record from before its details named portals and disks: nothing to compare
    (the staging mount's stat still speaks for it)."""
    assert backend.health(Attachment("/dev/sdz", {"iqn": IQN, "lun": "0"})) == []
    assert backend.health(Attachment("/dev/sdz", {})) == []


def test_a_portal_named_by_host_name_is_up_through_its_address(
    backend: IscsiBackend, sysfs: FakeSysfs
) -> None:
    """A PV's portal may be a host name (``targetPortal: storage.example:3260``); attach
    journals it as written, the kernel's session shows the address it resolved to. Healthy
    is healthy (it was PathsDown: INACCESSIBLE, and a false VolumeConditionAbnormal Event);
    that session failed is still inaccessible."""
    disk = sysfs.add_disk(sysfs.add_session(IQN, A), 3)
    details = {
        "iqn": IQN,
        "lun": "3",
        "iface": "default",
        "portals": "storage.example:3260",
        "devices": disk,
        "multipath": "",
    }
    attachment = Attachment(f"/dev/{disk}", details)
    assert backend.health(attachment) == []
    state(sysfs, 1, "FAILED")
    (trouble,) = backend.health(attachment)
    assert (trouble.status, trouble.reason) == ("inaccessible", "PathsDown")
    assert f"the session on {A} is FAILED" in trouble.message


def test_a_session_on_another_address_never_stands_for_an_address_portal(
    backend: IscsiBackend, sysfs: FakeSysfs
) -> None:
    """Only a host-name portal is matched by address: a portal written as an address with no
    session of its own is down, whatever other session the target has."""
    disk = sysfs.add_disk(sysfs.add_session(IQN, B), 3)
    details = {"iqn": IQN, "lun": "3", "iface": "default", "portals": A, "devices": disk}
    (trouble,) = backend.health(Attachment(f"/dev/{disk}", details))
    assert (trouble.status, trouble.reason) == ("inaccessible", "PathsDown")
    assert f"{A} has no session" in trouble.message
