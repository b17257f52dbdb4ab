"""The kubelet protocol, end to end: the installed driver run exactly as kubelet runs it."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from flexhub.admin.harness import KUBELET_ENV, Kubelet, go_json, parse_reply
from tests.conftest import PYTHON, REPO, needs_root, run_flexhub

ECHO = {"backend": "echo", "tag": "t1"}


def opts(user: dict[str, str], **kw: object) -> str:
    return go_json(Kubelet.base_options(user, pv="pv-1", **kw))  # type: ignore[arg-type]


def mount_opts(user: dict[str, str], **kw: object) -> str:
    return go_json(Kubelet.mount_options(user, pv="pv-1", pod_uid="uid-1", **kw))  # type: ignore[arg-type]


def test_init_through_installed_driver_with_bare_environment(driver: Path) -> None:
    proc = subprocess.run(
        ["env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", str(driver), "init"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        cwd="/",
        check=False,
    )
    assert proc.stderr == b""
    reply = parse_reply(proc.stdout)
    assert proc.returncode == 0
    assert reply == {"status": "Success", "capabilities": documented_capabilities()}
    assert all(isinstance(v, bool) for v in reply["capabilities"].values())
    assert reply["capabilities"]["attach"] is False


def test_install_is_atomic_and_minimal(driver: Path, node_tree: dict[str, Path]) -> None:
    plugins = node_tree["plugins"]
    assert driver == plugins / "k8s~flexhub" / "flexhub"
    assert sorted(p.name for p in plugins.iterdir()) == ["k8s~flexhub"]
    assert sorted(p.name for p in driver.parent.iterdir()) == ["flexhub"]
    mode = driver.stat().st_mode
    assert mode & stat.S_IXUSR and mode & stat.S_IXOTH
    text = driver.read_text()
    assert f"PY={PYTHON}" in text
    assert f"FLEXHUB_CONFIG={node_tree['config']}" in text
    assert text.startswith("#!/bin/sh\n")


def documented_capabilities() -> dict[str, bool]:
    """The ``init`` reply's capabilities as the docs write them (not flexhub's constant)."""
    text = (REPO / "docs" / "backends" / "protocol.md").read_text()
    section = text[text.index("# Capabilities (the `init` reply)") :]
    literal = re.search(r"^`(\{.*\})`$", section, re.M)
    assert literal, "the docs' capabilities literal is missing"
    parsed: dict[str, bool] = json.loads(literal.group(1))
    return parsed


def test_readme_capabilities_are_what_kubelet_must_see() -> None:
    # attach:false and fsGroup:false are the README's reasoned decisions; a literal the
    # README cannot silently drift from
    assert documented_capabilities() == {
        "attach": False,
        "selinuxRelabel": True,
        "fsGroup": False,
        "supportsMetrics": True,
        "requiresFSResize": True,
    }


def test_uninstall(driver: Path, node_tree: dict[str, Path]) -> None:
    reply = run_flexhub(["init"])
    assert reply.ok
    proc = subprocess.run(
        [PYTHON, "-m", "flexhub", "uninstall", "--plugin-dir", str(node_tree["plugins"])],
        capture_output=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not driver.exists()
    assert list(node_tree["plugins"].iterdir()) == []


def test_install_rejects_bad_driver_name(tmp_path: Path) -> None:
    proc = subprocess.run(
        [PYTHON, "-m", "flexhub", "install", "--plugin-dir", str(tmp_path), "--driver", "Bad~x"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert "must look like vendor/name" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_shim_reports_a_missing_runtime_as_json(tmp_path: Path) -> None:
    from flexhub.admin.install import install

    driver = install(tmp_path, python="/nonexistent/python3")
    proc = subprocess.run(
        [str(driver), "init"], stdin=subprocess.DEVNULL, capture_output=True, check=False
    )
    assert proc.stderr == b""
    reply = parse_reply(proc.stdout)
    assert proc.returncode == 1
    assert reply["status"] == "Failure"
    assert "runtime missing" in reply["message"]


@pytest.mark.parametrize(
    ("args", "extra"),
    [
        (["getvolumename", opts(ECHO)], {"volumeName": "pv-1"}),
        (["attach", opts(ECHO), "node-1"], {"device": ""}),
        (["isattached", opts(ECHO), "node-1"], {"attached": True}),
        (["detach", "pv-1", "node-1"], {}),
        (["waitforattach", "/dev/xyz", opts(ECHO)], {"device": "/dev/xyz"}),
        (["mountdevice", "/var/lib/kubelet/plugins/x/mounts/pv-1", "/dev/xyz", opts(ECHO)], {}),
        (["unmountdevice", "/var/lib/kubelet/plugins/x/mounts/pv-1"], {}),
        (["expandvolume", opts(ECHO), "k8s/flexhub/mounts/pv-1", "6442450944", "2147483648"], {}),
    ],
)
def test_attach_family_answers_success_without_touching_the_node(
    args: list[str], extra: dict[str, object], node_tree: dict[str, Path]
) -> None:
    reply = run_flexhub(args, node_tree["config"])
    assert reply.reply == {"status": "Success", **extra}
    assert reply.returncode == 0
    assert not (node_tree["state"] / "pods").exists()


def test_getvolumename_after_kubelet_restart_has_no_user_options() -> None:
    # kubelet's reconstruction sends only the three base keys
    j0 = go_json(Kubelet.base_options({}, pv="pv-9"))
    reply = run_flexhub(["getvolumename", j0])
    assert reply.reply == {"status": "Success", "volumeName": "pv-9"}


@pytest.mark.parametrize("op", ["waitfordetach", "provision", "frobnicate", "Mount"])
def test_unknown_operation_is_not_supported(op: str) -> None:
    reply = run_flexhub([op, "{}"])
    assert reply.reply == {"status": "Not supported"}
    assert reply.returncode == 1


def test_no_operation_prints_the_help() -> None:
    """kubelet always names an operation; ``flexhub`` alone is a person asking for help."""
    proc = subprocess.run(
        [PYTHON, "-m", "flexhub"], stdin=subprocess.DEVNULL, capture_output=True, check=False
    )
    assert proc.stdout.startswith(b"Usage: flexhub")
    assert proc.returncode == 0


@pytest.mark.parametrize(
    "args",
    [
        ["init", "extra"],
        ["mount", "/x"],
        ["mount", "/x", "{}", "extra"],
        ["unmount"],
        ["unmount", "/a", "/b"],
        ["getvolumename"],
        ["attach", "{}"],
        ["isattached", "{}"],
        ["detach", "pv"],
        ["waitforattach", "/dev/x"],
        ["mountdevice", "/g", "{}"],
        ["unmountdevice"],
        ["expandvolume", "{}", "/g", "1"],
        ["expandfs", "{}", "", "/p", "1"],
    ],
)
def test_wrong_argument_count_is_a_one_line_failure(args: list[str]) -> None:
    reply = run_flexhub(args)
    assert reply.status == "Failure"
    assert reply.returncode == 1
    assert "expected" in reply.message and "\n" not in reply.message


BAD_OPTIONS = [
    ("{not json", "not valid JSON"),
    ("[1,2]", "must be a JSON object"),
    ('"text"', "must be a JSON object"),
    ('{"backend":"echo","tag":5}', "must be a string"),
    ('{"backend":"echo","tag":null}', "must be a string"),
    ('{"backend":"echo","tag":{"a":"b"}}', "must be a string"),
    ('{"tag":"t1"}', "option 'backend' is required"),
    ('{"backend":""}', "option 'backend' is required"),
    ('{"backend":"nosuch","tag":"t1"}', "unknown backend 'nosuch'; installed backends:"),
    ('{"backend":"../../etc","tag":"t1"}', "not a backend name"),
    ('{"backend":"broken","tag":"t1"}', "backend 'broken' failed to import: ImportError: libfrob"),
    ('{"backend":"notabackend","tag":"t1"}', "does not provide a flexhub.backend.Backend"),
    ('{"backend":"echo"}', "missing required option 'tag'"),
    (
        '{"backend":"echo","tag":"t1","sever":"x"}',
        "unknown option 'sever' (did you mean 'server'?)",
    ),
    ('{"backend":"echo","tag":""}', "$.tag"),
    ('{"backend":"echo","tag":"a; rm -rf /"}', "expected a short lower-case tag"),
    ('{"backend":"echo","tag":"$(reboot)"}', "$.tag"),
    ('{"backend":"echo","tag":"../../etc"}', "$.tag"),
    ('{"backend":"echo","tag":"t1","kubernetes.io/readwrite":"rx"}', "readwrite"),
    ('{"backend":"echo","tag":"t1","size":"13m"}', "13m is unlucky"),
    ('{"backend":"echo","tag":"' + "a" * 70000 + '"}', "longer than"),
]


@needs_root
@pytest.mark.parametrize(("raw", "expected"), BAD_OPTIONS)
def test_bad_mount_options_fail_cleanly_and_change_nothing(
    raw: str, expected: str, node_tree: dict[str, Path], tmp_path: Path
) -> None:
    target = tmp_path / "pod"
    target.mkdir()
    reply = run_flexhub(["mount", str(target), raw], node_tree["config"])
    assert reply.status == "Failure", reply.reply
    assert reply.returncode == 1
    assert expected in reply.message
    assert "\n" not in reply.message and "Traceback" not in reply.message
    assert len(reply.message) <= 1000
    assert not os.path.ismount(target)
    assert list(target.iterdir()) == []
    assert not (node_tree["state"] / "pods").exists()
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()


def test_non_utf8_argv_is_a_failure(tmp_path: Path, node_tree: dict[str, Path]) -> None:
    raw = b'{"backend":"echo","tag":"\xff\xfe"}'
    proc = subprocess.run(
        [PYTHON, "-m", "flexhub", "mount", str(tmp_path), raw],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**KUBELET_ENV, "FLEXHUB_CONFIG": str(node_tree["config"])},
        cwd="/",
        check=False,
    )
    reply = parse_reply(proc.stdout)
    assert proc.returncode == 1
    assert reply == {"status": "Failure", "message": "options are not valid UTF-8"}


@pytest.mark.parametrize("target", ["relative/dir", "/a/../etc", ""])
def test_bad_mount_directory(target: str, node_tree: dict[str, Path]) -> None:
    reply = run_flexhub(["mount", target, mount_opts(ECHO)], node_tree["config"])
    assert reply.status == "Failure"
    assert reply.returncode == 1


def test_missing_mount_directory_is_not_created(tmp_path: Path, node_tree: dict[str, Path]) -> None:
    target = tmp_path / "absent"
    reply = run_flexhub(["mount", str(target), mount_opts(ECHO)], node_tree["config"])
    assert reply.status == "Failure"
    assert "does not exist" in reply.message
    assert not target.exists()


def test_broken_node_config_fails_mount_but_not_init(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("state_dir = [\n")
    assert run_flexhub(["init"], config).ok
    reply = run_flexhub(["mount", str(tmp_path), mount_opts(ECHO)], config)
    assert reply.status == "Failure"
    assert "not valid TOML" in reply.message


def test_secret_values_never_reach_reply_or_log(tmp_path: Path, node_tree: dict[str, Path]) -> None:
    secret = "hunter2-Zq9"
    raw = mount_opts(
        {"backend": "echo", "tag": "t1", "sever": secret}, secrets={"password": secret}
    )
    raw2 = go_json({**json.loads(raw), "kubernetes.io/secret/password": secret})  # not base64
    for options in (raw, raw2):
        reply = run_flexhub(["mount", str(tmp_path), options], node_tree["config"])
        assert reply.status == "Failure"
        assert secret not in reply.output.decode()
    log = (node_tree["log"] / "flexhub.log").read_text()
    assert secret not in log
    assert '"op": "mount"' in log


def test_decoded_secrets_are_scrubbed_from_internal_errors(
    tmp_path: Path, node_tree: dict[str, Path]
) -> None:
    secret = "s3cr3t-decoded"
    raw = mount_opts({"backend": "echo", "tag": "leak"}, secrets={"password": secret})
    reply = run_flexhub(["mount", str(tmp_path), raw], node_tree["config"])
    assert reply.status == "Failure"
    assert reply.message == "internal error: RuntimeError: cannot log in with ***"
    log = (node_tree["log"] / "flexhub.log").read_text()
    assert secret not in log and "cannot log in with ***" in log


def test_shim_answers_json_when_flexhub_cannot_start(tmp_path: Path) -> None:
    from flexhub.admin.install import install

    # a real interpreter that has no flexhub installed (kept away from site-packages by -I)
    bare = tmp_path / "venv"
    subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(bare)], check=True)
    driver = install(tmp_path / "plugins", python=str(bare / "bin" / "python"))
    proc = subprocess.run(
        [str(driver), "init"], stdin=subprocess.DEVNULL, capture_output=True, cwd="/", check=False
    )
    assert proc.stderr == b""
    reply = parse_reply(proc.stdout)
    assert proc.returncode == 1
    assert reply["status"] == "Failure"
    assert "flexhub cannot start: ModuleNotFoundError" in reply["message"]


def test_one_structured_log_line_per_call(node_tree: dict[str, Path]) -> None:
    run_flexhub(["init"], node_tree["config"])
    run_flexhub(["getvolumename", opts(ECHO)], node_tree["config"])
    lines = [
        line
        for line in (node_tree["log"] / "flexhub.log").read_text().splitlines()
        if " flexhub.calls: call " in line
    ]
    assert len(lines) == 2
    record = json.loads(lines[1].split(" call ", 1)[1])
    assert record["op"] == "getvolumename"
    assert record["volume"] == "pv-1"
    assert record["status"] == "Success"
    assert isinstance(record["ms"], float)


@needs_root
def test_mount_unmount_round_trip_through_core(
    kubelet: Kubelet, node_tree: dict[str, Path]
) -> None:
    pod = kubelet.new_pod_uid()
    options = Kubelet.mount_options(ECHO, pv="pv-1", pod_uid=pod)
    # the installed driver has no test backends on its path: call the module directly
    target = kubelet.pod_dir(pod, "pv-1")
    target.mkdir(parents=True, mode=0o750)
    try:
        reply = run_flexhub(["mount", str(target), go_json(options)], node_tree["config"])
        assert reply.ok, reply.reply
        assert os.path.ismount(target)
        again = run_flexhub(["mount", str(target), go_json(options)], node_tree["config"])
        assert again.ok, again.reply
        (target / "hello").write_text("hi")
        reply = run_flexhub(["unmount", str(target)], node_tree["config"])
        assert reply.ok, reply.reply
        assert not os.path.ismount(target)
        assert list(target.iterdir()) == []
        reply = run_flexhub(["unmount", str(target)], node_tree["config"])
        assert reply.ok, reply.reply
        target.rmdir()
        reply = run_flexhub(["unmount", str(target)], node_tree["config"])
        assert reply.ok, reply.reply
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)


@needs_root
def test_read_only_mount_refuses_writes(tmp_path: Path, node_tree: dict[str, Path]) -> None:
    raw = go_json(Kubelet.mount_options(ECHO, pv="pv-1", pod_uid="u", read_only=True))
    target = tmp_path / "pod"
    target.mkdir()
    try:
        reply = run_flexhub(["mount", str(target), raw], node_tree["config"])
        assert reply.ok, reply.reply
        with pytest.raises(OSError):
            (target / "x").write_text("no")
    finally:
        assert run_flexhub(["unmount", str(target)], node_tree["config"]).ok


def test_nothing_reaches_stderr_even_on_internal_errors(tmp_path: Path) -> None:
    for args in (["init"], ["mount", "/x", "{"], ["unmount", str(tmp_path)], ["bogus"]):
        proc = subprocess.run(
            [PYTHON, "-W", "error", "-m", "flexhub", *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env={
                **KUBELET_ENV,
                "PYTHONPATH": str(Path(__file__).parent.parent / "fixtures" / "site"),
                "FLEXHUB_CONFIG": os.environ["FLEXHUB_CONFIG"],  # the session's, not the node's
            },
            cwd="/",
            check=False,
        )
        assert proc.stderr == b"", (args, proc.stderr)
        parse_reply(proc.stdout)


#: (gRPC and protobuf: the CSI front end's alone, never the FlexVolume path's)
LEAN_FORBIDDEN = ("typer", "rich", "pydantic", "jsonschema", "click", "yaml", "grpc", "google")


@pytest.mark.parametrize("args", [["init"], ["unmount", "/nonexistent/pod/dir"]])
def test_kubelet_hot_path_imports_stay_lean(
    args: list[str], tmp_path: Path, node_tree: dict[str, Path]
) -> None:
    out = tmp_path / "modules.txt"
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"  # -S: no site, no .pth file loads anything
        "before = set(sys.modules)\n"
        "from flexhub.__main__ import main\n"
        f"rc = main({args!r})\n"
        f"open({str(out)!r}, 'w').write('\\n'.join(sorted(set(sys.modules) - before)))\n"
    )
    subprocess.run(
        [PYTHON, "-I", "-S", "-c", code],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env={**KUBELET_ENV, "FLEXHUB_CONFIG": str(node_tree["config"])},
        cwd="/",
        check=True,
    )
    modules = out.read_text().split()
    # answered by the quick path, before the dispatcher and everything it imports
    assert "flexhub.driver.quick" in modules
    assert "flexhub.driver.kubelet" not in modules
    heavy = sorted(m for m in modules if m.split(".")[0] in LEAN_FORBIDDEN + QUICK_FORBIDDEN)
    assert heavy == []


#: What a shipped backend's import (every ``mount`` and ``unmount`` through it loads it) never
#: imports: ``@dataclass`` compiles its methods at import and needs ``inspect``, about 20 ms a
#: kubelet call on a node and half a second in the emulated test guest; records derive from
#: ``flexhub.backend.Frozen`` instead.
BACKEND_FORBIDDEN = ("dataclasses", "inspect", "ast")


@pytest.mark.parametrize("backend", ["loopfile", "nfs", "cifs", "iscsi"])
def test_shipped_backends_import_no_dataclasses(backend: str) -> None:
    code = (
        "import sys\n"
        f"import flexhub_{backend}, flexhub.driver.kubelet\n"
        f"print(' '.join(m for m in {BACKEND_FORBIDDEN!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [PYTHON, "-I", "-c", code], capture_output=True, text=True, cwd="/", check=True
    )
    assert out.stdout.split() == []


#: What ``init`` and an ``unmount`` with nothing to unmount never import (issue: answer before
#: importing anything the answer does not need).
QUICK_FORBIDDEN = (
    "json",
    "re",
    "pathlib",
    "typing",
    "tomllib",
    "enum",
    "dataclasses",
    "logging",
    "subprocess",
    "hashlib",
    "stevedore",
)


def test_stevedore_cache_lives_in_state_dir_without_home(node_tree: dict[str, Path]) -> None:
    # kubelet gives drivers no HOME; stevedore must not fall back to ~ or create "./~"
    reply = run_flexhub(["attach", opts(ECHO), "node-1"], node_tree["config"])
    assert reply.ok, reply.reply
    cache = node_tree["state"] / "cache" / "python-entrypoints"
    if PYTHON.startswith("/tmp"):
        # stevedore writes no cache at all for an interpreter under /tmp (its rule for
        # ansible's temporary Pythons), so a venv there leaves none, anywhere
        assert not cache.exists()
    else:
        assert cache.is_dir()
    assert not Path("/~").exists()
