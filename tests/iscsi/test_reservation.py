"""Fencing logic of the iscsi backend against a fake persistent-reservation target.

Two "nodes" are two backends with their own state directory and their own fake sysfs (so
their own device paths, i.e. I_T nexuses), sharing one :class:`FakePR` LUN. The real thing
is tested in the VM (``tests/vm/test_iscsi_fence.py``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from flexhub_iscsi import IscsiBackend
from flexhub_iscsi._options import Settings
from flexhub_iscsi._reservation import (
    authorize_preempt,
    format_key,
    machine_id_problem,
    node_key,
    parse_key,
    pending_preempt,
)

from flexhub.backend import CommandError, Result, Volume, VolumeError
from flexhub.config import NodeConfig
from flexhub.errors import FlexhubError
from flexhub.node import Node

from .conftest import IQN, FakeIscsi, FakePR, FakeSysfs, MiB

VOLUME_ID = f"iscsi:{IQN}:0"


def make_node(base: Path, pr: FakePR, **settings: object) -> IscsiBackend:
    sysfs = FakeSysfs(base / "sys", base / "dev")
    sysfs.exported[IQN] = {0: 64 * MiB}
    runner = FakeIscsi(sysfs, pr=pr)
    config = NodeConfig(
        state_dir=base / "state",
        log_dir=base / "log",
        lock_timeout=5,
        backends={"iscsi": {"device_timeout": 0.5, **settings}},
    )
    backend = IscsiBackend(Node(config, backend="iscsi", runner=runner))
    backend.sysfs = sysfs
    return backend


def volume(read_only: bool = False, **extra: str) -> Volume:
    options = {"backend": "iscsi", "targetPortal": "127.0.0.1", "iqn": IQN, "lun": "0", **extra}
    return Volume(options=options, fs_type="ext4", read_only=read_only)


def key(backend: IscsiBackend) -> int:
    return node_key(backend.node.state_dir)


def runner(backend: IscsiBackend) -> FakeIscsi:
    assert isinstance(backend.node.runner, FakeIscsi)
    return backend.node.runner


@pytest.fixture
def pr() -> FakePR:
    return FakePR()


@pytest.fixture
def a(tmp_path: Path, pr: FakePR) -> IscsiBackend:
    return make_node(tmp_path / "a", pr)


@pytest.fixture
def b(tmp_path: Path, pr: FakePR) -> IscsiBackend:
    return make_node(tmp_path / "b", pr)


# --------------------------------------------------------------------------- keys


def test_node_key_is_stable_and_differs_per_state_dir(tmp_path: Path) -> None:
    machine = tmp_path / "machine-id"
    machine.write_text("3d1219c7c4c5404aaa1f6d2a48adfda4\n")
    one = node_key(tmp_path / "one", machine_id=machine)
    assert one == node_key(tmp_path / "one", machine_id=machine)
    assert one != node_key(tmp_path / "two", machine_id=machine)
    machine.write_text("4e2219c7c4c5404aaa1f6d2a48adfda4\n")
    assert one != node_key(tmp_path / "one", machine_id=machine)
    assert 0 < one < 2**64


def test_clones_with_their_own_initiator_names_get_their_own_keys(tmp_path: Path) -> None:
    """Two machines cloned from one image share /etc/machine-id and (the same path of) the
    state directory; once each has its own initiator name, their keys differ."""
    machine = tmp_path / "machine-id"
    machine.write_text("3d1219c7c4c5404aaa1f6d2a48adfda4\n")
    names = []
    for node in ("worker-1", "worker-2", "worker-1"):
        path = tmp_path / f"initiatorname-{node}"
        path.write_text(
            f"## written by iscsi-iname\nInitiatorName=iqn.2004-10.com.example:{node}\n"
        )
        names.append(node_key(Path("/var/lib/flexhub"), machine_id=machine, initiator_file=path))
    assert names[0] != names[1] and names[0] == names[2]


@pytest.mark.parametrize("placeholder", ["", "uninitialized", "0" * 32])
def test_a_machine_id_that_tells_no_machine_apart_derives_no_key(
    tmp_path: Path, placeholder: str
) -> None:
    machine = tmp_path / "machine-id"
    machine.write_text(placeholder + "\n")
    assert machine_id_problem(machine)
    with pytest.raises(FlexhubError, match=r"machine-id.*set \[iscsi\] reservation_key"):
        node_key(tmp_path, machine_id=machine)
    assert node_key(tmp_path, "0xabc", machine_id=machine) == 0xABC


def test_node_key_override_and_errors(tmp_path: Path) -> None:
    assert node_key(tmp_path, "0xABC") == 0xABC
    assert node_key(tmp_path, "1f", machine_id=tmp_path / "none") == 0x1F
    with pytest.raises(FlexhubError, match=r"machine-id|reservation_key"):
        node_key(tmp_path, machine_id=tmp_path / "none")
    for bad in ("0", "0x", "xyz", "0x" + "f" * 17, "-1"):
        with pytest.raises(FlexhubError, match="hex"):
            parse_key(bad)
    with pytest.raises(FlexhubError, match=r"\[iscsi\] reservation key"):
        Settings.from_table({"reservation_key": "nope"})
    assert Settings.from_table({"reservation_key": "0x1"}).reservation_key == "0x1"


def test_configured_key_is_used(tmp_path: Path, pr: FakePR) -> None:
    node = make_node(tmp_path / "n", pr, reservation_key="0xfeed")
    attachment = node.attach(volume())
    assert attachment.details["reservation"] == format_key(0xFEED)
    assert pr.holder is not None and pr.holder[1] == 0xFEED


# --------------------------------------------------------------------------- two nodes


def test_second_writer_is_refused_reader_is_not(
    a: IscsiBackend, b: IscsiBackend, pr: FakePR
) -> None:
    first = a.attach(volume())
    assert first.details["reservation"] == format_key(key(a))
    assert pr.holder == (first.device, key(a))
    assert set(pr.registered.values()) == {key(a)}

    with pytest.raises(VolumeError) as info:
        b.attach(volume())
    message = info.value.message
    assert f"reserved for writing by key {format_key(key(a))}" in message
    assert f"flexhub fence preempt --volume {VOLUME_ID} --key {format_key(key(a))}" in message
    assert "\n" not in message
    # B registered nothing, kept no session; A still holds the LUN.
    assert set(pr.registered.values()) == {key(a)} and pr.holder == (first.device, key(a))
    assert b.sysfs.sessions() == []

    reader = b.attach(volume(read_only=True))
    assert "reservation" not in reader.details
    assert set(pr.registered.values()) == {key(a)}
    b.detach(reader)

    a.detach(first)
    assert pr.holder is None and pr.registered == {}
    second = b.attach(volume())
    assert pr.holder == (second.device, key(b))
    b.detach(second)
    assert pr.holder is None and pr.registered == {}


def test_reattach_by_the_holder_is_idempotent(a: IscsiBackend, pr: FakePR) -> None:
    first = a.attach(volume())
    again = a.attach(volume())
    assert again.device == first.device and pr.holder == (first.device, key(a))
    a.detach(again)
    assert pr.holder is None and pr.registered == {}


def test_race_lost_between_read_and_reserve_unregisters(
    a: IscsiBackend, b: IscsiBackend, pr: FakePR
) -> None:
    """B saw no reservation, but A reserved before B's RESERVE: B backs out."""
    first = a.attach(volume())
    holder = pr.holder
    pr.holder = None  # what B's first read sees
    original = pr.__call__

    def racing(args: tuple[str, ...]) -> Result:
        if "--reserve" in args:
            pr.holder = holder  # A's reservation lands first
        return original(args)

    runner(b).pr = racing  # type: ignore[assignment]
    with pytest.raises(VolumeError, match=f"reserved for writing by key {format_key(key(a))}"):
        b.attach(volume())
    assert set(pr.registered.values()) == {key(a)}
    a.detach(first)


