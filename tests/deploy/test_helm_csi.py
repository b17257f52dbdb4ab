"""The chart's CSI mode (deploy/helm/flexhub, ``csi.enabled``): FlexVolume mode alone (the
default, rendered as before), CSI mode alone, or both side by side; the CSI objects with the
mounts, propagation and arguments kubelet and the sidecars need; RBAC cut from each sidecar's
upstream rbac.yaml at the pinned release; the schema refusing what CSI mode cannot take."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ciplugin import on_ci
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "deploy"))
import render_manifest  # type: ignore[import-not-found]

CHART = render_manifest.CHART
NS = render_manifest.NAMESPACE
DRIVER = "flexhub.csi.k8s.io"
CSI = "csi.enabled=true"
NO_FLEX = "flexvolume.enabled=false"
#: The kubernetes-csi releases flexhub is tested with (the tier builds these, tests/cluster).
SIDECARS = {
    "csi-provisioner": ("github.com/kubernetes-csi/external-provisioner/v5", "v5.3.0"),
    "csi-resizer": ("github.com/kubernetes-csi/external-resizer", "v1.14.0"),
    "csi-snapshotter": ("github.com/kubernetes-csi/external-snapshotter/v8", "v8.3.0"),
}
#: Each sidecar's upstream RBAC file in its module.
UPSTREAM_RBAC = {
    "csi-provisioner": "deploy/kubernetes/rbac.yaml",
    "csi-resizer": "deploy/kubernetes/rbac.yaml",
    "csi-snapshotter": "deploy/kubernetes/csi-snapshotter/rbac-csi-snapshotter.yaml",
}


@pytest.fixture(scope="module")
def helm() -> Iterator[Path]:
    """The pinned helm (tests/deploy/test_helm.py builds it the same way)."""
    if shutil.which("go") is None and not render_manifest.helm_binary(build=False).is_file():
        pytest.skip("helm is built with Go, which is not installed (.ci/install-system.sh)")
    yield render_manifest.helm_binary()


def template(
    helm: Path, *values: str, values_file: Path | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [str(helm), "template", "flexhub", str(CHART), "-n", NS]
    argv += ["--kube-version", render_manifest.KUBE_VERSION]
    if values_file is not None:
        argv += ["-f", str(values_file)]
    for value in values:
        argv += ["--set", value]
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def render(helm: Path, *values: str, values_file: Path | None = None) -> list[dict[str, Any]]:
    proc = template(helm, *values, values_file=values_file)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def names(docs: list[dict[str, Any]]) -> set[str]:
    return {f"{d['kind']}/{d['metadata']['name']}" for d in docs}


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod["containers"] if c["name"] == name]
    return found


def mounts(pod: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    """``mountPath`` -> the mount and its volume, of container ``name``."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {
        m["mountPath"]: {**m, "volume": volumes[m["name"]]}
        for m in container(pod, name).get("volumeMounts", [])
    }


FLEXVOLUME = {"DaemonSet/flexhub", "ServiceAccount/flexhub"}
CSI_OBJECTS = {
    f"CSIDriver/{DRIVER}",
    "DaemonSet/flexhub-csi-node",
    "Deployment/flexhub-csi-controller",
    "ServiceAccount/flexhub-csi-node",
    "ServiceAccount/flexhub-csi-controller",
    "ClusterRole/flexhub-csi-controller-provisioner",
    "ClusterRole/flexhub-csi-controller-resizer",
    "ClusterRole/flexhub-csi-controller-snapshotter",
    "ClusterRoleBinding/flexhub-csi-controller-provisioner",
    "ClusterRoleBinding/flexhub-csi-controller-resizer",
    "ClusterRoleBinding/flexhub-csi-controller-snapshotter",
    "Role/flexhub-csi-controller-leader-election",
    "RoleBinding/flexhub-csi-controller-leader-election",
    "Role/flexhub-csi-controller-converted-volumes",
    "RoleBinding/flexhub-csi-controller-converted-volumes",
    "ClusterRole/flexhub-csi-node-events",  # the node plugin's health Events
    "ClusterRoleBinding/flexhub-csi-node-events",
}


# -- the modes ---------------------------------------------------------------------------------


