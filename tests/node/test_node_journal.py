"""The state journal: atomic writes, permissions, versions, corrupt records."""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path

import pytest

from flexhub.node.journal import SCHEMA_VERSION, Journal, PodRecord, VolumeRecord


def _pod(target: str = "/k/pods/u/volumes/a~b/v", volume_id: str = "v1") -> PodRecord:
    return PodRecord(target, "loopfile", volume_id, "/s/abc", False, {"k": "v"}, 12.5)


def test_roundtrip_and_listing(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "state")
    assert journal.get_pod("/nope") is None and journal.pods() == []
    journal.put_pod(_pod())
    journal.put_pod(_pod("/other", "v2"))
    vol = VolumeRecord(
        "v1",
        "loopfile",
        "/dev/loop3",
        "/s/abc",
        "ext4",
        {"loop": "/dev/loop3"},
        1.0,
        {"file": "a.img"},
    )
    journal.put_volume(vol)
    assert journal.get_pod("/k/pods/u/volumes/a~b/v") == _pod()
    assert [p.volume_id for p in journal.pods_of("v2")] == ["v2"]
    assert journal.get_volume("v1") == vol and journal.volume_by_staging("/s/abc") == vol
    assert journal.volumes() == [vol] and not vol.pending
    journal.delete_pod("/other")
    journal.delete_pod("/other")  # absent: no error
    journal.delete_volume("v1")
    assert journal.get_volume("v1") is None and len(journal.pods()) == 1


def test_files_are_private_versioned_and_atomic(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "state")
    journal.put_pod(_pod())
    (path,) = list((tmp_path / "state" / "pods").iterdir())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    data = json.loads(path.read_text())
    assert data["version"] == SCHEMA_VERSION and data["kind"] == "pod"
    journal.put_pod(_pod())  # replace in place, no temporary file left behind
    assert [p.name for p in path.parent.iterdir()] == [path.name]


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b'{"version": 1, "kind": "pod", "target": "/k/po',  # half-written
        b"\x00\xff\xfe",
        b"[1, 2]",
        b'{"version": 99, "kind": "pod"}',
        b'{"kind": "pod", "target": "/t", "backend": "b", "volume_id": "v"}',  # no version
        b'{"version": 1, "kind": "volume", "target": "/t"}',
        b'{"version": 1, "kind": "pod", "target": "/t", "backend": 3, "volume_id": "v"}',
        b'{"version": 1, "kind": "pod", "target": "/t", "backend": "b", "volume_id": "v",'
        b' "details": {"a": 1}}',
    ],
)
def test_corrupt_records_read_as_missing_and_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    journal = Journal(tmp_path)
    journal.put_pod(_pod("/t"))
    (path,) = list((tmp_path / "pods").iterdir())
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="flexhub.node.journal"):
        assert journal.get_pod("/t") is None
        assert journal.pods() == []
    assert "corrupt or unreadable state record" in caplog.text
    journal.delete_pod("/t")
    assert not path.exists()


def test_unknown_extra_fields_are_ignored(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.put_pod(_pod("/t"))
    (path,) = list((tmp_path / "pods").iterdir())
    data = json.loads(path.read_text())
    data["added_by_a_later_release"] = {"x": 1}
    path.write_text(json.dumps(data))
    assert journal.get_pod("/t") == _pod("/t")


def test_a_record_under_the_wrong_name_is_ignored(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.put_pod(_pod("/a"))
    journal.put_pod(_pod("/b"))
    a, b = (journal._pod_path(t) for t in ("/a", "/b"))
    a.write_bytes(b.read_bytes())
    assert journal.get_pod("/a") is None


def test_write_failure_is_a_state_error(tmp_path: Path) -> None:
    from flexhub.errors import StateError

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StateError, match="cannot write state record"):
        Journal(blocker).put_pod(_pod())