def test_a_rollback_from_progress_releases_the_reservation(tmp_path: Path) -> None:
    """An attach killed after it reserved the LUN, before the core journalled its return, is
    undone from what it reported (``release(partial)``): the reservation is reported before
    the key is registered, so the rollback unregisters it and the LUN is free for another
    node (before the fix the key stayed registered, holding the LUN)."""
    pr = FakePR()
    a = make_node(tmp_path / "a", pr)
    b = make_node(tmp_path / "b", pr)
    partial: dict[str, str] = {}

    def report(details: Mapping[str, str]) -> None:
        partial.update(details)

    a.node.progress = report
    a.attach(volume())  # SIGKILL right after it returns: the core journalled only the
    assert pr.holder is not None  # intent and its reports
    assert partial["reservation"] == format_key(key(a))
    a.release(partial)  # the next call's rollback of that intent
    assert a.sysfs.sessions() == []
    assert pr.registered == {} and pr.holder is None, (pr.registered, pr.holder)
    b.detach(b.attach(volume()))  # another node can now take the LUN


@pytest.mark.parametrize("failure", ["full-status", "interrupt"])
def test_whatever_stops_acquire_after_registering_unregisters(
    a: IscsiBackend, pr: FakePR, failure: str
) -> None:
    """The key is registered, then the holder check fails (a PR IN error) or the call is
    interrupted during RESERVE: the attach fails and this node's key is registered nowhere
    (before the fix it stayed registered: a node that may write with nobody knowing)."""
    original = pr.__call__

    def failing(args: tuple[str, ...]) -> Result:
        if failure == "full-status" and "--read-full-status" in args:
            return Result(args, 3, "", "PR in: aborted command")
        if failure == "interrupt" and "--reserve" in args:
            raise KeyboardInterrupt
        return original(args)

    runner(a).pr = failing  # type: ignore[assignment]
    expected: type[BaseException] = VolumeError if failure == "full-status" else KeyboardInterrupt
    with pytest.raises(expected):
        a.attach(volume())
    assert pr.registered == {} and pr.holder is None, (pr.registered, pr.holder)


