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
from flexhub_cifs._options import Credentials
from flexhub_cifs._options import Plan as CifsPlan
from flexhub_cifs._provision import Spec as CifsSpec
from flexhub_iscsi._lio import LioClass, LioVolume, Ssh
from flexhub_iscsi._options import Chap, Portal, Settings, Target
from flexhub_iscsi._preempt import Authorization
from flexhub_iscsi._records import NodeRecord
from flexhub_iscsi._reservation import Registration
from flexhub_iscsi._snapshots import LioSnapshot
from flexhub_iscsi._sysfs import Session
from flexhub_loopfile import _Created
from flexhub_loopfile._loop import LoopDevice
from flexhub_loopfile._room import Room
from flexhub_nfs._options import Plan as NfsPlan
from flexhub_nfs._provision import Spec as NfsSpec

from flexhub.backend import Attachment, NodeRequirements
from flexhub.claimdir import MountedRoot
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
    # the shipped backends' records (they import no dataclasses either)
    (Portal, [("host", M), ("port", 3260)], ("10.0.0.1",), {"port": 3261}),
    (
        Target,
        [("iqn", M), ("lun", M), ("portals", M), ("iface", "default"), ("initiator_name", ""), ("chap_discovery", False), ("chap_session", False)],
        ("iqn.2003-01.org.x:t", 0, (Portal("h"),)),
        {"iface": "i", "chap_session": True},
    ),
    (Chap, [("prefix", M), ("username", M), ("password", M), ("username_in", ""), ("password_in", "")], ("p.", "u", "pw"), {"username_in": "ui", "password_in": "pi"}),
    (
        Settings,
        [("device_timeout", 20.0), ("multipath_timeout", 10.0), ("login_timeout", 60.0), ("command_timeout", 30.0), ("reservation_key", ""), ("capacity_secret_dir", "")],
        (25.0,),
        {"login_timeout": 5.0, "capacity_secret_dir": "/c"},
    ),
    (
        Session,
        [(n, M) for n in ("sid", "target", "iface", "address", "port", "state", "host", "path")] + [("initiator", "")],
        (1, "iqn.x", "default", "10.0.0.1", 3260, "LOGGED_IN", 2, Path("/sys/s")),
        {"initiator": "iqn.i"},
    ),
    (Authorization, [(n, M) for n in ("volume", "key", "generation", "granted", "expires")], ("v", 1, 2, 3.0, 4.0), {}),
    (NodeRecord, [("iqn", M), ("portal_dir", M), ("iface", M)], ("iqn.x", "10.0.0.1,3260,1", "default"), {}),
    (Registration, [("key", M), ("holder", M), ("initiator", M)], (1, True, "iqn.i"), {}),
    (Ssh, [("host", M), ("user", "root"), ("port", 22)], ("h",), {"user": "u", "port": 2222}),
    (
        LioClass,
        [("ssh", M), ("portals", M), ("iqn_prefix", M), ("directory", M), ("sparse", True), ("backstore", "fileio"), ("volume_group", ""), ("initiators", ()), ("node_secret", None), ("fs_type", "ext4"), ("overcommit", 1.0)],
        (Ssh("h"), (Portal("h"),), "iqn.p", "/d"),
        {"backstore": "block", "node_secret": ("ns", "s"), "overcommit": 2.0},
    ),
    (
        LioVolume,
        [("ssh", M), ("iqn", M), ("name", M), ("directory", M), ("sparse", M), ("backstore", "fileio"), ("volume_group", ""), ("overcommit", 1.0)],
        (Ssh("h"), "iqn.x", "n", "/d", True),
        {"volume_group": "vg"},
    ),
    (LioSnapshot, [("ssh", M), ("backstore", M), ("name", M), ("directory", ""), ("volume_group", "")], (Ssh("h"), "fileio", "n"), {"directory": "/d"}),
    (
        NfsPlan,
        [(n, M) for n in ("host", "share", "sub_path", "version", "options", "root_options", "read_only", "create_sub_path", "sub_path_mode")],
        ("h", "/e", "s", "4.2", ("rw",), ("rw",), False, True, 0o755),
        {},
    ),
    (NfsSpec, [(n, M) for n in ("options", "pattern", "uid", "gid", "mode", "fs_type")], ({"server": "h"}, "p", 0, 0, 0o755, ""), {}),
    (CifsPlan, [(n, M) for n in ("host", "share", "sub_path", "version", "options", "read_only")], ("h", "s", "p", "3.1.1", ("rw",), False), {}),
    (Credentials, [("username", M), ("password", M), ("domain", M)], ("u", "pw", "d"), {}),
    (MountedRoot, [("source", M), ("run", M), ("where", "export")], ("h:/e", print), {"where": "share"}),
    (CifsSpec, [(n, M) for n in ("options", "pattern", "secret", "fs_type")], ({"server": "h"}, "p", ("ns", "s"), "cifs"), {}),
]  # fmt: skip
#: Records whose ``repr`` is their own (it hides a credential), as their dataclass's was.
OWN_REPR = {
    Chap: "Chap(p.*, mutual)",
    Credentials: "Credentials(username='u', password='***', domain='d')",
}
#: Records ordered by their fields, as their ``order=True`` dataclass was.
ORDERED = (Portal, NodeRecord)


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
        if cls in OWN_REPR:
            assert "pw" not in repr(mine) and "pi" not in repr(mine)  # password, password_in
        else:
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


