"""iSCSI provisioning on the host: StorageClass parameters, the ssh command and what it is fed.

A recording runner stands in for ``ssh`` here (there is no target host on the host): these
tests check the logic and the text built, and that nothing secret reaches a command line.
The real thing (sshd, LIO, the node driver) is ``tests/vm/test_iscsi_provision.py``. The
remote program's file checks run for real on the host's filesystem (``test_remote_*``).
"""

from __future__ import annotations

import ast
import json
import os
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from flexhub_iscsi import IscsiBackend, _lio, _lio_lvm, _lio_remote, _lio_ssh

from flexhub.config import NodeConfig
from flexhub.driver.validation import validate_options, validator_for
from flexhub.errors import FlexhubError, InvalidOptions, NoRoom
from flexhub.node import Node
from flexhub.node.runner import RecordingRunner, Result
from flexhub.provisioner import pvapi, pvs
from flexhub.provisioning import Claim, Provisioned, Provisioning
from flexhub.volume import Secret, Secrets

UID = "0b7f3c1e-5d2a-4e8f-9a61-2c4d8e0f1a3b"
KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAAfakekeybody\n-----END OPENSSH PRIVATE KEY-----\n"
KNOWN = "[10.0.0.5]:2222 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIfakehostkey\n"
PASSWORD = "Chap-Secret-Pw-41xZ"
PARAMS = {
    "targetHost": "10.0.0.5",
    "sshPort": "2222",
    "portals": "10.0.1.5:3260, 10.0.2.5",
    "iqnPrefix": "iqn.2003-01.com.example:k8s",
    "fileioDirectory": "/srv/iscsi",
    "initiators": "iqn.1993-08.org.debian:01:node-a",
    "nodeSecretName": "iscsi-chap",
    "nodeSecretNamespace": "flexhub",
}
#: The same class with an LVM logical volume per claim.
BLOCK = {
    **{k: v for k, v in PARAMS.items() if k != "fileioDirectory"},
    "backstore": "block",
    "volumeGroup": "vg_iscsi",
}


def secrets(chap: bool = True, **extra: str) -> Secrets:
    values = {"ssh-privatekey": KEY, "ssh-knownhosts": KNOWN}
    if chap:
        values["node.session.auth.username"] = "chap-user"
        values["node.session.auth.password"] = PASSWORD
    values.update(extra)
    return Secrets({k: Secret(v) for k, v in values.items() if v})


class Ssh(RecordingRunner):
    """Records each ssh call, its stdin and the key files it was given (read while the call
    runs, as ssh would); answers like the remote program."""

    def __init__(self, answer: dict[str, Any] | None = None, rc: int = 0, stderr: str = ""):
        super().__init__()
        self.answer = answer if answer is not None else {"ok": {"size": 64 << 20}}
        self.rc = rc
        self.stderr = stderr
        self.raw: list[tuple[str, ...]] = []
        self.files: dict[str, tuple[int, str]] = {}
        self.timeouts: list[float | None] = []

    def __call__(self, argv: Sequence[str], **kwargs: Any) -> Result:
        self.raw.append(tuple(argv))
        self.timeouts.append(kwargs.get("timeout"))
        self.stdin = kwargs.get("input")
        for option in argv:
            if option.startswith(("IdentityFile=", "UserKnownHostsFile=")):
                path = option.split("=", 1)[1]
                self.files[option.split("=")[0]] = (
                    stat.S_IMODE(os.stat(path).st_mode),
                    Path(path).read_text(),
                )
        result = super().__call__(argv, **{k: v for k, v in kwargs.items() if k != "check"})
        # the program echoes the request's id first in its answer
        answer = {"id": last_request(str(kwargs.get("input") or "")).get("id", ""), **self.answer}
        out = f"{_lio_remote.MARK}{json.dumps(answer)}\n" if self.answer else ""
        return Result(result.argv, self.rc, out, self.stderr)


def backend(runner: RecordingRunner, tmp_path: Path) -> IscsiBackend:
    return IscsiBackend(Node(NodeConfig(state_dir=tmp_path / "state"), "iscsi", runner))


def claim(size: int = (64 << 20) - 1) -> Claim:
    return Claim(uid=UID, namespace="default", name="data", size=size)


def last_request(sent: str) -> dict[str, Any]:
    """The request whose line ends what was sent on stdin ({} if none)."""
    line = sent.rstrip("\n").rsplit("\n", 1)[-1]
    loaded: dict[str, Any] = json.loads(line) if line.startswith("{") else {}
    return loaded


def request_of(runner: Ssh) -> dict[str, Any]:
    """The request after the program sent on stdin (its length first, then it: the opening
    of a connection; each call of a recording runner is one)."""
    sent = runner.inputs[-1]
    assert sent is not None
    length, rest = sent.split("\n", 1)
    assert rest[: int(length)] == _lio_ssh.remote_program()
    line = rest[int(length) :]
    assert line.endswith("\n") and line.count("\n") == 1  # one request, one line
    loaded: dict[str, Any] = json.loads(line)
    assert len(loaded.pop("id")) == 16  # each request's own, echoed in its answer
    return loaded


