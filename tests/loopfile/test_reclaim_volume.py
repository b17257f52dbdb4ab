"""The DaemonSet's node agent reclaims a loop file through the installed driver, in the host,
with the host's config: ``flexhub reclaim-volume`` (hidden) run as kubelet runs the driver,
the request on stdin. Real loop devices and mounts (as tests/loopfile/test_provision.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flexhub.admin.deploy import run_in_host
from flexhub.admin.harness import Kubelet, parse_reply
from flexhub.admin.install import install
from flexhub.admin.reclaim import host_reclaimer
from flexhub.errors import FlexhubError, UntrustedPath
from tests.conftest import needs_root
from tests.loopfile.test_provision import claim, image, provisioned, pv_options

pytestmark = [needs_root, pytest.mark.root]


@pytest.fixture
def host_driver(trusted_dir: Path, node_tree: dict[str, Path]) -> Path:
    """The driver installed where the trust rule accepts it (root's alone up to /), with the
    node's config, as the DaemonSet installs it on the host."""
    return install(trusted_dir / "plugins", config=node_tree["config"])


def _record(namespace: str) -> dict[str, str]:
    return {"backend": "loopfile", "namespace": namespace, "onDelete": "delete"}


def test_the_installed_driver_reclaims_the_file_in_the_host(
    kube: Kubelet, node_tree: dict[str, Path], host_driver: Path
) -> None:
    c = claim()
    p = provisioned(c)
    uid = kube.new_pod_uid()
    assert kube.mount(uid, c.volume_name, pv_options(p, c, uid)).ok  # type: ignore[union-attr]
    path = image(node_tree, p)
    reclaim = host_reclaimer(Path("/"), str(host_driver))
    record = {**_record(c.namespace), **p.reclaim}
    # the driver's own config (the shim exports it) knows the mount: refused, nothing removed
    with pytest.raises(FlexhubError, match="in use: the node's journal has its staged volume"):
        reclaim("loopfile", p.options, record)
    assert path.is_file()
    assert kube.unmount(uid, c.volume_name).ok  # type: ignore[union-attr]
    reclaim("loopfile", p.options, record)
    assert not path.exists()
    reclaim("loopfile", p.options, record)  # gone already: success


def test_in_process_on_the_host_it_reclaims_with_flexhub_config(
    kube: Kubelet, node_tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = claim()
    p = provisioned(c)
    uid = kube.new_pod_uid()
    assert kube.mount(uid, c.volume_name, pv_options(p, c, uid)).ok  # type: ignore[union-attr]
    assert kube.unmount(uid, c.volume_name).ok  # type: ignore[union-attr]
    path = image(node_tree, p)
    assert path.is_file()
    monkeypatch.setenv("FLEXHUB_CONFIG", str(node_tree["config"]))
    host_reclaimer(Path("/"), None)("loopfile", p.options, {**_record(c.namespace), **p.reclaim})
    assert not path.exists()
    with pytest.raises(FlexhubError, match="needs the installed driver"):
        host_reclaimer(Path("/host"), None)


@pytest.mark.parametrize(
    ("request_bytes", "message"),
    [
        (b"not json", "reclaim request: not one JSON object"),
        (b'{"backend": "loopfile", "options": {}}', "must be an object of backend, options"),
        (
            b'{"backend": "loopfile", "options": {"size": 1}, "record": {}}',
            "options must be an object of strings",
        ),
        (b'{"backend": "", "options": {}, "record": {}}', "backend must be a backend's name"),
        (b'{"backend": "nosuch", "options": {}, "record": {}}', "nosuch"),
        (b"x" * (300 * 1024), "more than 262144 bytes"),
    ],
)
def test_a_bad_request_is_one_line_failure_and_nothing_changes(
    kube: Kubelet, node_tree: dict[str, Path], host_driver: Path, request_bytes: bytes, message: str
) -> None:
    c = claim()
    p = provisioned(c)
    uid = kube.new_pod_uid()
    assert kube.mount(uid, c.volume_name, pv_options(p, c, uid)).ok  # type: ignore[union-attr]
    assert kube.unmount(uid, c.volume_name).ok  # type: ignore[union-attr]
    path = image(node_tree, p)
    code, output = run_in_host(
        Path("/"), [str(host_driver), "reclaim-volume"], stdin_data=request_bytes
    )
    reply = parse_reply(output)
    assert code == 1 and reply["status"] == "Failure", output
    assert message in reply["message"] and "\n" not in reply["message"]
    assert output.count(b"\n") == 1
    assert path.is_file()


def test_a_driver_others_may_write_is_never_run(host_driver: Path) -> None:
    os.chmod(host_driver, 0o777)
    try:
        with pytest.raises(UntrustedPath):
            host_reclaimer(Path("/"), str(host_driver))("loopfile", {"file": "x"}, _record("a"))
    finally:
        os.chmod(host_driver, 0o755)


def test_the_request_never_reaches_a_command_line(host_driver: Path) -> None:
    """The shim is replaced by one recording its argv and stdin (a recording stand-in: what is
    checked is what the node agent hands the process, not the reclaim)."""
    seen = host_driver.parent / "seen"
    host_driver.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > {seen}.argv\n'
        f"cat > {seen}.stdin\n"
        'echo \'{"status":"Success"}\'\n'
    )
    host_reclaimer(Path("/"), str(host_driver))("loopfile", {"file": "f.img"}, _record("a"))
    assert Path(f"{seen}.argv").read_text() == "reclaim-volume\n"
    assert json.loads(Path(f"{seen}.stdin").read_text()) == {
        "backend": "loopfile",
        "options": {"file": "f.img"},
        "record": _record("a"),
    }
