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

from flexhub.errors import InvalidOptions
from flexhub.harness import Kubelet, go_json
from flexhub.kubelet import Call, parse_options
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