def test_provision_sends_one_fixed_ssh_command_and_the_request_on_stdin(tmp_path: Path) -> None:
    runner = Ssh()
    made = backend(runner, tmp_path).provision(claim(), PARAMS, secrets())
    name = f"pvc-{UID}"
    assert made.options == {
        "targetPortal": "10.0.1.5:3260",
        "portals": "10.0.2.5:3260",
        "iqn": f"iqn.2003-01.com.example:k8s:{name}",
        "lun": "0",
        "chapAuthSession": "true",
    }
    validate_options(IscsiBackend, {"backend": "iscsi", **made.options})  # the node accepts it
    assert made.size == 64 << 20 and made.fs_type == "ext4"
    assert made.secret == ("flexhub", "iscsi-chap")
    assert made.reclaim == {
        "targetHost": "10.0.0.5",
        "sshUser": "root",
        "sshPort": "2222",
        "backstore": "fileio",
        "fileioDirectory": "/srv/iscsi",
        "sparse": "true",
        "overcommit": "1",
        "claimUid": UID,
    }
    (argv,) = runner.raw
    assert argv[:4] == ("ssh", "-F", "/dev/null", "-T")
    assert argv[-7:-1] == ("root", "--", "10.0.0.5", "/usr/bin/python3", "-I", "-c")
    # the loader, quoted for the target host's shell: the program's length, then the program
    assert argv[-1] == "'import sys;b=sys.stdin.buffer;exec(b.read(int(b.readline())))'"
    opts = dict(a.split("=", 1) for a in argv if "=" in a)
    assert opts["BatchMode"] == "yes" and opts["StrictHostKeyChecking"] == "yes"
    assert opts["GlobalKnownHostsFile"] == "/dev/null" and opts["IdentitiesOnly"] == "yes"
    assert opts["IdentityAgent"] == "none" and opts["ConnectTimeout"] == "10"
    assert argv[argv.index("-p") + 1] == "2222"
    # the key and known host files existed only during the call, 0600, in a private dir
    assert runner.files["IdentityFile"] == (0o600, KEY)
    assert runner.files["UserKnownHostsFile"] == (0o600, KNOWN)
    assert not Path(opts["IdentityFile"]).parent.exists()
    # nothing secret on the command line; the CHAP values only on stdin
    text = " ".join(argv)
    for secret in (PASSWORD, "chap-user", "fakekeybody", "fakehostkey"):
        assert secret not in text
    assert runner.stdin is not None and PASSWORD in runner.stdin  # the real stdin has it
    request = request_of(runner)
    assert request["action"] == "provision"
    assert request["spec"] == {
        "name": name,
        "iqn": f"iqn.2003-01.com.example:k8s:{name}",
        "directory": "/srv/iscsi",
        "file": f"{name}.img",
        "size": 64 << 20,
        "sparse": True,
        "overcommit": 1.0,
        "portals": [["10.0.1.5", 3260], ["10.0.2.5", 3260]],
        "initiators": ["iqn.1993-08.org.debian:01:node-a"],
        "chap": {"userid": "***", "password": "***"},  # masked in the record
    }


def test_provision_without_chap_names_no_secret(tmp_path: Path) -> None:
    runner = Ssh()
    params = {k: v for k, v in PARAMS.items() if not k.startswith("nodeSecret")}
    made = backend(runner, tmp_path).provision(claim(), params, secrets(chap=False))
    assert "chapAuthSession" not in made.options and made.secret is None
    assert request_of(runner)["spec"]["chap"] is None


BAD = [
    ({"targetHost": "-oProxyCommand=x"}, "targetHost"),
    ({"targetHost": "a b"}, "targetHost"),
    ({"sshUser": "root;id"}, "sshUser"),
    ({"sshPort": "0"}, "sshPort"),
    ({"sshPort": "70000"}, "sshPort"),
    ({"portals": ""}, "portals"),
    ({"portals": "storage.example.com:3260"}, "portals"),
    ({"portals": "10.0.0.1:99999"}, "portals"),
    ({"iqnPrefix": "iqn.2003-01.com.Example"}, "iqnPrefix"),
    ({"iqnPrefix": "eui.0123456789abcdef"}, "iqnPrefix"),
    ({"iqnPrefix": "iqn.2003-01.com.example:" + "a" * 170}, "iqnPrefix"),
    ({"backstore": "lvm"}, "backstore"),
    ({"backstore": "block"}, "fileioDirectory"),  # a fileio parameter in a block class
    ({"volumeGroup": "vg0"}, "volumeGroup"),  # and a block one in a fileio class
    ({"fileioDirectory": "srv/iscsi"}, "fileioDirectory"),
    ({"fileioDirectory": "/srv/../etc"}, "fileioDirectory"),
    ({"fileioDirectory": "/srv/i scsi"}, "fileioDirectory"),
    ({"fileioDirectory": "/srv/$(id)"}, "fileioDirectory"),
    ({"sparse": "yes"}, "sparse"),
    ({"initiators": "node-a"}, "initiators"),
    ({"nodeSecretNamespace": ""}, "nodeSecretNamespace"),
    ({"nodeSecretName": "Bad_Name"}, "nodeSecretName"),
    ({"fsType": "btrfs"}, "fsType"),
    ({"overcommit": "0.5"}, "overcommit"),
    ({"overcommit": "2x"}, "overcommit"),
    ({"overcommit": "1e3"}, "overcommit"),
    ({"overcommit": "1234567"}, "overcommit"),
]


