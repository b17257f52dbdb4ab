"""A ``mount`` imports only what it needs (issue 23), and the lean path answers as the full one.

Real loop devices and mounts, through the installed driver. Each call kind is run once more in
an interpreter started as the driver starts it (``-I -c``, the same ``sys.path``, so the node's
memos written by the driver's calls apply) that records the modules the call loaded. Modules
``site`` loads before the call (``re``, ``enum``, ``pathlib`` in a venv) cannot be seen this
way; the rest can.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from flexhub.admin.harness import KUBELET_ENV, DriverReply, Kubelet, go_json, parse_reply
from tests.conftest import PYTHON, needs_root
from tests.loopfile.conftest import mounts_under

pytestmark = [needs_root, pytest.mark.root]

#: Never loaded by a mount whose options were validated before on the node (the memo).
NEVER_ON_A_KNOWN_VOLUME = (
    "jsonschema",
    "referencing",
    "stevedore",
    "importlib.metadata",
    "tomllib",  # the plain config is read without it (flexhub.node.plainconfig)
    "hashlib",  # the built-in _sha256 instead (no OpenSSL)
    "difflib",
    "shutil",
    "decimal",
    "secrets",
    "dataclasses",  # the records are written out (flexhub.node.frozen)
    "inspect",
    "base64",  # only for a call that carries a secret
    "flexhub.node.release",  # only an unmount or a failed mount releases
    "typer",
    "kubernetes",
    "yaml",
    "grpc",  # gRPC and protobuf: the CSI front end's alone (flexhub.csi)
    "google",
    "flexhub.csi",
)
#: ... and not by a mount that finds the directory mounted already (no command runs).
NEVER_WHEN_ALREADY_MOUNTED = (*NEVER_ON_A_KNOWN_VOLUME, "subprocess", "flexhub.node.fs")

VOL = {"backend": "loopfile", "file": "lean/a.img", "size": "16Mi"}


def traced(config: Path, out: Path, *args: str) -> tuple[DriverReply, set[str]]:
    """One call as the driver runs it, and the modules it loaded."""
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "from flexhub.__main__ import main\n"
        "rc = main(sys.argv[1:])\n"
        f"open({str(out)!r}, 'w').write('\\n'.join(sorted(set(sys.modules) - before)))\n"
        "sys.exit(rc)\n"
    )
    argv = [PYTHON, "-I", "-c", code, *args]
    proc = subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env={**KUBELET_ENV, "FLEXHUB_CONFIG": str(config)},
        cwd="/",
        check=False,
        timeout=120,
    )
    reply = DriverReply(argv, proc.returncode, proc.stdout, parse_reply(proc.stdout))
    return reply, set(out.read_text().split())


def loaded(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


def test_each_mount_kind_loads_only_what_it_needs(
    kube: Kubelet, node_tree: dict[str, Path], tmp_path: Path
) -> None:
    config = node_tree["config"]
    first_uid = Kubelet.new_pod_uid()
    first = kube.mount(first_uid, "pv-1", Kubelet.mount_options(VOL, pv="pv-1", pod_uid=first_uid))
    assert first is not None and first.ok, first and first.reply
    target = kube.pod_dir(first_uid, "pv-1")
    raw = go_json(Kubelet.mount_options(VOL, pv="pv-1", pod_uid=first_uid))

    again, modules = traced(config, tmp_path / "again.txt", "mount", str(target), raw)
    assert again.ok, again.reply
    assert "flexhub_loopfile" in modules  # the backend still checks the volume
    assert loaded(modules, NEVER_WHEN_ALREADY_MOUNTED) == []

    second_uid = Kubelet.new_pod_uid()
    second_dir = kube.pod_dir(second_uid, "pv-1")
    second_dir.mkdir(mode=0o750, parents=True)
    second_raw = go_json(Kubelet.mount_options(VOL, pv="pv-1", pod_uid=second_uid))
    second, modules = traced(config, tmp_path / "second.txt", "mount", str(second_dir), second_raw)
    assert second.ok, second.reply
    assert str(second_dir.resolve()) in mounts_under(node_tree["kubelet"].resolve())
    assert "subprocess" in modules  # mount --bind
    assert loaded(modules, NEVER_ON_A_KNOWN_VOLUME) == []

    # a new volume: its options were never validated on this node, so jsonschema checks them
    new = {**VOL, "file": "lean/b.img"}
    new_uid = Kubelet.new_pod_uid()
    new_dir = kube.pod_dir(new_uid, "pv-2")
    new_dir.mkdir(mode=0o750, parents=True)
    new_raw = go_json(Kubelet.mount_options(new, pv="pv-2", pod_uid=new_uid))
    made, modules = traced(config, tmp_path / "new.txt", "mount", str(new_dir), new_raw)
    assert made.ok, made.reply
    assert "jsonschema" in modules
    # (jsonschema itself loads decimal)
    assert loaded(modules, ("stevedore", "tomllib", "hashlib", "secrets")) == []


def _not_plain(config: Path, into: Path) -> Path:
    """The same config written so that the plain reader refuses it: tomllib reads it."""
    text = config.read_text()
    root = text.split('root = "', 1)[1].split('"', 1)[0]
    into.write_text(text.replace(f'root = "{root}"', f'root = """{root}"""'))
    return into


def reply_of(proc_reply: DriverReply, config: Path) -> tuple[str, str]:
    """The reply, the config file's own name aside (a message may name the file)."""
    return proc_reply.status, proc_reply.message.replace(str(config), "CONFIG")