def test_a_preemption_that_does_not_verify_keeps_the_permission(
    a: IscsiBackend, b: IscsiBackend, pr: FakePR
) -> None:
    """The operator's permission is consumed only once this node is verified to hold the
    LUN: a preemption whose holder check then fails leaves it (and this node unregistered);
    before the fix it was deleted as used."""
    a.attach(volume())
    generation = _refused_generation(b)
    authorize_preempt(b.node.state_dir, VOLUME_ID, key(a), generation)
    original = pr.__call__

    def failing(args: tuple[str, ...]) -> Result:
        if "--read-full-status" in args:
            return Result(args, 3, "", "PR in: aborted command")
        return original(args)

    runner(b).pr = failing  # type: ignore[assignment]
    with pytest.raises(VolumeError, match="cannot read the full status"):
        b.attach(volume())
    assert pending_preempt(b.node.state_dir, VOLUME_ID) is not None
    assert key(b) not in pr.registered.values()


def _refused_generation(backend: IscsiBackend) -> int:
    """The PR generation the refused mount's message names (what the operator copies)."""
    with pytest.raises(VolumeError) as refused:
        backend.attach(volume())
    message = refused.value.message
    found = re.search(r"--generation (0x[0-9a-f]+)'", message)
    assert found is not None and "\n" not in message, message
    return int(found.group(1), 16)