@pytest.mark.parametrize(("change", "named"), BAD)
def test_a_bad_parameter_is_one_line_naming_it_and_nothing_runs(
    tmp_path: Path, change: dict[str, str], named: str
) -> None:
    runner = Ssh()
    with pytest.raises(InvalidOptions) as caught:
        backend(runner, tmp_path).provision(claim(), {**PARAMS, **change}, secrets())
    assert named in caught.value.message and "\n" not in caught.value.message
    assert runner.calls == []
    with pytest.raises(InvalidOptions):
        IscsiBackend.check_parameters({**PARAMS, **change})


@pytest.mark.parametrize(
    ("params", "values", "named"),
    [
        ({}, {"node.session.auth.password": ""}, "node.session.auth.password"),
        ({"nodeSecretName": "", "nodeSecretNamespace": ""}, {}, "nodeSecretName"),
        (
            {"initiators": "", "nodeSecretName": "", "nodeSecretNamespace": ""},
            {"chap": False},
            "initiators",
        ),
        ({}, {"chap": False}, "nodeSecretName"),
        ({}, {"ssh-privatekey": ""}, "ssh-privatekey"),
        ({}, {"ssh-knownhosts": ""}, "ssh-knownhosts"),
        ({}, {"node.session.auth.password": "pw\nnode.startup = automatic"}, "password"),
    ],
)
def test_secret_rules(
    tmp_path: Path, params: dict[str, str], values: dict[str, Any], named: str
) -> None:
    """CHAP needs the node Secret (the class's holds the SSH key); no CHAP needs initiators;
    the SSH key and host key are required; CHAP values are checked, never shown."""
    chap = values.pop("chap", True)
    runner = Ssh()
    parameters = {k: v for k, v in {**PARAMS, **params}.items() if v}
    with pytest.raises(InvalidOptions) as caught:
        backend(runner, tmp_path).provision(claim(), parameters, secrets(chap=chap, **values))
    assert named in caught.value.message, caught.value.message
    assert "node.startup" not in caught.value.message
    assert runner.calls == []


def test_remote_refusal_and_ssh_failure_are_one_line_without_secrets(tmp_path: Path) -> None:
    runner = Ssh({"error": f"fileioDirectory /srv/iscsi is not a directory {PASSWORD}"}, rc=3)
    with pytest.raises(FlexhubError) as caught:
        backend(runner, tmp_path).provision(claim(), PARAMS, secrets())
    assert "is not a directory" in caught.value.message and PASSWORD not in caught.value.message
    runner = Ssh({}, rc=255, stderr="Host key verification failed.\r\n")
    with pytest.raises(FlexhubError) as caught:
        backend(runner, tmp_path).provision(claim(), PARAMS, secrets())
    assert caught.value.message == (
        "iscsi: target host 10.0.0.5 (provision): ssh failed: Host key verification failed."
    )


def test_reclaim_delete_retain_and_a_tampered_record(tmp_path: Path) -> None:
    made = backend(Ssh(), tmp_path).provision(claim(), PARAMS, secrets())
    runner = Ssh({"ok": {"deleted": []}})
    iscsi = backend(runner, tmp_path)
    iscsi.reclaim(made.options, {**made.reclaim, "onDelete": "retain"}, secrets())
    assert runner.calls == []  # retain: nothing runs
    iscsi.reclaim(made.options, {**made.reclaim, "onDelete": "delete"}, secrets())
    assert request_of(runner) == {
        "action": "delete",
        "spec": {
            "name": f"pvc-{UID}",
            "iqn": made.options["iqn"],
            "directory": "/srv/iscsi",
            "file": f"pvc-{UID}.img",
        },
        "wait": pytest.approx(
            _lio.CALL_TIMEOUT - _lio.LOCK_MARGIN, abs=1
        ),  # for the lock: then refused unrun
    }
    for options, record in [
        ({**made.options, "iqn": "iqn.2003-01.com.example:k8s:other"}, made.reclaim),
        (made.options, {**made.reclaim, "fileioDirectory": "/srv/../etc"}),
        (made.options, {**made.reclaim, "targetHost": "-oProxyCommand=sh"}),
        (made.options, {**made.reclaim, "onDelete": "archive"}),
        ({**made.options, "lun": "3"}, made.reclaim),
    ]:
        with pytest.raises(InvalidOptions):
            iscsi.reclaim(options, {"onDelete": "delete", **record}, secrets())
    assert len(runner.calls) == 1


def test_expand_of_storage_and_of_the_device_share_one_name(tmp_path: Path) -> None:
    made = backend(Ssh(), tmp_path).provision(claim(), PARAMS, secrets())
    runner = Ssh({"ok": {"size": 160 << 20}})
    iscsi = backend(runner, tmp_path)
    assert IscsiBackend.expands_storage and isinstance(iscsi, Provisioning)
    assert iscsi.expand_storage(made.options, made.reclaim, (160 << 20) - 7, secrets()) == 160 << 20
    assert request_of(runner)["spec"]["size"] == 160 << 20  # rounded up to MiB
    assert request_of(runner)["action"] == "expand"


