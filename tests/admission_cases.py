"""The objects deploy/admission-policy.yaml must admit or reject, shared by the real API
server's test (tests/cluster/test_admission.py) and ``flexhub validate``'s twin tests."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

POLICY_FILE = Path(__file__).resolve().parent.parent / "deploy" / "admission-policy.yaml"
DRIVER = "k8s/flexhub"
LOOPFILE = {"backend": "loopfile", "file": "db.img", "size": "1Gi"}


def pv(options: Mapping[str, str] | None = None, driver: str = DRIVER) -> dict[str, Any]:
    flex: dict[str, Any] = {"driver": driver, "fsType": "ext4"}
    if options is not None:
        flex["options"] = dict(options)
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": "pv-db"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "flexVolume": flex,
        },
    }


def pod(*volumes: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "busybox"}]}
    if volumes:
        spec["volumes"] = list(volumes)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}


def flex(name: str, options: Mapping[str, str] | None, driver: str = DRIVER) -> dict[str, Any]:
    source: dict[str, Any] = {"driver": driver}
    if options is not None:
        source["options"] = dict(options)
    return {"name": name, "flexVolume": source}


def empty(name: str) -> dict[str, Any]:
    return {"name": name, "emptyDir": {}}


KUBELET_KEYS = [
    "kubernetes.io/pod.uid",
    "kubernetes.io/pod.namespace",
    "kubernetes.io/readwrite",
    "kubernetes.io/secret/password",
    "kubernetes.io/mounterArgs.FsGroup",
    "kubernetes.io/fsType",
]

MANY = [empty(f"e{i}") for i in range(300)]
MORE = [empty(f"f{i}") for i in range(300)]  # volume names are unique in a pod

#: (name, object, admitted by the kubelet-key policies)
CASES: list[tuple[str, dict[str, Any], bool]] = [
    (
        "pv without flexVolume",
        {
            **pv(),
            "spec": {**pv()["spec"], "flexVolume": None, "nfs": {"server": "s", "path": "/x"}},
        },
        True,
    ),
    ("pv without options", pv(None), True),
    ("pv with its own options", pv(LOOPFILE), True),
    ("pv of another driver", pv({"kubernetes.io/pod.uid": "x"}, driver="acme/fs"), True),
    ("pv with a lookalike key", pv({**LOOPFILE, "xkubernetes.io/pod.uid": "x"}), True),
    *[(f"pv setting {k}", pv({**LOOPFILE, k: "1"}), False) for k in KUBELET_KEYS],
    ("pod without volumes", pod(), True),
    ("pod without flexVolume", pod(empty("a"), empty("b")), True),
    ("pod with a clean inline volume", pod(empty("a"), flex("v", LOOPFILE)), True),
    ("pod with an inline volume without options", pod(flex("v", None)), True),
    ("pod of another driver", pod(flex("v", {"kubernetes.io/pod.uid": "x"}, "acme/fs")), True),
    *[
        (f"pod setting {k}", pod(empty("a"), flex("v", {**LOOPFILE, k: "1"})), False)
        for k in KUBELET_KEYS
    ],
    ("pod with many volumes", pod(*MANY, flex("v", LOOPFILE), *MORE), True),
    (
        "pod with many volumes, the last one bad",
        pod(
            *MANY, flex("v", LOOPFILE), flex("w", {**LOOPFILE, "kubernetes.io/pod.namespace": "x"})
        ),
        False,
    ),
]


NFS = {"backend": "nfs", "server": "s", "share": "/x"}
#: (name, pod, admitted in an unlabelled namespace, admitted there with allowedBackends ['nfs'])
INLINE_CASES = [
    ("no volumes", pod(), True, True),
    ("no flexVolume", pod(empty("a")), True, True),
    ("another driver", pod(flex("v", {"backend": "loopfile"}, "acme/fs")), True, True),
    ("inline loopfile", pod(empty("a"), flex("v", LOOPFILE)), False, False),
    ("inline nfs", pod(flex("v", NFS)), False, True),
    ("inline nfs and loopfile", pod(flex("a", NFS), flex("b", LOOPFILE)), False, False),
    ("inline without options", pod(flex("v", None)), False, False),
    ("inline without a backend", pod(flex("v", {"server": "s"})), False, False),
    ("many volumes, one inline", pod(*MANY, flex("v", LOOPFILE)), False, False),
]