def test_the_default_is_flexvolume_mode_rendered_as_before(helm: Path) -> None:
    """Nothing of CSI by default, and saying the defaults out loud changes no byte (the plain
    manifest, tests/deploy/test_helm.py, pins the default render itself)."""
    default = template(helm)
    assert default.returncode == 0, default.stderr
    assert names([d for d in yaml.safe_load_all(default.stdout) if d]) == FLEXVOLUME | {
        "ConfigMap/flexhub-node-config"
    }
    said = template(helm, "flexvolume.enabled=true", "csi.enabled=false")
    assert said.returncode == 0, said.stderr
    assert said.stdout == default.stdout
    # so with every FlexVolume feature on: CSI off adds nothing, changes nothing
    flex = ("provisioner.enabled=true", "storageClasses[0].name=l",
            "storageClasses[0].parameters.backend=loopfile")  # fmt: skip
    assert template(helm, *flex, "csi.enabled=false").stdout == template(helm, *flex).stdout


def test_csi_mode_alone_renders_no_flexvolume_object(helm: Path) -> None:
    """flexvolume.enabled=false: no driver DaemonSet, and none of what lives in it or beside
    it (provisioner, node agent and its policy, FlexVolume classes), even when those are on."""
    docs = render(
        helm, CSI, NO_FLEX, "provisioner.enabled=true", "nodeAgent.enabled=true",
        "storageClasses[0].name=flex-l", "storageClasses[0].parameters.backend=loopfile",
        "csi.storageClasses[0].name=csi-l", "csi.storageClasses[0].parameters.backend=loopfile",
    )  # fmt: skip
    assert names(docs) == CSI_OBJECTS | {
        "ConfigMap/flexhub-node-config",
        "StorageClass/csi-l",
    }
    assert one(docs, "StorageClass", "csi-l")["provisioner"] == DRIVER


def test_both_modes_side_by_side_keep_apart(helm: Path) -> None:
    docs = render(helm, CSI, "storageClasses[0].name=flex-l", "csi.storageClasses[0].name=csi-l")
    assert names(docs) >= CSI_OBJECTS | FLEXVOLUME
    assert one(docs, "StorageClass", "flex-l")["provisioner"] == "flexhub"
    assert one(docs, "StorageClass", "csi-l")["provisioner"] == DRIVER
    # no workload's selector picks another's pods (the FlexVolume DaemonSet's selector is the
    # one shipped before: app.kubernetes.io/name flexhub)
    workloads = [d for d in docs if d["kind"] in ("DaemonSet", "Deployment")]
    assert len(workloads) == 3
    for owner in workloads:
        selector = owner["spec"]["selector"]["matchLabels"].items()
        for other in workloads:
            labels = other["spec"]["template"]["metadata"]["labels"].items()
            assert (selector <= labels) == (owner is other), (owner["metadata"]["name"], other)
    # both read the one node config (the same backends, the same node journal)
    configs = {
        v["configMap"]["name"]
        for w in workloads
        for v in w["spec"]["template"]["spec"]["volumes"]
        if "configMap" in v
    }
    assert configs == {"flexhub-node-config"}


def test_both_modes_off_is_refused_in_one_line(helm: Path) -> None:
    proc = template(helm, NO_FLEX)
    assert proc.returncode != 0
    (line,) = [ln for ln in proc.stderr.splitlines() if "flexvolume.enabled" in ln]
    assert "nothing to install" in line and "csi.enabled=true" in line


@pytest.mark.parametrize(
    ("dirs", "inner"),
    [
        ("{/var/lib/flexhub,/var/lib/flexhub/loopfiles}", "/var/lib/flexhub/loopfiles"),
        ("{/srv/a/b,/srv/a}", "/srv/a/b"),
        ("{/var/lib/flexhub,/var/lib/kubelet/flexhub}", "/var/lib/kubelet/flexhub"),
        ("{/var/lib,/var/log/flexhub}", "/var/lib/kubelet"),
        ("{/dev/flexhub}", "/dev/flexhub"),
        ("{/}", "/var/lib/kubelet"),
        ("{/etc}", "/etc/flexhub-node-config"),
        ("{/opt}", "/opt/flexhub"),
        ("{/var/run}", "/var/run/secrets/kubernetes.io/serviceaccount"),
        ("{/csi/x}", "/csi/x"),
    ],
)
def test_nested_host_dirs_are_refused_in_one_line(helm: Path, dirs: str, inner: str) -> None:
    """Each host directory is a Bidirectional mount: one inside another (or inside or around
    kubelet's directory, /dev or the container's own mounts: its node config, runtime and
    token) is mounted on the host again at every start of the plugin's container, and those
    mounts pile up (a token lands on the host), or hides one. The outer one alone holds the
    inner one."""
    proc = template(helm, CSI, f"csi.hostDirs={dirs}")
    assert proc.returncode != 0, proc.stdout[:300]
    (line,) = [ln for ln in proc.stderr.splitlines() if "csi.hostDirs" in ln]
    assert "nested" in line and inner in line, line