def test_overcommit_reaches_provision_and_expansion_and_a_room_refusal_is_no_room(
    tmp_path: Path,
) -> None:
    """The class's overcommit is sent with the fileio provision, kept in the reclaim record
    (only when not 1) and sent with the expansion; the target host's room refusal is NoRoom,
    one line."""
    runner = Ssh()
    made = backend(runner, tmp_path).provision(claim(), {**PARAMS, "overcommit": "2.5"}, secrets())
    assert request_of(runner)["spec"]["overcommit"] == 2.5
    assert made.reclaim["overcommit"] == "2.5"
    runner = Ssh({"ok": {"size": 160 << 20}})
    backend(runner, tmp_path).expand_storage(made.options, made.reclaim, 160 << 20, secrets())
    spec = request_of(runner)["spec"]
    assert spec["overcommit"] == 2.5 and spec["iqn"] == made.options["iqn"]
    with pytest.raises(InvalidOptions, match="reclaim record 'overcommit'"):
        backend(runner, tmp_path).expand_storage(
            made.options, {**made.reclaim, "overcommit": "0"}, 160 << 20, secrets()
        )
    why = "not enough room for /srv/iscsi/x.img (1.0 GiB): the LUN files would promise ..."
    runner = Ssh({"error": why, "room": True}, rc=3)
    with pytest.raises(NoRoom) as caught:
        backend(runner, tmp_path).provision(claim(), PARAMS, secrets())
    assert caught.value.message == f"iscsi: target host 10.0.0.5 (provision): {why}"
    runner = Ssh({"error": why}, rc=3)  # any other refusal is not NoRoom
    with pytest.raises(FlexhubError) as other:
        backend(runner, tmp_path).provision(claim(), PARAMS, secrets())
    assert not isinstance(other.value, NoRoom)


BAD_BLOCK = [
    ({"volumeGroup": ""}, "volumeGroup"),
    ({"volumeGroup": "-vg"}, "volumeGroup"),
    ({"volumeGroup": ".."}, "volumeGroup"),
    ({"volumeGroup": "vg/../x"}, "volumeGroup"),
    ({"volumeGroup": "vg 0"}, "volumeGroup"),
    ({"volumeGroup": "vg0\n"}, "volumeGroup"),
    ({"volumeGroup": "v" * 41}, "volumeGroup"),
    ({"volumeGroup": "vg$(id)"}, "volumeGroup"),
    ({"sparse": "false"}, "sparse"),
    ({"fileioDirectory": "/srv/iscsi"}, "fileioDirectory"),
    ({"overcommit": "2"}, "overcommit"),  # thick LVs: the volume group bounds them
]


@pytest.mark.parametrize(("change", "named"), BAD_BLOCK)
def test_a_bad_block_parameter_is_one_line_naming_it_and_nothing_runs(
    tmp_path: Path, change: dict[str, str], named: str
) -> None:
    runner = Ssh()
    with pytest.raises(InvalidOptions) as caught:
        backend(runner, tmp_path).provision(claim(), {**BLOCK, **change}, secrets())
    assert named in caught.value.message and "\n" not in caught.value.message
    assert runner.calls == []


def test_block_provision_reclaim_and_expand_name_the_lv_and_its_group(tmp_path: Path) -> None:
    """backstore block: the request names the volume group and the LV (the remote program
    makes ``pvc-<uid>`` there); the reclaim record keeps the kind and the group, nothing of
    fileio; reclaim and expansion take them from the record only."""
    runner = Ssh({"ok": {"size": 68 << 20, "created": True}})
    made = backend(runner, tmp_path).provision(claim(), BLOCK, secrets())
    name = f"pvc-{UID}"
    spec = request_of(runner)["spec"]
    assert {k: spec[k] for k in ("name", "backstore", "vg", "size")} == {
        "name": name,
        "backstore": "block",
        "vg": "vg_iscsi",
        "size": 64 << 20,
    }
    assert "directory" not in spec and "file" not in spec and "sparse" not in spec
    assert made.size == 68 << 20  # the LV's size: rounded up to the extents
    assert made.reclaim == {
        "targetHost": "10.0.0.5",
        "sshUser": "root",
        "sshPort": "2222",
        "backstore": "block",
        "volumeGroup": "vg_iscsi",
        "claimUid": UID,
    }
    validate_options(IscsiBackend, {"backend": "iscsi", **made.options})
    runner = Ssh({"ok": {"deleted": ["target", "backstore", "logical volume"]}})
    iscsi = backend(runner, tmp_path)
    iscsi.reclaim(made.options, {**made.reclaim, "onDelete": "delete"}, secrets())
    assert request_of(runner) == {
        "action": "delete",
        "spec": {"name": name, "iqn": made.options["iqn"], "backstore": "block", "vg": "vg_iscsi"},
        "wait": pytest.approx(runner.timeouts[-1] - _lio.LOCK_MARGIN, abs=1),
    }
    runner = Ssh({"ok": {"size": 160 << 20}})
    iscsi = backend(runner, tmp_path)
    assert iscsi.expand_storage(made.options, made.reclaim, 150 << 20, secrets()) == 160 << 20
    assert request_of(runner) == {
        "action": "expand",
        "spec": {
            "name": name,
            "backstore": "block",
            "vg": "vg_iscsi",
            "iqn": made.options["iqn"],
            "size": 150 << 20,
        },
        "wait": pytest.approx(
            _lio.CALL_TIMEOUT + _lio.zero_seconds(150 << 20) - _lio.LOCK_MARGIN, abs=1
        ),
    }
    runner = Ssh()
    iscsi = backend(runner, tmp_path)
    for record in [
        {**made.reclaim, "volumeGroup": "-ffoo"},
        {**made.reclaim, "volumeGroup": ""},
        {**made.reclaim, "backstore": "lvm"},
        {k: v for k, v in made.reclaim.items() if k != "backstore"},
        {**made.reclaim, "claimUid": "1b7f3c1e-5d2a-4e8f-9a61-2c4d8e0f1a3b"},  # another PV's
        {k: v for k, v in made.reclaim.items() if k != "claimUid"},  # a block record has one
    ]:
        with pytest.raises(InvalidOptions) as caught:
            iscsi.reclaim(made.options, {"onDelete": "delete", **record}, secrets())
        assert "reclaim record" in caught.value.message or "claimUid" in caught.value.message
        with pytest.raises(InvalidOptions):
            iscsi.expand_storage(made.options, record, 1 << 30, secrets())
    iscsi.reclaim(made.options, {**made.reclaim, "onDelete": "retain"}, secrets())
    assert runner.calls == []  # refused or retained: nothing ran
    iscsi.reclaim(made.options, {**made.reclaim, "claimUid": UID}, secrets())  # its own
    assert len(runner.calls) == 1