@pytest.mark.parametrize(
    "case",
    [
        "already-mounted",
        "second-pod",
        "bad-size",
        "escaping-file",
        "pod-uid-of-another-pod",
        "unknown-option",
        "unknown-table",
        "bad-table-value",
    ],
)
def test_the_lean_path_answers_as_tomllib_would(
    case: str, kube: Kubelet, node_tree: dict[str, Path], tmp_path: Path
) -> None:
    """The same call under the plain config and under the same config that only tomllib
    reads: the same reply, refusals included, and the same effect."""
    config = node_tree["config"]
    if case == "unknown-table":
        config.write_text(config.read_text() + "[loopfle]\nroot = '/x'\n")
    if case == "bad-table-value":
        config.write_text(config.read_text().replace("[loopfile]\n", "[loopfile]\nisolation = 3\n"))
    full = _not_plain(config, tmp_path / "full.toml")
    uid = Kubelet.new_pod_uid()
    user = dict(VOL)
    if case in ("already-mounted", "second-pod"):
        made = kube.mount(uid, "pv-1", Kubelet.mount_options(VOL, pv="pv-1", pod_uid=uid))
        assert made is not None and made.ok, made and made.reply
        if case == "second-pod":
            uid = Kubelet.new_pod_uid()
    elif case == "bad-size":
        user["size"] = "lots"
    elif case == "escaping-file":
        user["file"] = "../../etc/passwd"
    elif case == "unknown-option":
        user["sise"] = "1Gi"
    options = Kubelet.mount_options(user, pv="pv-1", pod_uid=uid)
    if case == "pod-uid-of-another-pod":
        options["kubernetes.io/pod.uid"] = "someone-else"
    replies = []
    for which, cfg in (("plain", config), ("tomllib", full)):
        target = kube.pod_dir(uid, "pv-1")
        target.mkdir(mode=0o750, parents=True, exist_ok=True)
        reply, _ = traced(cfg, tmp_path / f"{which}.txt", "mount", str(target), go_json(options))
        replies.append(reply_of(reply, cfg))
        if case == "second-pod" and which == "plain":
            assert reply.ok, reply.reply
            kube.call("unmount", str(target))  # the tomllib run mounts it again
    assert replies[0] == replies[1]
    if case in ("already-mounted", "second-pod"):
        assert replies[0] == ("Success", "")
    else:
        assert replies[0][0] == "Failure" and replies[0][1], replies[0]


def test_the_journal_is_the_same_whichever_reader_read_the_config(
    kube: Kubelet, node_tree: dict[str, Path], tmp_path: Path
) -> None:
    """A mount under the tomllib-only config writes the records a plain-config mount writes
    (the loopfile root, from the ``[loopfile]`` table, is in the volume id)."""
    full = _not_plain(node_tree["config"], tmp_path / "full.toml")
    records = []
    for name, cfg in (("a", node_tree["config"]), ("b", full)):
        uid = f"uid-{name}"
        target = kube.pod_dir(uid, f"pv-{name}")
        target.mkdir(mode=0o750, parents=True)
        user = {**VOL, "file": f"lean/{name}.img"}
        reply, _ = traced(
            cfg,
            tmp_path / f"{name}.txt",
            "mount",
            str(target),
            go_json(Kubelet.mount_options(user, pv=f"pv-{name}", pod_uid=uid)),
        )
        assert reply.ok, reply.reply
        pods = [
            json.loads(p.read_text())
            for p in (node_tree["state"] / "pods").iterdir()
            if not p.name.startswith(".")
        ]
        mine = [p for p in pods if p["target"].endswith(f"pv-{name}")]
        assert len(mine) == 1
        record = {k: v for k, v in mine[0].items() if k not in ("created", "target", "staging")}
        # the volume id names the file under the root both readers read from the config
        record["volume_id"] = record["volume_id"].replace(f"{name}.img", "X.img")
        records.append(record)
        assert os.path.ismount(target)
    assert records[0] == records[1]