def test_operator_preemption_is_one_shot_and_key_bound(
    a: IscsiBackend, b: IscsiBackend, pr: FakePR
) -> None:
    first = a.attach(volume())
    state = b.node.state_dir
    generation = _refused_generation(b)
    assert generation == pr.generation
    # permission for another key: refused, and the message says so
    authorize_preempt(state, VOLUME_ID, 0x1234, generation)
    with pytest.raises(VolumeError, match="preemption allowed on this node is for key"):
        b.attach(volume())
    assert pr.holder == (first.device, key(a))

    authorize_preempt(state, VOLUME_ID, key(a), generation)
    taken = b.attach(volume())
    assert pr.holder == (taken.device, key(b))
    assert set(pr.registered.values()) == {key(b)}  # A cannot write any more
    assert pending_preempt(state, VOLUME_ID) is None  # used up

    # A comes back and tries again: refused, no automatic preemption either way.
    with pytest.raises(VolumeError, match=f"by key {format_key(key(b))}"):
        a.attach(volume())
    b.detach(taken)
    a.detach(first)  # the dead node's late cleanup: nothing of B's is touched
    assert pr.holder is None and pr.registered == {}


def test_a_preemption_left_unused_cannot_preempt_a_holder_that_came_back(
    a: IscsiBackend, b: IscsiBackend, pr: FakePR
) -> None:
    """Allowed while A looked dead; A registers again (its generation moves): B's next
    mount is refused and the stale authorization deleted, A keeps writing."""
    first = a.attach(volume())
    generation = _refused_generation(b)
    authorize_preempt(b.node.state_dir, VOLUME_ID, key(a), generation)
    a.attach(volume())  # A alive: it registers its paths again (an attach after a restart)
    assert pr.generation > generation
    with pytest.raises(VolumeError) as refused:
        b.attach(volume())
    message = refused.value.message
    assert f"generation {generation:#x} then, {pr.generation:#x} now" in message, message
    assert f"--generation {pr.generation:#x}'" in message
    assert pr.holder == (first.device, key(a)) and set(pr.registered.values()) == {key(a)}
    assert pending_preempt(b.node.state_dir, VOLUME_ID) is None
    a.detach(first)


def test_an_expired_preemption_is_refused(a: IscsiBackend, b: IscsiBackend, pr: FakePR) -> None:
    first = a.attach(volume())
    generation = _refused_generation(b)
    grant = authorize_preempt(
        b.node.state_dir, VOLUME_ID, key(a), generation, ttl=60, now=time.time() - 61
    )
    assert grant.expired()
    with pytest.raises(VolumeError, match=r"allowed on this node expired at \d{4}-"):
        b.attach(volume())
    assert pr.holder == (first.device, key(a)) and pr.generation == generation
    assert pending_preempt(b.node.state_dir, VOLUME_ID) is None
    a.detach(first)


def test_a_clone_with_the_same_key_is_caught_after_reserving(tmp_path: Path, pr: FakePR) -> None:
    """Two machines derive one key (a cloned machine id and initiator file): B finds "its
    own" key holding the LUN, but READ FULL STATUS shows it held through A's initiator."""
    a = make_node(tmp_path / "a", pr, reservation_key="0xc10e")
    b = make_node(tmp_path / "b", pr, reservation_key="0xc10e")
    first = a.attach(volume())
    with pytest.raises(VolumeError) as refused:
        b.attach(volume())
    message = refused.value.message
    assert "through initiator iqn.2024-01.test.fake:a" in message, message
    assert "not this node's (iqn.2024-01.test.fake:b)" in message and "\n" not in message
    assert pr.holder == (first.device, 0xC10E)
    assert list(pr.registered) == [first.device]  # B's own registration was withdrawn
    assert b.sysfs.sessions() == []
    a.detach(first)


def test_without_read_full_status_the_key_is_checked(a: IscsiBackend, pr: FakePR) -> None:
    pr.full_status = False
    attachment = a.attach(volume())
    assert pr.holder == (attachment.device, key(a))
    a.detach(attachment)