def test_the_parameters_schema_is_valid_and_agrees(tmp_path: Path) -> None:
    schema = IscsiBackend.parameters_schema()
    validator = validator_for(schema)
    validator.check_schema(schema)
    assert schema["additionalProperties"] is False
    assert validator.is_valid(PARAMS) and validator.is_valid(BLOCK)
    assert not validator.is_valid({**PARAMS, "targetPortal": "10.0.0.5"})
    fileio = {k: v for k, v in PARAMS.items() if k != "fileioDirectory"}
    assert not validator.is_valid(fileio)  # fileio needs its directory, block its group
    assert not validator.is_valid({k: v for k, v in BLOCK.items() if k != "volumeGroup"})
    for key, prop in schema["properties"].items():
        assert prop.get("description"), key
        for example in prop.get("examples", []):
            base = BLOCK if key == "volumeGroup" or example == "block" else PARAMS
            assert validator.is_valid({**base, key: example}), (key, example)
            IscsiBackend.check_parameters({**base, key: example})


def test_remote_program_is_what_is_sent(tmp_path: Path) -> None:
    """The program is its parts' texts (one __future__ import first), then ``serve()``; ASCII
    (the loader reads its length in bytes); run as the target host runs it (``__main__``, no
    flexhub), it defines every name the last part imports on the host, and the parts define no
    top-level name twice. A request is one ASCII JSON line, whatever its values hold."""
    program = _lio_ssh.remote_program()
    compile(program, "<remote>", "exec")
    assert program.isascii()
    assert program.startswith("from __future__ import annotations\n")
    assert program.count("from __future__ import") == 1
    assert program.endswith("\n\nserve()\n")
    body = program.removesuffix("serve()\n")
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(body, "<remote>", "exec"), namespace)  # defines; runs no action
    for name in ("check_room", "NoRoomLeft", "SAVE_FILE", "merged", "read_saved", "write_saved",
                 "main", "save", "provision", "serve"):  # fmt: skip
        assert callable(namespace[name]) or name == "SAVE_FILE", name
    assert namespace["MARK"] == _lio_ssh.MARK
    defined: dict[str, str] = {}
    for part in _lio.REMOTE_PARTS:
        tree = ast.parse((Path(_lio.__file__).parent / part).read_text())
        for node in tree.body:
            names = []
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            for name in names:
                assert name not in defined, f"{name} in {part} and {defined[name]}"
                defined[name] = part
            if isinstance(node, ast.If):  # the host's imports: what earlier parts define
                for imported in ast.walk(node):
                    if isinstance(imported, ast.ImportFrom):
                        for alias in imported.names:
                            assert alias.name in defined, f"{part} needs {alias.name} first"
    request = {"action": "delete", "spec": {"x": 'it\'s "quoted"\n\u00e9\u2028'}}
    line = _lio_ssh.request_line(request)
    assert line.isascii() and line.endswith("\n") and line.count("\n") == 1
    assert json.loads(line) == request