@pytest.mark.parametrize(
    "dirs",
    [
        "{/var/lib/flexhub//,/var/lib/flexhub/loopfiles}",
        "{/var/lib//flexhub,/var/lib/flexhub/loopfiles}",
        "{/var/lib/./kubelet/flexhub}",
        "{/var/lib/flexhub/.,/var/lib/flexhub/loopfiles}",
        "{/srv/x/../../var/lib/kubelet/y}",
        "{/var/lib/flexhub/}",
    ],
)
def test_host_dirs_not_written_clean_are_refused_in_one_line(helm: Path, dirs: str) -> None:
    """Nesting is judged on the text of each path, so it is judged only on clean paths: one
    written otherwise (``//``, ``/./``, ``/../``, a trailing ``/``) is refused, naming the
    clean form."""
    proc = template(helm, CSI, f"csi.hostDirs={dirs}")
    assert proc.returncode != 0, proc.stdout[:300]
    (line,) = [ln for ln in proc.stderr.splitlines() if "csi.hostDirs" in ln]
    assert "not a clean absolute path (write" in line, line


@pytest.mark.parametrize(
    "kubelet", ["/var/lib//kubelet", "/var/lib/./kubelet", "/srv/../var/lib/kubelet"]
)
def test_a_kubelet_dir_not_written_clean_is_refused_in_one_line(helm: Path, kubelet: str) -> None:
    proc = template(helm, CSI, f"csi.kubeletDir={kubelet}")
    assert proc.returncode != 0, proc.stdout[:300]
    (line,) = [ln for ln in proc.stderr.splitlines() if "csi.kubeletDir" in ln]
    assert "not a clean absolute path" in line, line


def test_a_host_dir_is_mounted_at_its_path_as_written(helm: Path, tmp_path: Path) -> None:
    """The checks judge each value's text, so the container mounts it at that text: a value
    YAML would read otherwise unquoted (`` #`` starts a comment: ``/var/lib #`` would be
    mounted Bidirectional at ``/var/lib``, around kubelet's directory) is quoted."""
    values = tmp_path / "values.yaml"
    values.write_text('csi:\n  hostDirs: ["/var/lib #", "/srv/a: b"]\n')
    docs = render(helm, CSI, values_file=values)
    pod = node_pod(docs)
    mounts = {m["name"]: m["mountPath"] for m in container(pod, "flexhub")["volumeMounts"]}
    sources = {v["name"]: (v.get("hostPath") or {}).get("path") for v in pod["volumes"]}
    assert mounts["host-dir-0"] == sources["host-dir-0"] == "/var/lib #"
    assert mounts["host-dir-1"] == sources["host-dir-1"] == "/srv/a: b"


def test_host_dirs_side_by_side_render(helm: Path) -> None:
    dirs = "{/var/lib/flexhub,/var/lib/flexhub-loopfiles,/var/log/flexhub}"
    assert render(helm, CSI, f"csi.hostDirs={dirs}")


# -- the objects --------------------------------------------------------------------------------


def test_the_csidriver_says_how_kubelet_calls_flexhub(helm: Path) -> None:
    driver = one(render(helm, CSI), "CSIDriver", DRIVER)
    assert driver["apiVersion"] == "storage.k8s.io/v1"
    assert driver["spec"] == {
        "attachRequired": False,
        "podInfoOnMount": True,  # the pod of a NodePublishVolume: its health Events name it
        "fsGroupPolicy": "File",
        "volumeLifecycleModes": ["Persistent"],
    }


def node_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = one(docs, "DaemonSet", "flexhub-csi-node")["spec"]["template"]["spec"]
    return pod


