"""Hostile options: control characters, kubelet keys overridden by the user, leaking secrets.

Options come from PV authors and, for inline ``flexVolume`` volumes, from any pod author;
kubelet merges them last, over its own ``kubernetes.io/*`` keys.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from flexhub.admin.harness import Kubelet, go_json
from flexhub.driver.kubelet import Call, parse_options
from flexhub.errors import InvalidOptions
from tests.conftest import needs_root, run_flexhub

ECHO = {"backend": "echo", "tag": "t1"}


def mount_opts(user: dict[str, str], **kw: object) -> str:
    return go_json(Kubelet.mount_options(user, pv="pv-1", pod_uid="uid-1", **kw))  # type: ignore[arg-type]


# -- control characters ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "vol.img\n",
        "vol\n.img",
        "\nvol.img",
        "vol.img\r",
        "a\tb",
        "a\x1bb",
        "a\x7f",
        "a\x85",
        "a\u2028",
    ],
)
def test_control_characters_in_a_value_are_refused(value: str) -> None:
    raw = json.dumps({"backend": "loopfile", "file": value})
    with pytest.raises(InvalidOptions) as info:
        parse_options(raw, Call("mount"))
    assert "option 'file' contains a control character" in info.value.message
    assert value not in info.value.message


@pytest.mark.parametrize("key", ["file\n", "kubernetes.io/pod.uid\n", "a\x00b"])
def test_control_characters_in_a_key_are_refused(key: str) -> None:
    with pytest.raises(InvalidOptions):
        parse_options(json.dumps({"backend": "loopfile", key: "x"}), Call("mount"))


def test_secret_values_are_base64_and_pass() -> None:
    secret = base64.b64encode(b"pa ss\n").decode()
    options = parse_options(
        json.dumps({"backend": "x", "kubernetes.io/secret/password": secret, "v": "é ü 日本"}),
        Call("mount"),
    )
    assert options["kubernetes.io/secret/password"] == secret


@needs_root
def test_a_trailing_newline_in_a_file_name_is_a_failure_that_changes_nothing(
    tmp_path: Path, node_tree: dict[str, Path]
) -> None:
    target = tmp_path / "pod"
    target.mkdir()
    raw = mount_opts({"backend": "loopfile", "file": "vol.img\n", "size": "16Mi"})
    reply = run_flexhub(["mount", str(target), raw], node_tree["config"])
    assert reply.status == "Failure"
    assert reply.message == (
        "option 'file' contains a control character (a newline, tab, ...): "
        "no option key or value may"
    )
    assert not os.path.ismount(target)
    assert not node_tree["loopfiles"].exists() or list(node_tree["loopfiles"].iterdir()) == []
    assert not (node_tree["state"] / "pods").exists()


# -- redaction before folding and truncation -----------------------------------------------------


def _leak(node_tree: dict[str, Path], tmp_path: Path, secret: str) -> tuple[str, str]:
    """Mount with a backend whose internal error quotes the decoded secret; (output, log)."""
    raw = mount_opts({"backend": "echo", "tag": "leak"}, secrets={"password": secret})
    reply = run_flexhub(["mount", str(tmp_path), raw], node_tree["config"])
    assert reply.status == "Failure"
    assert reply.message.startswith("internal error: RuntimeError: cannot log in with ***")
    return reply.output.decode(), (node_tree["log"] / "flexhub.log").read_text()


def _pieces(secret: str, size: int = 8) -> set[str]:
    return {secret[i : i + size] for i in range(len(secret) - size + 1)}


def test_a_secret_with_whitespace_never_appears_in_any_form(
    tmp_path: Path, node_tree: dict[str, Path]
) -> None:
    secret = "pa ss\n"  # kubectl create secret --from-file keeps the file's final newline
    output, log = _leak(node_tree, tmp_path, secret)
    for form in (secret, "pa ss", json.dumps(secret)[1:-1]):
        assert form not in output
        assert form not in log


def test_a_secret_across_the_truncation_point_never_appears(
    tmp_path: Path, node_tree: dict[str, Path]
) -> None:
    # the reply's message is cut at 1000 characters; this secret starts before and ends after
    secret = "".join(f"{i:04d}Zq" for i in range(300))
    output, log = _leak(node_tree, tmp_path, secret)
    assert not any(piece in output for piece in _pieces(secret))
    assert not any(piece in log for piece in _pieces(secret))


def test_the_runner_excerpt_redacts_the_calls_secrets_before_cutting() -> None:
    from flexhub.node.runner import Result, command_error

    secret = "".join(f"{i:03d}Kx" for i in range(100))
    encoded = base64.b64encode(secret.encode()).decode()
    parse_options(json.dumps({"kubernetes.io/secret/key": encoded}), Call("mount"))
    # a tool echoes the secret (not passed to this command as a secret) past the excerpt's cut
    result = Result(("tool", "arg"), 1, "", "error: " + "x" * 380 + " " + secret + "\n")
    error = command_error(result)
    assert not any(piece in error.message for piece in _pieces(secret))
    assert not any(piece in error.output for piece in _pieces(secret))
    assert "***" in error.message or error.message.endswith("...")


def test_redact_knows_every_form_of_a_secret() -> None:
    from flexhub.errors import one_line, redact

    secret = "my  pass\tword\n"
    text = f"a {secret} b {secret.strip()} c {secret!r} d {json.dumps(secret)}"
    redacted = redact(text, [secret], 3)
    assert "pass" not in redacted
    assert "pass" not in one_line(redact(text, [secret]))


# -- the "secret in the details" check and lazy secret decoding --------------------------------


def _mount_echo(
    node_tree: dict[str, Path], tmp_path: Path, tag: str, secrets: dict[str, str]
) -> tuple[str, str]:
    target = tmp_path / "pod"
    target.mkdir(exist_ok=True)
    options = Kubelet.mount_options(
        {"backend": "echo", "tag": tag}, pv="pv-1", pod_uid="uid-1", secrets=None
    )
    for key, value in secrets.items():
        options[f"kubernetes.io/secret/{key}"] = value
    reply = run_flexhub(["mount", str(target), go_json(options)], node_tree["config"])
    mounted = os.path.ismount(target)
    assert run_flexhub(["unmount", str(target)], node_tree["config"]).ok
    assert not os.path.ismount(target)
    return reply.status + ("+mounted" if mounted else ""), reply.message


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode()


@needs_root
@pytest.mark.parametrize(
    ("tag", "secret"),
    [
        ("storage-db", "storage"),  # a CHAP user name that occurs in an IQN-like value
        ("t1", "t"),  # a one-character secret
        ("ab", "ab"),  # equal, but shorter than the minimum secret length
        ("t1-secret", "t1-secret\n"),  # the volume's own option holds it: the PV shows it
    ],
)
def test_a_secret_inside_a_detail_is_not_a_leak(
    tag: str, secret: str, tmp_path: Path, node_tree: dict[str, Path]
) -> None:
    status, message = _mount_echo(node_tree, tmp_path, tag, {"username": _b64(secret.encode())})
    assert (status, message) == ("Success+mounted", "")


@needs_root
def test_a_detail_equal_to_a_secret_is_still_refused(
    tmp_path: Path, node_tree: dict[str, Path]
) -> None:
    status, message = _mount_echo(
        node_tree, tmp_path, "careless", {"password": _b64(b"t1-secret\n")}
    )
    assert status == "Failure"
    assert (
        message
        == "backend 'echo' returned a secret in its details ('note'): refusing to journal it"
    )


@needs_root
def test_a_binary_key_the_backend_does_not_use_does_not_fail_the_mount(
    tmp_path: Path, node_tree: dict[str, Path]
) -> None:
    binary = {"tls.key": _b64(b"\xff\xfe\x00\x80 key"), "ca.crt": "not base64!"}
    status, message = _mount_echo(node_tree, tmp_path, "t1", binary)
    assert (status, message) == ("Success+mounted", "")


def test_a_used_secret_key_that_is_not_text_is_named_not_shown() -> None:
    from flexhub.volume import Secrets

    secrets = Secrets.from_options(
        {
            "kubernetes.io/secret/password": _b64(b"\xff\xfe"),
            "kubernetes.io/secret/user": _b64(b"alice"),
            "backend": "x",
        }
    )
    assert sorted(secrets) == ["password", "user"] and "password" in secrets
    assert secrets["user"].reveal() == "alice"
    assert secrets.revealed() == ["alice"]
    with pytest.raises(InvalidOptions, match="secret key 'password' is not base64-encoded UTF-8"):
        secrets.get("password")