def test_remote_file_checks_on_a_real_filesystem(tmp_path: Path) -> None:
    """The backing file is made 0600 in a root-only directory, never through a symlink."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the directory must be root's")
    good = tmp_path / "luns"
    good.mkdir(mode=0o755)
    spec = {"directory": str(good), "file": "pvc-x.img"}
    fd, made = _lio_remote.open_file(spec, create=True)
    _lio_remote.grow(fd, 4 << 20, sparse=True)
    os.close(fd)
    assert made and stat.S_IMODE((good / "pvc-x.img").stat().st_mode) == 0o600
    assert (good / "pvc-x.img").stat().st_size == 4 << 20
    fd, made = _lio_remote.open_file(spec, create=True)  # found, not made
    os.close(fd)
    assert not made
    (good / "pvc-y.img").symlink_to("/etc/passwd")
    with pytest.raises(OSError):
        _lio_remote.open_file({**spec, "file": "pvc-y.img"}, create=True)
    os.link(good / "pvc-x.img", good / "pvc-z.img")
    with pytest.raises(_lio_remote.Refused, match="plain file"):
        _lio_remote.open_file({**spec, "file": "pvc-z.img"}, create=False)
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(_lio_remote.Refused, match="symlink"):
        _lio_remote.check_directory(str(link))
    good.chmod(0o775)
    with pytest.raises(_lio_remote.Refused, match="writable by no one else"):
        _lio_remote.check_directory(str(good))


@pytest.mark.skipif(
    not any(os.path.isfile(b) for b in _lio_lvm.LVM), reason="lvm2 is not installed"
)
def test_remote_lvm_failure_is_one_line_naming_the_group() -> None:
    """The real ``lvm`` (no device-mapper needed to look a group up): a group that is not
    there is one line naming volumeGroup, never "gone"."""
    spec = {"vg": "flexhub-no-such-vg", "name": f"pvc-{UID}"}
    with pytest.raises(_lio_remote.Refused) as caught:
        _lio_lvm.volume_group(spec)
    text = str(caught.value)
    assert text.startswith("volumeGroup flexhub-no-such-vg: lvm vgs failed: ")
    assert "not found" in text and "\n" not in text
    with pytest.raises(_lio_remote.Refused):
        _lio_lvm.delete_lv(spec)


MiB = 1 << 20
OTHER = "1b7f3c1e-5d2a-4e8f-9a61-2c4d8e0f1a3b"


@pytest.mark.parametrize("params", [PARAMS, BLOCK], ids=["fileio", "block"])
def test_a_pv_naming_another_claims_iqn_is_refused_with_the_record_provision_wrote(
    tmp_path: Path, params: dict[str, str]
) -> None:
    """The record provision writes holds the claim's uid, so parse_volume's check runs: a PV
    whose iqn was edited to name another claim (its target, backstore, file or tagged LV)
    reaches no target host, by reclaim or by expansion."""
    made = backend(Ssh({"ok": {"size": 68 << 20, "created": True}}), tmp_path).provision(
        claim(), params, secrets()
    )
    assert made.reclaim["claimUid"] == UID
    options = {**made.options, "iqn": made.options["iqn"].replace(UID, OTHER)}
    runner = Ssh({"ok": {"deleted": ["target", "backstore", "logical volume"]}})
    with pytest.raises(InvalidOptions, match="claimUid"):
        backend(runner, tmp_path).reclaim(
            options, {**made.reclaim, "onDelete": "delete"}, secrets()
        )
    with pytest.raises(InvalidOptions, match="claimUid"):
        backend(runner, tmp_path).expand_storage(options, made.reclaim, 1 << 30, secrets())
    assert runner.calls == []


def _pv(made: Provisioned, params: dict[str, str]) -> dict[str, Any]:
    """The PV the provisioner saves for ``made`` (what the controller later reads back)."""
    return pvs.build_pv(
        claim(), "iscsi", "Delete", "iscsi", "delete", "provisioner", made, "k8s/flexhub",
        "flexhub", class_secret=("flexhub", "iscsi-ssh"),
    )  # fmt: skip


def test_an_older_fileio_pv_without_claim_uid_reclaims_and_its_name_is_checked(
    tmp_path: Path,
) -> None:
    """A fileio PV saved before provision wrote claimUid: the controller hands the backend
    the uid the PV's (uneditable) name holds, so its reclaim still works and an iqn edited to
    name another claim is refused; a block record without claimUid is refused outright (every
    block record has one)."""
    made = backend(Ssh(), tmp_path).provision(claim(), PARAMS, secrets())
    old = Provisioned(
        options=made.options,
        size=made.size,
        reclaim={k: v for k, v in made.reclaim.items() if k != "claimUid"},
        fs_type=made.fs_type,
        secret=made.secret,
    )
    pv = _pv(old, PARAMS)
    options = {k: v for k, v in pv["spec"]["flexVolume"]["options"].items() if k != "backend"}
    record = pvapi.backend_record(pv)
    assert record["claimUid"] == UID
    runner = Ssh({"ok": {"deleted": ["target", "backstore", "file"]}})
    backend(runner, tmp_path).reclaim(options, record, secrets())
    assert request_of(runner)["spec"]["file"] == f"pvc-{UID}.img"
    edited = {**options, "iqn": options["iqn"].replace(UID, OTHER)}
    with pytest.raises(InvalidOptions, match="claimUid"):
        backend(runner, tmp_path).reclaim(edited, record, secrets())
    with pytest.raises(InvalidOptions, match="claimUid"):
        backend(runner, tmp_path).expand_storage(edited, record, 1 << 30, secrets())
    assert len(runner.calls) == 1
    # a record naming another claim than the PV's name is refused before any backend
    forged = {**pv, "metadata": {**pv["metadata"], "annotations": {
        **pv["metadata"]["annotations"],
        pvs.ANN_RECLAIM: json.dumps({**record, "claimUid": OTHER}),
    }}}  # fmt: skip
    with pytest.raises(FlexhubError, match="refusing to reclaim"):
        pvapi.backend_record(forged)
    blocked = backend(Ssh(), tmp_path).provision(claim(), BLOCK, secrets())
    without = {k: v for k, v in blocked.reclaim.items() if k != "claimUid"}
    with pytest.raises(InvalidOptions, match="claimUid"):
        backend(runner, tmp_path).reclaim(blocked.options, without, secrets())
    assert len(runner.calls) == 1


def test_reclaim_and_expansion_wait_long_enough_for_the_zeroing(tmp_path: Path) -> None:
    """The remote program zeroes a reclaimed LV and an expansion's new range within
    60 s + bytes / (20 MiB/s); the ssh call's bound leaves room for that on top of its own."""
    assert _lio.zero_seconds(0) == _lio_lvm.zero_seconds(0) == 60
    assert _lio.zero_seconds(100 * 20 * MiB) == _lio_lvm.zero_seconds(100 * 20 * MiB) == 160
    made = backend(Ssh(), tmp_path).provision(claim(), BLOCK, secrets())
    runner = Ssh({"ok": {"size": 40 << 30}})
    iscsi = backend(runner, tmp_path)
    iscsi.expand_storage(made.options, made.reclaim, 40 << 30, secrets())
    record = {**made.reclaim, "onDelete": "delete", "size": str(40 << 30)}
    runner.answer = {"ok": {"deleted": []}}
    iscsi.reclaim(made.options, record, secrets())
    assert runner.timeouts == [
        _lio.CALL_TIMEOUT + _lio.zero_seconds(40 << 30),
        _lio.CALL_TIMEOUT + _lio.zero_seconds(40 << 30),
    ]


