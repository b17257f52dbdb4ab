"""CSI ``GetCapacity`` of the iscsi backend on the host.

The provisioner's side with the recording ``ssh`` of ``test_provision`` (the request sent, the
key read from ``[iscsi] capacity_secret_dir``, refusals that send nothing, the CSI codes), and
the remote program's ``room`` run for real on a LUN directory on its own tmpfs, against the
room rule that refuses claims (:func:`flexhub_iscsi._lio_room.check_room`); its code is :mod:`flexhub_iscsi._lio_capacity`. The block
backstore's ``vgs`` is recorded (no volume group on the host).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import grpc
import pytest
from flexhub_iscsi import _lio, _lio_capacity, _lio_remote, _lio_room

from flexhub.config import NodeConfig
from flexhub.errors import FlexhubError, InvalidOptions, NotSupported
from flexhub.node import Node
from tests.iscsi.test_lio_snapshots import luns  # noqa: F401 (the fixture)
from tests.iscsi.test_provision import BLOCK, KEY, KNOWN, PARAMS, Ssh, request_of

MiB = 1 << 20
LUN = "pvc-0b7f3c1e-5d2a-4e8f-9a61-2c4d8e0f1a3b.img"
OTHER = "pvc-1c8f3c1e-5d2a-4e8f-9a61-2c4d8e0f1a3b.img"


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """The class's Secret as the controller's pod mounts it: its files symlinks into
    ``..data``."""
    directory = tmp_path / "iscsi-ssh"
    data = directory / "..data"
    data.mkdir(parents=True)
    (data / "ssh-privatekey").write_text(KEY)
    (data / "ssh-knownhosts").write_text(KNOWN)
    for name in ("ssh-privatekey", "ssh-knownhosts"):
        (directory / name).symlink_to(f"..data/{name}")
    return directory


def iscsi(runner: Ssh, tmp_path: Path, keys: Path | None) -> Any:
    from flexhub_iscsi import IscsiBackend

    settings = {"capacity_secret_dir": str(keys)} if keys else {}
    config = NodeConfig(state_dir=tmp_path / "state", backends={"iscsi": settings})
    return IscsiBackend(Node(config, "iscsi", runner))


# --------------------------------------------------------------------------- provisioner's side


@pytest.mark.parametrize("params", [PARAMS, BLOCK], ids=["fileio", "block"])
def test_capacity_asks_the_target_host_with_the_mounted_key(
    tmp_path: Path, keys: Path, params: dict[str, str]
) -> None:
    runner = Ssh({"ok": {"available": 40 * MiB}})
    backend = iscsi(runner, tmp_path, keys)
    assert backend.capacity(params) == 40 * MiB
    assert backend.max_volume_size(params) is None  # the room is the bound
    request = request_of(runner)
    assert request["action"] == "room"
    if params is BLOCK:
        assert request["spec"] == {"backstore": "block", "vg": "vg_iscsi"}
    else:
        assert request["spec"] == {"directory": "/srv/iscsi", "sparse": True, "overcommit": 1.0}
    assert runner.files["IdentityFile"] == (0o600, KEY)
    assert runner.files["UserKnownHostsFile"] == (0o600, KNOWN)
    assert KEY not in " ".join(" ".join(a) for a in runner.raw)
    (argv,) = runner.raw
    assert argv[-7:] == ("root", "--", "10.0.0.5", *_lio.REMOTE_COMMAND)


def test_capacity_of_a_preallocating_overcommitted_class_sends_both(
    tmp_path: Path, keys: Path
) -> None:
    runner = Ssh({"ok": {"available": 0}})
    params = {**PARAMS, "sparse": "false", "overcommit": "2.5"}
    assert iscsi(runner, tmp_path, keys).capacity(params) == 0
    assert request_of(runner)["spec"] == {
        "directory": "/srv/iscsi",
        "sparse": False,
        "overcommit": 2.5,
    }


def test_capacity_refusals_send_nothing(tmp_path: Path, keys: Path) -> None:
    runner = Ssh()
    with pytest.raises(NotSupported, match="capacity_secret_dir"):
        iscsi(runner, tmp_path, None).capacity(PARAMS)
    with pytest.raises(NotSupported, match="class's parameters"):
        iscsi(runner, tmp_path, keys).capacity({})
    with pytest.raises(InvalidOptions, match="iqnPrefix"):
        iscsi(runner, tmp_path, keys).capacity({**PARAMS, "iqnPrefix": "nope"})
    (keys / "..data" / "ssh-knownhosts").unlink()
    with pytest.raises(FlexhubError, match="ssh-knownhosts") as caught:
        iscsi(runner, tmp_path, keys).capacity(PARAMS)
    assert KEY not in caught.value.message
    assert runner.calls == []
    with pytest.raises(FlexhubError, match="capacity_secret_dir must be an absolute path"):
        iscsi(runner, tmp_path, Path("relative")).capacity(PARAMS)


@pytest.mark.parametrize(
    "answer",
    [{"error": "fileioDirectory /srv/iscsi: No such file or directory"}, {"ok": {}},
     {"ok": {"available": -1}}, {"ok": {"available": "9"}}],
)  # fmt: skip
def test_a_refused_or_malformed_answer_is_an_error(
    tmp_path: Path, keys: Path, answer: dict[str, Any]
) -> None:
    with pytest.raises(FlexhubError, match=r"10\.0\.0\.5"):
        iscsi(Ssh(answer, rc=3 if "error" in answer else 0), tmp_path, keys).capacity(PARAMS)


class Context:
    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise Aborted(code, message)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


def controller(tmp_path: Path, runner: Ssh, settings: dict[str, Any]) -> Any:
    from flexhub.csi.controller import ControllerService

    config = NodeConfig(state_dir=tmp_path / "state", backends={"iscsi": settings})
    service = ControllerService(config, "node-a")
    original = service._backend

    def with_runner(name: str) -> Any:
        found = original(name)
        found.node.runner = runner
        return found

    service._backend = with_runner  # type: ignore[method-assign]
    return service


def test_the_csi_controller_answers_get_capacity_for_an_iscsi_class(
    tmp_path: Path, keys: Path
) -> None:
    from flexhub.csi.proto import csi_pb2

    runner = Ssh({"ok": {"available": 40 * MiB}})
    service = controller(tmp_path, runner, {"capacity_secret_dir": str(keys)})
    sidecar = {"csi.storage.k8s.io/provisioner-secret-name": "iscsi-ssh"}
    parameters = {"backend": "iscsi", **PARAMS, **sidecar}
    got = service.GetCapacity(csi_pb2.GetCapacityRequest(parameters=parameters), Context())
    assert got.available_capacity == 40 * MiB and got.maximum_volume_size.value == 40 * MiB
    assert request_of(runner)["spec"]["directory"] == "/srv/iscsi"
    # csi-sanity's request names nothing: iscsi, which needs a class, is left out (no call)
    calls = len(runner.calls)
    empty = service.GetCapacity(csi_pb2.GetCapacityRequest(), Context())
    assert empty.available_capacity == 0 and len(runner.calls) == calls
    codes = {}
    for name, which, answer in [
        ("unset", controller(tmp_path, runner, {}), None),
        ("refused", service, {"error": "volume group vg_iscsi not found"}),
        ("room", service, {"error": "no", "room": True}),
    ]:
        runner.answer, runner.rc = answer or runner.answer, 3 if answer else 0
        with pytest.raises(Aborted) as caught:
            which.GetCapacity(csi_pb2.GetCapacityRequest(parameters=parameters), Context())
        assert KEY.splitlines()[1] not in caught.value.message
        codes[name] = caught.value.code
    assert codes == {
        "unset": grpc.StatusCode.INVALID_ARGUMENT,
        "refused": grpc.StatusCode.INTERNAL,
        "room": grpc.StatusCode.RESOURCE_EXHAUSTED,
    }


# --------------------------------------------------------------------------- the target host


def spec_of(directory: Path, overcommit: float = 1.0, sparse: bool = True) -> dict[str, Any]:
    return {"directory": str(directory), "sparse": sparse, "overcommit": overcommit}


def write(path: Path, size: int, written: int) -> None:
    with open(path, "wb") as fh:
        fh.truncate(size)
        fh.write(b"\x5a" * written)
        os.fsync(fh.fileno())
    path.chmod(0o600)


def admits(directory: Path, size: int, overcommit: float = 1.0, sparse: bool = True) -> bool:
    try:
        _lio_room.check_room(str(directory), OTHER, size, overcommit, sparse)
    except _lio_room.NoRoomLeft:
        return False
    return True


@pytest.mark.parametrize(
    ("overcommit", "sparse"), [(1.0, True), (2.0, True), (1.5, False)], ids=str
)
def test_room_is_what_the_room_rule_admits(
    luns: Path,  # noqa: F811
    overcommit: float,
    sparse: bool,
) -> None:
    """On a real tmpfs: the room answered is the largest claim check_room admits (to the
    MiB), with a sparse LUN file half written in the directory and nothing else counted."""
    assert _lio_capacity.room(spec_of(luns, overcommit, sparse))["available"] > 0
    write(luns / LUN, 24 * MiB, 8 * MiB)
    (luns / "not-a-lun.img").write_bytes(b"\0" * MiB)  # not counted, but not free
    available = _lio_capacity.room(spec_of(luns, overcommit, sparse))["available"]
    vfs = os.statvfs(luns)
    free = vfs.f_bavail * vfs.f_frsize
    expected = int((free + 8 * MiB) * overcommit) - 24 * MiB
    assert available == (min(expected, free) if not sparse else expected)
    assert admits(luns, available - available % MiB, overcommit, sparse)
    assert not admits(luns, available + MiB, overcommit, sparse)


def test_room_is_never_negative(luns: Path) -> None:  # noqa: F811
    write(luns / LUN, 1024 * MiB, 0)  # promises far more than the tmpfs holds (overcommit)
    assert _lio_capacity.room(spec_of(luns))["available"] == 0


def test_room_refuses_a_directory_others_can_write(tmp_path: Path, luns: Path) -> None:  # noqa: F811
    from flexhub_iscsi._lio_errors import Refused

    luns.chmod(0o777)
    try:
        with pytest.raises(Refused, match="writable by no one else"):
            _lio_capacity.room(spec_of(luns))
    finally:
        luns.chmod(0o755)
    with pytest.raises(Refused, match="No such file"):
        _lio_capacity.room(spec_of(tmp_path / "missing"))


def test_room_of_a_volume_group_is_its_free_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, ...]] = []

    def lvm(step: str, *args: str) -> str:
        asked.append(args)
        vgs = [{"vg_name": "other", "vg_free": "1"}, {"vg_name": "vg_iscsi", "vg_free": "4194304"}]
        return json.dumps({"report": [{"vg": vgs}]})

    monkeypatch.setattr(_lio_capacity, "lvm", lvm)
    assert _lio_capacity.room({"backstore": "block", "vg": "vg_iscsi"}) == {"available": 4 * MiB}
    assert asked == [("vgs", "--reportformat", "json", "--units", "b", "--nosuffix",
                      "-o", "vg_name,vg_free", "--", "vg_iscsi")]  # fmt: skip
    from flexhub_iscsi._lio_errors import Refused

    with pytest.raises(Refused, match="volume group gone not found"):
        _lio_capacity.room({"backstore": "block", "vg": "gone"})


def test_room_takes_no_lock_and_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """``room`` changes nothing, so it waits on no copy that holds the lock."""
    assert _lio_remote.ACTIONS["room"] is _lio_capacity.room
    assert frozenset({"room"}) == _lio_remote.READ_ONLY
    from flexhub_iscsi import _lio_ssh

    text = _lio_ssh.remote_program()
    assert "\ndef room(spec" in text
    compile(text, "remote", "exec")
