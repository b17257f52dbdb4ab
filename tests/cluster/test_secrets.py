"""Scenario 3: a Secret through ``secretRef`` reaches the driver's ``mount``; its value is in
nothing flexhub writes; a Secret of another type fails the mount with the kubelet's message."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from tests.cluster.cluster import DRIVER, Cluster
from tests.cluster.kube import (
    delete_pod,
    events,
    eventually,
    flex,
    loopfile,
    mount_of,
    namespace,
    pod,
    run_pod,
    volume_dir,
)

pytestmark = [pytest.mark.cluster, pytest.mark.root]
VALUE = "Cl4ster-S3cret-value-7f3a9c"


def _secret(cluster: Cluster, ns: str, name: str, kind: str) -> None:
    cluster.core.create_namespaced_secret(
        ns,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name},
            "type": kind,
            "stringData": {"password": VALUE, "username": "tenant"},
        },
    )


def _everything_written(root: Path) -> bytes:
    blob = b""
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_size < 16 * 1024 * 1024:
            blob += path.read_bytes()
    return blob


def test_secret_reaches_mount_and_is_never_written(cluster: Cluster) -> None:
    ns = namespace(cluster, "secrets")
    _secret(cluster, ns, "creds", DRIVER)
    volume = {"name": "data", "flexVolume": flex(loopfile("s.img"), secret="creds")}
    running = run_pod(cluster, ns, pod("app", [volume]))
    target = volume_dir(cluster, running.metadata.uid, "data")
    assert mount_of(target) is not None
    mounts = [c for c in cluster.driver_calls("mount") if c["dir"] == str(target)]
    # The driver saw both keys of the Secret (its log names keys, never values).
    assert mounts and mounts[-1]["secrets"] == ["password", "username"]
    delete_pod(cluster, ns, "app")
    encoded = base64.b64encode(VALUE.encode())
    for where in (
        cluster.driver_log_dir,
        cluster.state_dir,
        cluster.loopfile_root,
        cluster.plugin_dir,
    ):
        blob = _everything_written(where)
        assert VALUE.encode() not in blob and encoded not in blob, f"secret found in {where}"
    shown = " ".join(events(cluster, ns, "app"))
    assert VALUE not in shown and encoded.decode() not in shown


def test_secret_of_another_type_fails_the_mount(cluster: Cluster) -> None:
    ns = namespace(cluster, "opaque")
    _secret(cluster, ns, "creds", "Opaque")
    volume = {"name": "data", "flexVolume": flex(loopfile("o.img"), secret="creds")}
    cluster.core.create_namespaced_pod(ns, pod("app", [volume]))
    message = eventually(
        "FailedMount event",
        lambda: next((e for e in events(cluster, ns, "app") if "FailedMount" in e), None),
    )
    # The kubelet's own refusal: the Secret's type must be the driver's name.
    assert f"cannot get secret of type {DRIVER}" in message, message
    assert VALUE not in message
    uid = cluster.core.read_namespaced_pod("app", ns).metadata.uid
    assert not [c for c in cluster.driver_calls("mount") if uid in c["dir"]]
    assert not (cluster.loopfile_root / "namespaces" / ns / "o.img").exists()
    delete_pod(cluster, ns, "app")
