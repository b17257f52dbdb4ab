"""Small helpers over the official client for the cluster tier's tests."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from kubernetes.client.rest import ApiException

from tests.cluster.cluster import DRIVER, NODE, Cluster

T = TypeVar("T")
#: Any image name does: the fake runtime "pulls" and "runs" whatever it is given.
IMAGE = "flexhub.invalid/pause:1"


def eventually(
    what: str, check: Callable[[], T | None], timeout: float = 90, interval: float = 0.5
) -> T:
    """Poll ``check`` until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = check()
            if value:
                return value
            last = value
        except ApiException as exc:
            last = f"{exc.status} {exc.reason}"
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f} s (last: {last!r})")
        time.sleep(interval)


def namespace(cluster: Cluster, prefix: str, inline_allowed: bool = True) -> str:
    """A new namespace; labelled ``flexhub/inline-volumes=allowed`` (the admission policy's
    opt-in for inline volumes) unless ``inline_allowed`` is false."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    labels = {"flexhub/inline-volumes": "allowed"} if inline_allowed else {}
    cluster.core.create_namespace({"metadata": {"name": name, "labels": labels}})
    # The ServiceAccount admission plugin waits for the namespace's default account, which the
    # controller-manager creates.
    eventually(
        f"default ServiceAccount in {name}",
        lambda: cluster.core.read_namespaced_service_account("default", name),
    )
    return name


def flex(
    options: Mapping[str, str],
    read_only: bool = False,
    fs_type: str = "",
    secret: str | None = None,
) -> dict[str, Any]:
    source: dict[str, Any] = {"driver": DRIVER, "options": dict(options)}
    if read_only:
        source["readOnly"] = True
    if fs_type:
        source["fsType"] = fs_type
    if secret:
        source["secretRef"] = {"name": secret}
    return source


def pod(
    name: str,
    volumes: list[dict[str, Any]],
    read_only: bool = False,
    security: Mapping[str, Any] | None = None,
    node: str | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 1,
        "containers": [
            {
                "name": "app",
                "image": IMAGE,
                "volumeMounts": [
                    {"name": v["name"], "mountPath": f"/data/{v['name']}", "readOnly": read_only}
                    for v in volumes
                ],
            }
        ],
        "volumes": volumes,
    }
    if security:
        spec["securityContext"] = dict(security)
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def run_pod(cluster: Cluster, ns: str, manifest: dict[str, Any], timeout: float = 120) -> Any:
    """Create the pod and wait until it runs; return it."""
    cluster.core.create_namespaced_pod(ns, manifest)
    name = manifest["metadata"]["name"]

    def running() -> Any:
        current = cluster.core.read_namespaced_pod(name, ns)
        return current if current.status.phase == "Running" else None

    try:
        return eventually(f"pod {ns}/{name} Running", running, timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nevents: {events(cluster, ns, name)}") from None


def events(cluster: Cluster, ns: str, name: str) -> list[str]:
    found = cluster.core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}")
    return [f"{e.reason}: {e.message}" for e in found.items]


def delete_pod(cluster: Cluster, ns: str, name: str, timeout: float = 120) -> None:
    """Delete the pod and wait until its object is gone."""
    cluster.core.delete_namespaced_pod(name, ns)

    def gone() -> bool:
        try:
            cluster.core.read_namespaced_pod(name, ns)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    eventually(f"pod {ns}/{name} gone", gone, timeout)


def volume_dir(cluster: Cluster, pod_uid: str, volume: str) -> Path:
    """Where the kubelet has the driver mount a pod's flexhub volume."""
    return cluster.kubelet_root / "pods" / pod_uid / "volumes" / "k8s~flexhub" / volume


def mounts_of(path: Path) -> list[dict[str, str]]:
    """Every mountinfo entry mounted at ``path``, oldest first: ``id``, ``device``
    (major:minor), ``root``, ``options``, ``fstype``, ``source``, ``super``."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(path):
            tail = fields[fields.index("-") + 1 :]
            found.append(
                {
                    "id": fields[0],
                    "device": fields[2],
                    "root": fields[3],
                    "fstype": tail[0],
                    "source": tail[1],
                    "options": fields[5],
                    "super": tail[2] if len(tail) > 2 else "",
                }
            )
    return found


def mount_of(path: Path) -> dict[str, str] | None:
    """The mountinfo entry mounted at ``path`` (:func:`mounts_of`'s first), or None."""
    found = mounts_of(path)
    return found[0] if found else None


def claim_pod(name: str, claim: str) -> dict[str, Any]:
    """A pod of :func:`pod` mounting claim ``claim`` as volume ``data`` (at ``/data/data``)."""
    return pod(name, [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}])


def loopfile(file: str, size: str = "64Mi", **more: str) -> dict[str, str]:
    return {"backend": "loopfile", "file": file, "size": size, **more}


__all__ = [
    "IMAGE",
    "NODE",
    "claim_pod",
    "delete_pod",
    "events",
    "eventually",
    "flex",
    "loopfile",
    "mount_of",
    "mounts_of",
    "namespace",
    "pod",
    "run_pod",
    "volume_dir",
]