def test_the_node_plugin_registers_itself_with_kubelet_and_shares_its_mounts(helm: Path) -> None:
    pod = node_pod(render(helm, CSI))
    assert pod["serviceAccountName"] == "flexhub-csi-node"
    assert pod["automountServiceAccountToken"] is True  # the health watcher's Events
    assert pod["hostPID"] is True  # shares the node's state with the FlexVolume driver
    assert {"operator": "Exists"} in pod["tolerations"]  # every node may mount a volume
    assert [c["name"] for c in pod["containers"]] == ["flexhub"]  # no registrar by default
    flexhub = container(pod, "flexhub")
    assert flexhub["command"][-3:] == ["-m", "flexhub", "csi"]
    plugin = f"/var/lib/kubelet/plugins/{DRIVER}"
    assert flexhub["args"] == [
        "--mode", "node",
        "--endpoint", "unix:///csi/csi.sock",
        "--registration-dir", "/registration",
        "--kubelet-endpoint", f"{plugin}/csi.sock",
        "--node-id", "$(NODE_NAME)",
        "--health-port", "9809",
        "--health-interval", "60",
        "--config", "/etc/flexhub-node-config/flexhub.toml",
        "--log-level", "info",
    ]  # fmt: skip
    assert flexhub["env"] == [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    ]
    assert flexhub["securityContext"] == {"privileged": True}
    assert flexhub["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert flexhub["ports"] == [{"name": "healthz", "containerPort": 9809}]
    found = mounts(pod, "flexhub")
    host = {path: (m["volume"]["hostPath"]["path"], m.get("mountPropagation")) for path, m in
            found.items() if "hostPath" in m["volume"]}  # fmt: skip
    assert host == {
        "/csi": (plugin, None),
        "/registration": ("/var/lib/kubelet/plugins_registry", None),
        # a mount the plugin makes under kubelet's directory is the host's (kubelet's, the pods')
        "/var/lib/kubelet": ("/var/lib/kubelet", "Bidirectional"),
        "/dev": ("/dev", None),
        # the node config's state and log directories: the node journal FlexVolume keeps too,
        # and flexhub's staging mounts below state_dir, which must be the host's (a FlexVolume
        # call sees them, a restarted plugin finds them) and the host's seen here
        "/var/lib/flexhub": ("/var/lib/flexhub", "Bidirectional"),
        "/var/log/flexhub": ("/var/log/flexhub", "Bidirectional"),
    }
    assert found["/etc/flexhub-node-config"]["readOnly"] is True


def test_the_node_plugin_follows_kubelets_directory_and_its_port(helm: Path) -> None:
    pod = node_pod(render(helm, CSI, "csi.kubeletDir=/data/kubelet", "csi.node.healthPort=9999",
                          "csi.hostDirs={/srv/flexhub}"))  # fmt: skip
    args = container(pod, "flexhub")["args"]
    plugin = f"/data/kubelet/plugins/{DRIVER}"
    assert args[args.index("--kubelet-endpoint") + 1] == f"{plugin}/csi.sock"
    assert args[args.index("--health-port") + 1] == "9999"
    found = mounts(pod, "flexhub")
    assert found["/csi"]["volume"]["hostPath"]["path"] == plugin
    assert found["/registration"]["volume"]["hostPath"]["path"] == "/data/kubelet/plugins_registry"
    assert found["/data/kubelet"]["mountPropagation"] == "Bidirectional"
    assert "/var/lib/kubelet" not in found and "/var/lib/flexhub" not in found
    assert found["/srv/flexhub"]["volume"]["hostPath"]["path"] == "/srv/flexhub"
    assert found["/srv/flexhub"]["mountPropagation"] == "Bidirectional"


def test_the_upstream_registrar_replaces_flexhubs_own_registration(helm: Path) -> None:
    image = "mirror.example/sig-storage/csi-node-driver-registrar:v2.13.0"
    pod = node_pod(render(helm, CSI, f"csi.registrar.image={image}"))
    assert "--registration-dir" not in container(pod, "flexhub")["args"]
    assert "/registration" not in mounts(pod, "flexhub")
    registrar = container(pod, "node-driver-registrar")
    assert registrar["image"] == image
    assert registrar["args"] == [
        "--csi-address=/csi/csi.sock",
        f"--kubelet-registration-path=/var/lib/kubelet/plugins/{DRIVER}/csi.sock",
    ]
    found = mounts(pod, "node-driver-registrar")
    assert found["/csi"]["volume"]["hostPath"]["path"] == f"/var/lib/kubelet/plugins/{DRIVER}"
    assert found["/registration"]["volume"]["hostPath"]["path"] == (
        "/var/lib/kubelet/plugins_registry"
    )


def test_the_controller_runs_flexhub_with_the_pinned_sidecars_on_one_socket(helm: Path) -> None:
    docs = render(helm, CSI, "csi.controller.nodeSelector.kubernetes\\.io/hostname=node1")
    deployment = one(docs, "Deployment", "flexhub-csi-controller")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # never two on one record
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "flexhub-csi-controller"
    assert pod["nodeSelector"] == {  # pinned to the node that holds its records
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/hostname": "node1",
    }
    assert [c["name"] for c in pod["containers"]] == [
        "flexhub", "csi-provisioner", "csi-resizer", "csi-snapshotter",
    ]  # fmt: skip
    flexhub = container(pod, "flexhub")
    assert flexhub["command"][-3:] == ["-m", "flexhub", "csi"]
    assert flexhub["args"][:4] == ["--mode", "controller", "--endpoint", "unix:///csi/csi.sock"]
    lease = f"--leader-election-namespace={NS}"
    assert container(pod, "csi-provisioner")["args"] == [
        "--csi-address=/csi/csi.sock", "--extra-create-metadata",
        "--feature-gates=Topology=true", "--leader-election", lease, "--timeout=60s",
    ]  # fmt: skip
    for name in ("csi-resizer", "csi-snapshotter"):
        assert container(pod, name)["args"] == [
            "--csi-address=/csi/csi.sock",
            "--leader-election",
            lease,
        ], name
    for name, (module, version) in SIDECARS.items():
        assert container(pod, name)["image"].endswith(f"/{name}:{version}"), (name, module)
    # one socket directory, shared by all four and by nobody else
    socket = {n: mounts(pod, n)["/csi"]["volume"] for n in [c["name"] for c in pod["containers"]]}
    assert all(v == {"name": "socket-dir", "emptyDir": {}} for v in socket.values()), socket
    # its volume records on its host: <state_dir>/csi/volumes under the node config's state_dir
    state = mounts(pod, "flexhub")["/var/lib/flexhub"]["volume"]["hostPath"]
    assert state == {"path": "/var/lib/flexhub", "type": "DirectoryOrCreate"}
    # one pid space with the node's other writers of that state (pid-named temporaries)
    assert pod["hostPID"] is True
    # the API token is projected, read-only, into each container that calls the API: the
    # sidecars and flexhub (the records of converted volumes, in the release's namespace;
    # privileged with hostPID, flexhub could read the sidecars' token anyway)
    assert pod["automountServiceAccountToken"] is False
    token = "/var/run/secrets/kubernetes.io/serviceaccount"
    for name in ("flexhub", "csi-provisioner", "csi-resizer", "csi-snapshotter"):
        assert mounts(pod, name)[token]["readOnly"] is True, name
        projected = mounts(pod, name)[token]["volume"]["projected"]["sources"]
        assert projected[0]["serviceAccountToken"]["path"] == "token", name
    args = flexhub["args"]
    assert args[args.index("--namespace") + 1] == NS
    text = one(docs, "ConfigMap", "flexhub-node-config")["data"]["flexhub.toml"]
    assert 'state_dir = "/var/lib/flexhub"' in text


def test_csi_storage_and_snapshot_classes_render_from_values(helm: Path) -> None:
    docs = render(
        helm, CSI, "csi.snapshotClasses=true",
        "csi.storageClasses[0].name=csi-loopfile",
        "csi.storageClasses[0].volumeBindingMode=WaitForFirstConsumer",
        "csi.storageClasses[0].parameters.backend=loopfile",
        "csi.storageClasses[0].parameters.maxSize=10Gi",
        "csi.storageClasses[1].name=csi-nfs",
        "csi.storageClasses[1].allowVolumeExpansion=false",
        "csi.storageClasses[1].reclaimPolicy=Retain",
        "csi.storageClasses[1].default=true",
        "csi.storageClasses[1].parameters.backend=nfs",
    )  # fmt: skip
    loop = one(docs, "StorageClass", "csi-loopfile")
    assert loop["provisioner"] == DRIVER
    assert loop["parameters"] == {"backend": "loopfile", "maxSize": "10Gi"}
    assert (loop["reclaimPolicy"], loop["volumeBindingMode"]) == ("Delete", "WaitForFirstConsumer")
    assert loop["allowVolumeExpansion"] is True  # CSI mode expands online by default
    nfs = one(docs, "StorageClass", "csi-nfs")
    assert nfs["allowVolumeExpansion"] is False and nfs["reclaimPolicy"] == "Retain"
    assert nfs["metadata"]["annotations"] == {"storageclass.kubernetes.io/is-default-class": "true"}
    snapshots = one(docs, "VolumeSnapshotClass", "flexhub-loopfile")
    assert snapshots["apiVersion"] == "snapshot.storage.k8s.io/v1"
    assert (snapshots["driver"], snapshots["deletionPolicy"]) == (DRIVER, "Delete")
    assert "VolumeSnapshotClass" not in {d["kind"] for d in render(helm, CSI)}  # the CRD's


# -- RBAC ---------------------------------------------------------------------------------------


def grants(docs: list[dict[str, Any]], account: str) -> set[tuple[str, str, str, str | None]]:
    """(group, resource, verb, namespace or None) the chart's bindings give ``account``."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs}
    found = set()
    for binding in docs:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        if {"kind": "ServiceAccount", "name": account, "namespace": NS} not in binding["subjects"]:
            continue
        where = binding["metadata"].get("namespace")
        ref = binding["roleRef"]
        role = roles[(ref["kind"], where if ref["kind"] == "Role" else None, ref["name"])]
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        found.add((group, resource, verb, where))
    return found


def by_role(docs: list[dict[str, Any]], name: str) -> set[tuple[str, str, str]]:
    role = one(docs, "ClusterRole", name)
    return {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def test_the_node_plugin_account_may_write_events_and_nothing_else(helm: Path) -> None:
    """Its health watcher's Events on pods (any namespace: a pod's Event is in the pod's):
    exactly create and patch on events; with csi.node.healthEventInterval=0 no right at
    all, and its pods mount no token."""
    docs = render(helm, CSI)
    assert grants(docs, "flexhub-csi-node") == {
        ("", "events", "create", None),
        ("", "events", "patch", None),
    }
    account = one(docs, "ServiceAccount", "flexhub-csi-node")
    assert account["automountServiceAccountToken"] is False  # only the DaemonSet's pods
    off = render(helm, CSI, "csi.node.healthEventInterval=0")
    assert grants(off, "flexhub-csi-node") == set()
    pod = node_pod(off)
    assert pod["automountServiceAccountToken"] is False
    args = container(pod, "flexhub")["args"]
    assert args[args.index("--health-interval") + 1] == "0"
    assert not [d for d in off if d["metadata"]["name"] == "flexhub-csi-node-events"]


def test_the_controllers_rbac_is_what_its_sidecars_use(helm: Path) -> None:
    docs = render(helm, CSI)
    get_list_watch = ("get", "list", "watch")
    events = {("", "events", v) for v in ("create", "patch")}
    assert by_role(docs, "flexhub-csi-controller-provisioner") == events | {
        *(("", "persistentvolumes", v) for v in (*get_list_watch, "create", "patch", "delete")),
        *(("", "persistentvolumeclaims", v) for v in (*get_list_watch, "update")),
        *(("storage.k8s.io", "storageclasses", v) for v in get_list_watch),
        *(
            ("snapshot.storage.k8s.io", r, v)
            for r in ("volumesnapshots", "volumesnapshotcontents")
            for v in ("get", "list")
        ),
        *(("storage.k8s.io", "csinodes", v) for v in get_list_watch),  # Topology=true
        *(("", "nodes", v) for v in get_list_watch),
    }
    assert by_role(docs, "flexhub-csi-controller-resizer") == events | {
        *(("", "persistentvolumes", v) for v in (*get_list_watch, "patch")),
        *(("", "persistentvolumeclaims", v) for v in get_list_watch),
        ("", "persistentvolumeclaims/status", "patch"),
        *(("", "pods", v) for v in get_list_watch),
    }
    assert by_role(docs, "flexhub-csi-controller-snapshotter") == events | {
        *(("snapshot.storage.k8s.io", "volumesnapshotclasses", v) for v in get_list_watch),
        *(
            ("snapshot.storage.k8s.io", "volumesnapshotcontents", v)
            for v in (*get_list_watch, "update", "patch")
        ),
        *(
            ("snapshot.storage.k8s.io", "volumesnapshotcontents/status", v)
            for v in ("update", "patch")
        ),
    }
    granted = grants(docs, "flexhub-csi-controller")
    # no Secret, no VolumeAttachment, no CSIStorageCapacity, no group snapshot: none is used
    assert not {(g, r) for g, r, _, _ in granted} & {
        ("", "secrets"),
        ("storage.k8s.io", "volumeattachments"),
        ("storage.k8s.io", "csistoragecapacities"),
        ("storage.k8s.io", "volumeattributesclasses"),
        ("groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents"),
    }
    # the Leases only in the release's namespace, get/update only the sidecars' three
    assert {(r, v, w) for _, r, v, w in granted if r == "leases"} == {
        ("leases", v, NS) for v in ("create", "get", "update")
    }
    role = one(docs, "Role", "flexhub-csi-controller-leader-election")
    (named,) = [r for r in role["rules"] if r.get("resourceNames")]
    assert sorted(named["resourceNames"]) == [
        "external-resizer-flexhub-csi-k8s-io",
        "external-snapshotter-leader-flexhub-csi-k8s-io",
        "flexhub-csi-k8s-io",
    ]
    # a class naming a provisioner secret needs it read: asked for, get only
    secret = grants(render(helm, CSI, "csi.controller.provisionerSecrets=true"),
                    "flexhub-csi-controller") - granted  # fmt: skip
    assert secret == {("", "secrets", "get", None)}


RULE = re.compile(
    r"apiGroups:\s*\[([^\]]*)\]\s*\n[#\s]*resources:\s*\[([^\]]*)\]\s*\n[#\s]*verbs:\s*\[([^\]]*)\]"
)


def _items(flow: str) -> list[str]:
    return [item.strip().strip("\"'") for item in flow.split(",")]


def upstream_rules(sidecar: str, tmp: Path) -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every rule, commented ones included (upstream marks the
    optional rules so), of the sidecar's rbac.yaml at its pinned release."""
    module, version = SIDECARS[sidecar]
    proc = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"],
        cwd=tmp,
        env={**os.environ, "GOFLAGS": "-mod=mod", "GO111MODULE": "on"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    text = (Path(json.loads(proc.stdout)["Dir"]) / UPSTREAM_RBAC[sidecar]).read_text()
    found = set()
    # every rule, commented or not (upstream comments out its optional ones: "# - apiGroups")
    for groups, resources, verbs in RULE.findall(text):
        for group in _items(groups):
            for resource in _items(resources):
                for verb in _items(verbs):
                    found.add((group, resource, verb))
    return found


def test_every_controller_rule_is_one_its_sidecars_upstream_rbac_grants(
    helm: Path, tmp_path: Path
) -> None:
    """Our YAML, upstream's rules: each ClusterRole of the chart is within its sidecar's
    deploy/kubernetes RBAC at the pinned release (read from the Go module), and the
    leader-election Role within all three's."""
    if shutil.which("go") is None:
        if on_ci():
            pytest.fail("CI must check the chart's CSI RBAC against upstream, but go is missing")
        pytest.skip("needs go (go mod download of the sidecars' modules)")
    docs = render(helm, CSI, "csi.controller.provisionerSecrets=true")
    leases = set()
    for sidecar in SIDECARS:
        upstream = upstream_rules(sidecar, tmp_path)
        assert len(upstream) > 10, sidecar  # the file was read
        role = f"flexhub-csi-controller-{sidecar.removeprefix('csi-')}"
        assert by_role(docs, role) - upstream == set(), role
        leases.add(frozenset(v for g, r, v in upstream if r == "leases"))
    role = one(docs, "Role", "flexhub-csi-controller-leader-election")
    ours = {v for rule in role["rules"] for v in rule["verbs"]}
    assert all(ours <= set(theirs) for theirs in leases)


# -- the schema ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("csi.enabled=yes", "at '/csi/enabled': got string, want boolean"),
        ("flexvolume.enabled=1", "at '/flexvolume/enabled': got number, want boolean"),
        ("csi.kubeletDir=var/lib/kubelet", "at '/csi/kubeletDir'"),
        ("csi.kubeletDir=/var/lib/kubelet/", "at '/csi/kubeletDir'"),
        ("csi.kubeletDir=/", "at '/csi/kubeletDir'"),
        ("csi.kubeletDir=//", "at '/csi/kubeletDir'"),
        ("csi.node.healthPort=0", "at '/csi/node/healthPort'"),
        ("csi.node.healthPort=70000", "at '/csi/node/healthPort'"),
        ("csi.hostDirs={relative}", "at '/csi/hostDirs/0'"),
        ("csi.controller.stateDir=state", "at '/csi/controller/stateDir'"),
        ("csi.sidecars.provisioner.image=", "at '/csi/sidecars/provisioner/image'"),
        ("csi.sidecars.attacher.image=x", "additional properties 'attacher' not allowed"),
        ("csi.logLevel=loud", "at '/csi/logLevel'"),
        ("csi.storageClasses[0].reclaimPolicy=Recycle", "at '/csi/storageClasses/0'"),
        ("csi.storageClasses[0].provisioner=other", "additional properties 'provisioner'"),
        ("csi.registrar.image=a b", "at '/csi/registrar/image'"),
        ("csi.snapshotClass=true", "additional properties 'snapshotClass' not allowed"),
    ],
)
def test_the_schema_refuses_what_csi_mode_cannot_take(helm: Path, value: str, words: str) -> None:
    proc = template(helm, CSI, value)
    assert proc.returncode != 0, value
    assert words in proc.stderr, proc.stderr