@pytest.fixture
def loop(tmp_path: Path) -> Any:
    """A real 8 MiB loop device over a file full of 0xAB bytes."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a loop device")
    image = tmp_path / "disk.img"
    image.write_bytes(b"\xab" * (8 * MiB))
    device = subprocess.run(
        ["losetup", "--find", "--show", str(image)], check=True, capture_output=True, text=True
    ).stdout.strip()
    try:
        yield device
    finally:
        subprocess.run(["losetup", "-d", device], check=False)


def _bytes(device: str, offset: int, length: int) -> bytes:
    with open(device, "rb") as fh:
        fh.seek(offset)
        return fh.read(length)


def test_remote_zero_clears_exactly_its_range_of_a_real_device(loop: str) -> None:
    """blkdiscard --zeroout on a real (loop) device: the range reads zeros, the rest keeps its
    bytes; a range not on sector boundaries, and a device someone holds (exclusive open), are
    one-line refusals."""
    _lio_lvm.zero(loop, 2 * MiB, 3 * MiB, shared=False)
    assert _bytes(loop, 2 * MiB, 3 * MiB) == bytes(3 * MiB)
    assert _bytes(loop, 0, 2 * MiB) == b"\xab" * (2 * MiB)
    assert _bytes(loop, 5 * MiB, 3 * MiB) == b"\xab" * (3 * MiB)
    with pytest.raises(_lio_remote.Refused) as caught:
        _lio_lvm.zero(loop, 6 * MiB + 1, MiB, shared=False)
    assert str(caught.value).startswith(f"zero {loop}: blkdiscard failed") and "\n" not in str(
        caught.value
    )
    held = os.open(loop, os.O_RDONLY | os.O_EXCL)  # as a mount or LIO's iblock holds it
    try:
        with pytest.raises(_lio_remote.Refused, match="busy"):
            _lio_lvm.zero(loop, 0, MiB, shared=False)
        _lio_lvm.zero(loop, 0, MiB, shared=True)  # an expansion's range: LIO holds it
    finally:
        os.close(held)
    assert _bytes(loop, 0, MiB) == bytes(MiB)


class _Lvm:
    """A recording stand-in for the remote program's ``lvm`` and ``blkdiscard`` (no LVM on
    the host): answers vgs/lvs like lvm for one LV whose device is ``device`` (a real loop
    device stands for it), records every step."""

    def __init__(
        self, spec: dict[str, Any], device: str, tags: str = "", size: int = 8 * MiB
    ) -> None:
        self.spec, self.device = spec, device
        self.events: list[str] = []
        self.size, self.tags = size, tags or _lio_lvm.tag_of(spec)
        self.gone = False
        self.zero_fails: Exception | None = None

    def lvm(self, step: str, *args: str) -> str:
        self.events.append(" ".join(args[:1] + tuple(a for a in args[1:] if a.startswith("--"))))
        if args[0] == "vgs":
            vg = {"vg_name": self.spec["vg"], "vg_extent_size": str(4 * MiB)}
            return json.dumps({"report": [{"vg": [vg]}]})
        if args[0] == "lvs":
            null = os.stat(self.device).st_rdev
            lv = {"lv_name": self.spec["name"], "lv_size": str(self.size), "lv_tags": self.tags,
                  "lv_attr": "-wi-a-----", "lv_kernel_major": str(os.major(null)),
                  "lv_kernel_minor": str(os.minor(null))}  # fmt: skip
            return json.dumps({"report": [{"lv": [] if self.gone else [lv]}]})
        if args[0] == "lvremove":
            self.gone = True
        if args[0] == "lvextend":
            self.size = int(args[args.index("--extents") + 1]) * 4 * MiB
        if args[0] == "lvchange" and "--addtag" in args:
            self.tags += "," + args[args.index("--addtag") + 1]
        if args[0] == "lvchange" and "--deltag" in args:
            drop = args[args.index("--deltag") + 1]
            self.tags = ",".join(t for t in self.tags.split(",") if t != drop)
        return ""

    def zero(self, path: str, offset: int, length: int, shared: bool) -> None:
        self.events.append(f"zero {path} {offset} {length}{' shared' if shared else ''}")
        if self.zero_fails is not None:
            raise self.zero_fails


def _remote_with(
    monkeypatch: pytest.MonkeyPatch, fake: _Lvm, events: list[str], tmp: Path, so_vg: str = ""
) -> Any:
    """The remote program with a recording rtslib (a block storage object of the claim's name
    on ``/dev/<so_vg>/<name>``, a target), ``fake`` for lvm and blkdiscard; the LV's device
    node is the fake's device."""
    r = _lio_remote
    name, vg = fake.spec["name"], so_vg or fake.spec["vg"]

    class SO:
        plugin = "block"

        def __init__(self) -> None:
            self.name, self.udev_path = name, f"/dev/{vg}/{name}"

        def delete(self) -> None:
            events.append("backstore deleted")

    class Target:
        def delete(self) -> None:
            events.append("target deleted")

    class Lib:
        class RTSLibNotInCFS(Exception):
            pass

        class tcm:  # rtslib's module
            class StorageObject:
                @staticmethod
                def so_from_path(path: str) -> SO:
                    return SO()

        def RTSRoot(self) -> Any:
            return type("R", (), {"storage_objects": [SO()]})()

        def FabricModule(self, n: str) -> None:
            return None

        def Target(self, f: Any, iqn: str, mode: str) -> Target:
            return Target()

    monkeypatch.setattr(r, "rts", Lib)
    core = tmp / "core"  # configfs's core/: the claim's storage object's directory
    (core / "iblock_0" / name).mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(r, "CORE", str(core))
    monkeypatch.setattr(r, "save", lambda lib, spec: events.append("saved"))
    for module in (r, _lio_lvm):  # the names each module calls (one namespace when sent)
        monkeypatch.setattr(module, "lvm", fake.lvm)
        monkeypatch.setattr(module, "zero", fake.zero)
        # the storage object names /dev/<vg>/<name>; the device node checked is the loop's
        monkeypatch.setattr(module, "device_of", lambda spec: fake.device)
    return r


