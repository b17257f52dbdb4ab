"""The records a mount loads are frozen dataclasses written out (flexhub.node.frozen).

Each is compared with the frozen dataclass it replaces, declared here with the same fields and
defaults: the same constructor, ``repr``, equality, hash, immutability and ``replace``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from flexhub_loopfile import _Created
from flexhub_loopfile._loop import LoopDevice
from flexhub_loopfile._room import Room

from flexhub.backend import Attachment, NodeRequirements
from flexhub.driver.loader import BackendInfo
from flexhub.node.journal import DeferredRelease, Journal, PodRecord, VolumeRecord
from flexhub.node.mounts import MountEntry
from flexhub.node.runner import RecordingRunner, Result
from flexhub.provisioning import Claim, Provisioned
from flexhub.volume import PodInfo, Secrets, Volume

F = dataclasses.field


def reference(name: str, fields: list[tuple[str, Any]], frozen: bool = True) -> type:
    """The frozen dataclass a record replaced (``(name, default or field(...))``; a bare
    name for a field without default)."""
    spec = []
    for field_name, default in fields:
        if default is dataclasses.MISSING:
            spec.append((field_name, Any))
        else:
            spec.append((field_name, Any, default))  # type: ignore[arg-type]
    return dataclasses.make_dataclass(name, spec, frozen=frozen)


M = dataclasses.MISSING
CASES: list[tuple[type, list[tuple[str, Any]], tuple[Any, ...], dict[str, Any]]] = [
    (PodInfo, [("name", ""), ("namespace", ""), ("uid", ""), ("service_account", "")], ("p",), {"uid": "u"}),
    (
        Volume,
        [("options", M), ("fs_type", ""), ("read_only", False), ("name", ""), ("fs_group", None), ("pod", None), ("secrets", F(default_factory=Secrets))],
        ({"backend": "loopfile"},),
        {"fs_type": "xfs", "read_only": True, "fs_group": 5},
    ),
    (
        NodeRequirements,
        [("commands", ()), ("kernel_modules", ()), ("daemons", ()), ("hint", "")],
        (("mount",),),
        {"hint": "apt install x"},
    ),
    (Attachment, [("device", M), ("details", F(default_factory=dict)), ("blank", F(default=None, compare=False))], ("/dev/loop3",), {"details": {"loop": "/dev/loop3"}}),
    (
        PodRecord,
        [("target", M), ("backend", M), ("volume_id", M), ("staging", None), ("read_only", False), ("details", F(default_factory=dict)), ("created", F(default_factory=time.time))],
        ("/t", "loopfile", "v"),
        {"staging": "/s", "created": 1.5},
    ),
    (
        VolumeRecord,
        [("volume_id", M), ("backend", M), ("device", M), ("staging", M), ("fs_type", M), ("details", F(default_factory=dict)), ("created", F(default_factory=time.time)), ("options", F(default_factory=dict)), ("partial", F(default_factory=dict)), ("access", F(default_factory=dict))],
        ("v", "loopfile", "/dev/loop1", "/s", "ext4"),
        {"created": 2.0, "access": {"a": "b"}},
    ),
    (DeferredRelease, [("volume_id", M), ("attempts", M), ("since", M)], ("v", 2, 3.0), {}),
    (
        MountEntry,
        [(n, M) for n in ("mount_id", "parent_id", "major_minor", "root", "mount_point", "options", "fs_type", "source", "super_options")],
        (1, 2, "7:1", "/", "/m", ("rw",), "ext4", "/dev/loop1", ("rw",)),
        {},
    ),
    (Result, [("argv", M), ("returncode", M), ("stdout", M), ("stderr", M)], (("true",), 0, "", ""), {}),
    (BackendInfo, [("name", M), ("target", M), ("distribution", M), ("version", M), ("error", "")], ("loopfile", "m:C", "d", "1"), {"error": "e"}),
    (
        Claim,
        [("uid", M), ("namespace", M), ("name", M), ("size", M), ("access_modes", ("ReadWriteOnce",)), ("annotations", F(default_factory=dict)), ("labels", F(default_factory=dict)), ("selected_node", "")],
        ("u", "ns", "c", 10),
        {"selected_node": "n1"},
    ),
    (
        Provisioned,
        [("options", M), ("size", M), ("reclaim", F(default_factory=dict)), ("fs_type", ""), ("secret", None), ("node", "")],
        ({"file": "x"}, 10),
        {"secret": ("ns", "s")},
    ),
    (LoopDevice, [("name", M), ("index", M)], ("loop3", 3), {}),
    (Room, [("promised", M), ("occupied", M), ("available", M)], (1, 2, 3), {}),
    (_Created, [("identity", M), ("size", M), ("directories", M)], ((1, 2), 3, (Path("/a"),)), {}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("cls", "fields", "args", "kwargs"), CASES, ids=[c[0].__name__ for c in CASES]
)
def test_a_record_behaves_as_the_frozen_dataclass_it_replaced(
    cls: type, fields: list[tuple[str, Any]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    ref = reference(cls.__name__, fields)
    names = [f for f, _ in fields]
    for k in ({}, kwargs):
        if "created" in names:
            k = {"created": 1.0, **k}  # a default timestamp differs between two calls
        mine, theirs = cls(*args, **k), ref(*args, **k)
        assert repr(mine) == repr(theirs)
        assert [getattr(mine, f) for f in names] == [getattr(theirs, f) for f in names]
        assert mine == cls(*args, **k)
        assert mine != object()
        with pytest.raises(AttributeError):
            setattr(mine, names[0], "x")
        try:
            hash(theirs)
        except TypeError:
            with pytest.raises(TypeError):
                hash(mine)
        else:
            assert hash(mine) == hash(cls(*args, **k))
    if hasattr(cls, "replace"):
        k = {"created": 1.0, **kwargs} if "created" in names else kwargs
        mine = cls(*args, **k)
        last = names[-1]
        changed = mine.replace(**{last: getattr(mine, last)})
        assert changed == mine and changed is not mine
        assert mine.replace(**{names[0]: args[0]}) == mine
        with pytest.raises(TypeError):
            mine.replace(nonsense=1)
        assert mine.as_dict() == dataclasses.asdict(ref(*args, **k))
        assert list(mine.as_dict()) == names
        import copy
        import pickle

        assert copy.copy(mine) == mine and copy.deepcopy(mine) == mine
        assert pickle.loads(pickle.dumps(mine)) == mine


def test_equality_follows_the_compared_fields_only() -> None:
    assert Attachment("/dev/loop1", blank=True) == Attachment("/dev/loop1", blank=False)
    assert Attachment("/dev/loop1") != Attachment("/dev/loop2")
    assert PodInfo("a") != PodInfo("b")
    assert LoopDevice("loop1", 1) == LoopDevice("loop1", 1)
    assert {LoopDevice("loop1", 1), LoopDevice("loop1", 1)} == {LoopDevice("loop1", 1)}


def test_journal_records_round_trip(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    pod = PodRecord("/t", "loopfile", "v", "/s", True, {"k": "v"}, 1.5)
    journal.put_pod(pod)
    assert journal.get_pod("/t") == pod
    volume = VolumeRecord(
        "v",
        "loopfile",
        "/dev/loop1",
        "/s",
        "ext4",
        {"loop": "1"},
        2.5,
        {"o": "p"},
        {"q": "r"},
        {"a": "b"},
    )
    journal.put_volume(volume)
    assert journal.get_volume("v") == volume
    assert journal.get_volume("v").replace(device="").pending  # type: ignore[union-attr]


def test_the_recording_runner_keeps_its_lists() -> None:
    runner = RecordingRunner()
    runner(["true"])
    assert runner.calls == [["true"]] and runner.inputs == [None]
    assert RecordingRunner() == RecordingRunner() and runner != RecordingRunner()
    scripted: Mapping[tuple[str, ...], object] = {("x",): Result(("x",), 3, "", "")}
    assert RecordingRunner(script=dict(scripted)).script == scripted


def test_the_public_records_type_hints_resolve() -> None:
    """Backend authors' tools (``typing.get_type_hints``) read the public records' fields."""
    import typing

    from flexhub.backend import Attachment, MountEntry, NodeRequirements, Volume
    from flexhub.provisioning import Claim, Provisioned

    for record in (Volume, MountEntry, Attachment, NodeRequirements, Claim, Provisioned):
        hints = typing.get_type_hints(record)
        assert set(record.fields()) <= set(hints), record