def test_a_record_that_would_lose_its_fields_is_refused_where_it_is_defined() -> None:
    from flexhub.backend import Frozen

    with pytest.raises(TypeError, match="lists its fields in __slots__"):

        class NoSlots(Frozen):  # its field would live in a __dict__, unseen by == and repr
            def __init__(self, a: int) -> None:
                self._set(a=a)

    with pytest.raises(TypeError, match="lists its fields in __slots__"):

        class OneString(Frozen):
            __slots__ = "name"

    with pytest.raises(TypeError, match="derive a record from Frozen itself"):

        class Wider(Portal):  # fields() would name "extra" only
            __slots__ = ("extra",)

    class Fine(Frozen):
        __slots__ = ("a",)

        def __init__(self, a: int) -> None:
            self._set(a=a)

    assert Fine(1) != Fine(2) and repr(Fine(1)).endswith(".Fine(a=1)")


def test_own_reprs_hide_the_credential() -> None:
    assert repr(Chap("p.", "u", "pw", "ui", "pi")) == OWN_REPR[Chap]
    assert repr(Credentials("u", "pw", "d")) == OWN_REPR[Credentials]


@pytest.mark.parametrize("cls", ORDERED, ids=[c.__name__ for c in ORDERED])
def test_ordered_records_sort_as_their_dataclass_did(cls: type) -> None:
    fields = list(cls.fields())  # type: ignore[attr-defined]
    ref = dataclasses.make_dataclass(cls.__name__, fields, frozen=True, order=True)
    values = [("b", 1, "x"), ("a", 2, "x"), ("a", 1, "y"), ("a", 1, "x"), ("b", 0, "a")]
    rows = [v[: len(fields)] for v in values]
    mine = sorted(cls(*r) for r in rows)
    theirs = sorted(ref(*r) for r in rows)
    assert [m.as_dict() for m in mine] == [dataclasses.asdict(t) for t in theirs]
    a, b = cls(*rows[1]), cls(*rows[0])
    ra, rb = ref(*rows[1]), ref(*rows[0])
    for op in ("__lt__", "__le__", "__gt__", "__ge__"):
        assert getattr(a, op)(b) == getattr(ra, op)(rb)
        assert getattr(a, op)(a) == getattr(ra, op)(ra)
    with pytest.raises(TypeError):
        _ = a < object()


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