def _spec(vg: str = "vg_iscsi") -> dict[str, Any]:
    name = f"pvc-{UID}"
    return {"iqn": f"iqn.2003-01.com.example:k8s:{name}", "name": name, "backstore": "block",
            "vg": vg}  # fmt: skip


def test_remote_refused_block_delete_has_changed_nothing(
    monkeypatch: pytest.MonkeyPatch, loop: str, tmp_path: Path
) -> None:
    """Recording rtslib and lvm (no LIO or LVM on the host): a delete whose checks fail (the
    backstore's device is not in the record's group; the LV lacks the claim's tag) refuses
    before the target, the backstore or the LV is touched."""
    events: list[str] = []
    fake = _Lvm(_spec("vg_other"), loop)
    r = _remote_with(monkeypatch, fake, events, tmp_path, so_vg="vg_real")
    with pytest.raises(r.Refused, match="another backing store"):
        r.delete(_spec("vg_other"))
    assert events == []
    fake = _Lvm(_spec(), loop, tags="flexhub:" + OTHER)
    r = _remote_with(monkeypatch, fake, events, tmp_path)
    with pytest.raises(r.Refused, match="without the tag"):
        r.delete(_spec())
    assert events == [] and "lvremove" not in fake.events


def test_remote_block_delete_zeroes_the_lv_before_removing_it_and_retries_the_zeroing(
    monkeypatch: pytest.MonkeyPatch, loop: str, tmp_path: Path
) -> None:
    """Recording rtslib, lvm and blkdiscard (the real ones are the VM test's): the LV is zeroed
    whole before lvremove; a zeroing that times out (or a program killed in it) leaves the
    LV, never removes it, and the retry zeroes it again, then removes it."""
    events: list[str] = []
    fake = _Lvm(_spec(), loop)
    r = _remote_with(monkeypatch, fake, events, tmp_path)
    fake.zero_fails = r.Refused("zero: blkdiscard timed out after 60 s")
    with pytest.raises(r.Refused, match="timed out"):
        r.delete(_spec())
    assert events == ["target deleted", "backstore deleted", "saved"]
    assert "lvremove" not in " ".join(fake.events) and not fake.gone
    assert f"zero {loop} 0 {8 * MiB}" in fake.events
    fake.zero_fails = None
    fake.events.clear()
    assert r.delete(_spec()) == {"deleted": ["target", "backstore", "logical volume"]}
    zeroed = fake.events.index(f"zero {loop} 0 {8 * MiB}")
    assert zeroed < fake.events.index("lvremove --yes --") and fake.gone


def test_remote_block_expand_zeroes_the_new_range_and_a_retry_finishes_it(
    monkeypatch: pytest.MonkeyPatch, loop: str, tmp_path: Path
) -> None:
    """Recording lvm and blkdiscard: the range lvextend adds is zeroed (LIO holds the LV, so
    not exclusively) before the new size is answered; a zeroing that fails after lvextend
    leaves a tag naming where it began, so the next expand (the LV already at its size)
    zeroes that range still, then drops the tag."""
    events: list[str] = []
    fake = _Lvm(_spec(), loop)
    r = _remote_with(monkeypatch, fake, events, tmp_path)
    fake.zero_fails = r.Refused("zero: blkdiscard timed out after 60 s")
    with pytest.raises(r.Refused, match="timed out"):
        r.expand({**_spec(), "size": 20 * MiB})
    assert fake.size == 20 * MiB and f"{r.ZERO_TAG}{8 * MiB}" in fake.tags.split(",")
    fake.zero_fails = None
    fake.events.clear()
    assert r.expand({**_spec(), "size": 20 * MiB}) == {"size": 20 * MiB}
    assert f"zero {loop} {8 * MiB} {12 * MiB} shared" in fake.events
    assert "lvextend" not in " ".join(fake.events)
    assert fake.tags == _lio_lvm.tag_of(_spec())
    fake.events.clear()
    assert r.expand({**_spec(), "size": 20 * MiB}) == {"size": 20 * MiB}  # nothing to do
    assert not any(e.startswith("zero") for e in fake.events)
    assert r.expand({**_spec(), "size": 24 * MiB}) == {"size": 24 * MiB}
    assert f"zero {loop} {20 * MiB} {4 * MiB} shared" in fake.events
    assert events == []  # nothing of LIO changes on expansion
