"""The publish records (flexhub.csi.published) on a read-only state disk: removing the record
of a target that has none (a pod published before the upgrade that brought the records, or
never recorded) writes nothing, as the controller's records do (unlink(2) of a missing file
on a read-only filesystem is EROFS, not ENOENT): NodeUnpublishVolume logged a false
'cannot remove the publish record' for it. A record that is there and cannot go still says so."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from flexhub.csi.published import Published, PublishedTargets
from flexhub.errors import StateError
from tests.conftest import needs_root

pytestmark = [needs_root]

KEPT = "/var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/pv-a/mount"
OLD = "/var/lib/kubelet/pods/u2/volumes/kubernetes.io~csi/pv-b/mount"


def test_removing_no_record_on_a_read_only_state_disk_writes_nothing(tmp_path: Path) -> None:
    records = PublishedTargets(tmp_path)
    records.put(Published(KEPT, "loopfile:v", "/stage", "pv-a", None))
    directory = records.directory
    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], check=True)
        records.delete(OLD)  # none there: nothing to write, no error
        with pytest.raises(StateError, match="cannot remove the publish record"):
            records.delete(KEPT)
    finally:
        subprocess.run(["umount", str(directory)], check=True)
    assert records.get(KEPT) is not None and records.get(OLD) is None