def test_target_without_reservations(a: IscsiBackend, pr: FakePR) -> None:
    pr.supported = False
    with pytest.raises(VolumeError, match=r'does not support SCSI-3 persistent.*fencing: "none"'):
        a.attach(volume())
    assert a.sysfs.sessions() == []
    unfenced = a.attach(volume(fencing="none"))
    assert "reservation" not in unfenced.details
    a.detach(unfenced)
    reader = a.attach(volume(read_only=True))
    assert not [c for c in runner(a).calls if c[0] == "sg_persist" and "--out" in c]
    a.detach(reader)


def test_release_failure_does_not_block_the_unmount(a: IscsiBackend, pr: FakePR) -> None:
    first = a.attach(volume())
    runner(a).answer("sg_persist", "--register-ignore", rc=2, stderr="Device not ready")
    a.detach(first)  # logged, not raised: the device is still removed
    assert a.sysfs.sessions() == []


# ------------------------------------------------- an LIO target that cannot save its PR state


def _pr_out(backend: IscsiBackend) -> list[list[str]]:
    return [c for c in runner(backend).calls if c[0] == "sg_persist" and "--out" in c]


def test_not_ready_names_the_missing_lio_pr_directory(a: IscsiBackend, pr: FakePR) -> None:
    """LIO without ``<dbroot>/pr`` registers the key, then answers NOT READY: the read-write
    mount is refused in one line that names the likely cause and the fix (before the fix it
    said only "Device not ready sg_persist failed"), and the key is unregistered again."""
    pr.no_pr_dir = True
    with pytest.raises(VolumeError) as info:
        a.attach(volume())
    message = info.value.message
    assert "\n" not in message, message
    assert "NOT READY" in message and "cannot register the reservation key" in message
    assert "Linux LIO" in message and "<dbroot>/pr" in message, message
    assert 'mkdir -p "$(cat /sys/kernel/config/target/dbroot)/pr"' in message, message
    assert pr.registered == {} and pr.holder is None, (pr.registered, pr.holder)
    assert a.sysfs.sessions() == []


def test_not_ready_is_not_retried(a: IscsiBackend, pr: FakePR) -> None:
    """Each PR OUT that LIO answers NOT READY still took effect and moved the PR generation:
    one REGISTER and one unregistration of the rollback, nothing more."""
    pr.no_pr_dir = True
    with pytest.raises(VolumeError, match="NOT READY"):
        a.attach(volume())
    sarks = [next(w for w in c if w.startswith("--param-sark=")) for c in _pr_out(a)]
    assert sarks == [f"--param-sark={key(a):#x}", "--param-sark=0x0"], _pr_out(a)
    assert pr.generation == 1


def test_an_unregistration_answered_not_ready_that_took_effect_is_a_release(
    a: IscsiBackend, pr: FakePR, caplog: pytest.LogCaptureFixture
) -> None:
    """The release is judged by reading the keys back: LIO answered NOT READY but no longer
    lists this node's key, so the LUN is released (before the fix: "releasing the
    reservation failed", with the LUN free)."""
    first = a.attach(volume())
    pr.no_pr_dir = True
    with caplog.at_level("INFO"):
        a.detach(first)
    assert pr.registered == {} and pr.holder is None
    assert "releasing the reservation failed" not in caplog.text, caplog.text
    assert f"released key {format_key(key(a))}" in caplog.text, caplog.text
    assert a.sysfs.sessions() == []


def test_an_unregistration_answered_success_but_still_listed_is_a_failure(
    a: IscsiBackend, pr: FakePR, caplog: pytest.LogCaptureFixture
) -> None:
    """The target answers the unregistration with success but still lists this node's key:
    the release failed, and says so (before the fix it was taken at its word)."""
    first = a.attach(volume())
    runner(a).answer("sg_persist", "--register-ignore", "--param-sark=0x0", rc=0)
    with caplog.at_level("INFO"):
        a.detach(first)  # logged, not raised: the device is still removed
    assert set(pr.registered.values()) == {key(a)}
    assert "releasing the reservation failed" in caplog.text, caplog.text
    assert f"key {format_key(key(a))} is still registered" in caplog.text, caplog.text
    assert a.sysfs.sessions() == []