# -- NOTES.txt ----------------------------------------------------------------------------------


def test_the_notes_say_which_modes_were_installed(helm: Path, tmp_path: Path) -> None:
    from tests.deploy.test_chart import notes

    flex = notes(helm, tmp_path / "flex")
    assert "k8s~flexhub/flexhub" in flex and "CSI" not in flex
    csi = notes(helm, tmp_path / "csi", CSI, NO_FLEX, "csi.storageClasses[0].name=c",
                "csi.storageClasses[0].parameters.backend=loopfile")  # fmt: skip
    installed = csi.split("Installed:")[1].split("\n\n")[0]
    assert "k8s~flexhub/flexhub" not in installed and "flexhub doctor" not in csi
    assert f"CSIDriver {DRIVER}" in installed
    assert "registered with kubelet by flexhub itself" in installed
    assert "CSI StorageClasses: c (loopfile)" in installed
    assert "kubectl get csinode" in csi
    # the controller's records on its host: a warning until it is pinned to one node
    assert "WARNING: the CSI controller keeps its volume records" in csi
    pinned = notes(helm, tmp_path / "pinned", CSI,
                   "csi.controller.nodeSelector.kubernetes\\.io/hostname=n1",
                   "csi.registrar.image=r:1", "csi.snapshotClasses=true")  # fmt: skip
    assert "WARNING: the CSI controller" not in pinned
    assert "k8s~flexhub/flexhub" in pinned  # both modes
    assert "registered with kubelet by node-driver-registrar" in pinned
    assert "VolumeSnapshotClass flexhub-loopfile" in pinned


def test_both_csi_pods_run_the_csi_image_when_one_is_given(helm: Path) -> None:
    """The default image has no grpcio: csi.image names one that does, for both CSI pods
    (and never for the FlexVolume DaemonSet)."""
    import flexhub

    docs = render(helm, CSI)
    assert container(node_pod(docs), "flexhub")["image"] == f"flexhub:{flexhub.__version__}"
    docs = render(helm, CSI, "csi.image.repository=registry.example/flexhub-csi",
                  "csi.image.tag=1.2.3")  # fmt: skip
    controller = one(docs, "Deployment", "flexhub-csi-controller")["spec"]["template"]["spec"]
    for pod in (node_pod(docs), controller):
        assert container(pod, "flexhub")["image"] == "registry.example/flexhub-csi:1.2.3"
    flex = one(docs, "DaemonSet", "flexhub")["spec"]["template"]["spec"]
    assert container(flex, "flexhub")["image"] == f"flexhub:{flexhub.__version__}"