# --------------------------------------------------------------------------- admin command


def test_fence_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI on a node without a path to the LUN (the host has no iSCSI session): the
    generation comes from the refused mount's message."""
    from flexhub.__main__ import main  # as the command line reaches it

    state = tmp_path / "state"
    config = tmp_path / "flexhub.toml"
    config.write_text(f'state_dir = "{state}"\n')
    assert main(["fence", "key", "--config", str(config)]) == 0
    own = capsys.readouterr().out.strip()
    assert own == format_key(node_key(state))

    base = ["fence", "preempt", "--volume", VOLUME_ID, "--key", "0x1234", "--config", str(config)]
    assert main(base) != 0
    assert "--generation" in capsys.readouterr().err  # no path to read it from: say so
    assert main([*base, "--generation", "0x1c"]) == 0
    out = capsys.readouterr().out
    assert "will preempt key 0x0000000000001234" in out and "generation 0x1c" in out, out
    grant = pending_preempt(state, VOLUME_ID)
    assert grant is not None and (grant.key, grant.generation) == (0x1234, 0x1C)
    assert 899 <= grant.expires - time.time() <= 900

    for extra, error in (
        (["--volume", "nfs:srv:/x", "--key", "0x1"], "is not iscsi:"),
        (["--volume", VOLUME_ID, "--key", "zz"], "hex"),
        (["--volume", VOLUME_ID, "--key", own], "own key"),
        (["--volume", VOLUME_ID, "--key", "0x1", "--generation", "x"], "PR generation"),
        (["--volume", VOLUME_ID, "--key", "0x1", "--generation", "1", "--ttl", "2d"], "ttl"),
        (["--volume", VOLUME_ID, "--key", "0x1", "--generation", "1", "--ttl", "0"], "ttl"),
    ):
        assert main(["fence", "preempt", *extra, "--config", str(config)]) != 0
        assert error in capsys.readouterr().err
    assert pending_preempt(state, VOLUME_ID) == grant  # the refused calls changed nothing

    # list: volume, key, generation, expiry; nothing secret is in the record anyway
    other = f"iscsi:{IQN}:3"
    authorize_preempt(state, other, 0xBEEF, 7, ttl=60, now=time.time() - 120)
    assert main(["fence", "list", "--config", str(config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines
    assert lines[1].split()[:3] == [VOLUME_ID, "0x0000000000001234", "0x1c"]
    assert "in 1" in lines[1] or "in 9" in lines[1] or "in 14m" in lines[1], lines[1]
    assert lines[2].split()[:3] == [other, "0x000000000000beef", "0x7"] and "expired" in lines[2]
    assert main(["fence", "list", "--json", "--config", str(config)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [g["volume"] for g in listed] == [VOLUME_ID, other]

    # cancel: by volume, refusing another key; nothing to cancel is an error
    argv = ["fence", "cancel", "--volume", VOLUME_ID, "--config", str(config)]
    assert main([*argv, "--key", "0x999"]) != 0
    assert "is for key 0x0000000000001234" in capsys.readouterr().err
    assert pending_preempt(state, VOLUME_ID) == grant
    assert main([*argv, "--key", "0x1234"]) == 0
    assert "cancelled" in capsys.readouterr().out
    assert pending_preempt(state, VOLUME_ID) is None
    assert main(argv) != 0
    assert "no pending preemption" in capsys.readouterr().err
    assert main(["fence", "cancel", "--volume", other, "--config", str(config)]) == 0
    capsys.readouterr()
    assert main(["fence", "list", "--config", str(config)]) == 0
    assert "no pending preemption" in capsys.readouterr().out
    assert [p.name for p in (state / "fence").iterdir()] == []


def test_missing_sg_persist_is_named(a: IscsiBackend) -> None:
    def missing(args: tuple[str, ...]) -> Result:
        raise CommandError(f"{args[0]} could not start: No such file or directory")

    runner(a).answers.append((("sg_persist",), missing))
    with pytest.raises(VolumeError, match=r"could not start.*\(install sg3-utils\)"):
        a.attach(volume())
    assert a.sysfs.sessions() == []


def test_schema_knows_fencing() -> None:
    from flexhub.driver.validation import validate_options

    options = {"backend": "iscsi", "targetPortal": "127.0.0.1", "iqn": IQN, "lun": "0"}
    for value in ("none", "scsi3-pr"):
        validate_options(IscsiBackend, {**options, "fencing": value})
    with pytest.raises(FlexhubError, match="fencing"):
        validate_options(IscsiBackend, {**options, "fencing": "off"})


def test_fence_commands_on_an_unusable_state_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from flexhub.__main__ import main

    state = tmp_path / "state"
    state.mkdir()
    (state / "fence").write_text("not a directory\n")
    config = tmp_path / "flexhub.toml"
    config.write_text(f'state_dir = "{state}"\n')
    argv = ["fence", "preempt", "--volume", VOLUME_ID, "--key", "0x1234", "--generation", "3"]
    for command in (argv, ["fence", "list"]):
        assert main([*command, "--config", str(config)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("flexhub: cannot ") and err.count("\n") == 1, err


#: What LIO answered to ``sg_persist --read-full-status`` in the VM rig, plus a second
#: registration of the same key through another initiator (a clone).
LIO_FULL_STATUS = """  PR generation=0x3
    Key=0x1234
      All target ports bit clear
      Relative port address: 0x1
      << Reservation holder >>
      scope: LU_SCOPE,  type: Write Exclusive, registrants only
      Transport Id of initiator:
        iSCSI world wide unique port id: iqn.2026-01.io.flexhub:rig-node,i,0x00023d000001
    Key=0x1234
      All target ports bit clear
      Relative port address: 0x1
      not reservation holder
      Transport Id of initiator:
        iSCSI world wide unique port id: iqn.2026-01.io.flexhub:clone,i,0x00023d000002
"""


def test_full_status_as_lio_prints_it() -> None:
    from flexhub_iscsi._reservation import (
        Registration,
        foreign_registrations,
        parse_full_status,
    )

    generation, registrations = parse_full_status(LIO_FULL_STATUS)
    assert generation == 3
    assert registrations == [
        Registration(0x1234, True, "iqn.2026-01.io.flexhub:rig-node"),
        Registration(0x1234, False, "iqn.2026-01.io.flexhub:clone"),
    ]
    mine = ["iqn.2026-01.io.flexhub:rig-node"]
    assert foreign_registrations(registrations, 0x1234, mine) == registrations[1:]
    assert foreign_registrations(registrations, 0x9, mine) == []
    assert parse_full_status("  PR generation=0x2\n  No full status descriptors\n") == (2, [])


def test_a_refused_fencing_leaves_nothing_for_the_rollback_to_unregister(
    a: IscsiBackend, b: IscsiBackend, pr: FakePR
) -> None:
    """B's read-write mount is refused (A holds the LUN) before B registered: what it
    reported names no reservation, so the rollback from it runs no unregistration (and logs
    no "reservation cannot be released" for a key that was never registered)."""
    first = a.attach(volume())
    partial: dict[str, str] = {}
    b.node.progress = partial.update
    with pytest.raises(VolumeError, match="reserved for writing"):
        b.attach(volume())
    assert partial["reservation"] == ""
    b.release(partial)
    assert not any("--register-ignore" in c for c in runner(b).calls)
    assert pr.holder == (first.device, key(a))
    a.detach(first)
