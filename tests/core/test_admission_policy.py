"""deploy/admission-policy.yaml, evaluated for real with a CEL interpreter, and its twins in
flexhub: ``flexhub validate`` and the pod.uid check of ``mount``.

kubelet merges a volume's options last, over its own ``kubernetes.io/*`` keys. The policy
rejects flexhub volumes whose options set one; ``flexhub validate`` reports the same volumes.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml

from flexhub.admin.harness import Kubelet, go_json
from flexhub.admin.manifest import validate_file
from tests.conftest import REPO, needs_root, run_flexhub

POLICY_FILE = REPO / "deploy" / "admission-policy.yaml"
DRIVER = "k8s/flexhub"
LOOPFILE = {"backend": "loopfile", "file": "db.img", "size": "1Gi"}


def _documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(POLICY_FILE.read_text("utf-8")) if d]


def _policies() -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d for d in _documents() if d["kind"] == "ValidatingAdmissionPolicy"
    }


class Policy:
    """One ValidatingAdmissionPolicy, evaluated as the API server does: variables in order,
    then every validation; the object is admitted when all are true."""

    def __init__(self, spec: Mapping[str, Any], variables: Mapping[str, str] | None = None):
        self.env = celpy.Environment()
        overrides = variables or {}
        self.variables = [
            (v["name"], self._compile(overrides.get(v["name"], v["expression"])))
            for v in spec.get("variables", [])
        ]
        self.validations = [self._compile(v["expression"]) for v in spec["validations"]]

    def _compile(self, expression: str) -> Any:
        return self.env.program(self.env.compile(expression))

    def admits(self, obj: Mapping[str, Any]) -> bool:
        activation: dict[str, Any] = {"object": celpy.json_to_cel(obj)}
        values: dict[str, Any] = {}
        for name, program in self.variables:
            activation["variables"] = celpy.json_to_cel(values)
            values[name] = _plain(program.evaluate(activation))
        activation["variables"] = celpy.json_to_cel(values)
        results = [program.evaluate(activation) for program in self.validations]
        for result in results:
            assert isinstance(result, celpy.celtypes.BoolType), result  # never an eval error
        return all(results)


def _plain(value: Any) -> Any:
    if isinstance(value, celpy.celtypes.ListType):
        return [_plain(v) for v in value]
    if isinstance(value, celpy.celtypes.MapType):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, celpy.celtypes.StringType):
        return str(value)
    return value


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

#: (name, object, admitted by the kubelet-key policies)
CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("pv without flexVolume", {**pv(), "spec": {"nfs": {"server": "s", "path": "/x"}}}, True),
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
    ("pod with many volumes", pod(*MANY, flex("v", LOOPFILE), *MANY), True),
    (
        "pod with many volumes, the last one bad",
        pod(
            *MANY, flex("v", LOOPFILE), flex("w", {**LOOPFILE, "kubernetes.io/pod.namespace": "x"})
        ),
        False,
    ),
]


def _kubelet_key_policy(obj: Mapping[str, Any]) -> Policy:
    name = "flexhub-persistentvolumes" if obj["kind"] == "PersistentVolume" else "flexhub-pods"
    return Policy(_policies()[name]["spec"])


def test_manifest_parses_with_a_binding_per_policy() -> None:
    docs = _documents()
    policies = _policies()
    assert set(policies) == {"flexhub-persistentvolumes", "flexhub-pods", "flexhub-inline-volumes"}
    bindings = {
        d["spec"]["policyName"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
    }
    assert set(bindings) == set(policies)
    for name, policy in policies.items():
        assert policy["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert policy["spec"]["failurePolicy"] == "Fail"
        assert bindings[name]["spec"]["validationActions"] == ["Deny"]
        rules = policy["spec"]["matchConstraints"]["resourceRules"]
        assert all({"CREATE", "UPDATE"} <= set(r["operations"]) for r in rules)
        for validation in policy["spec"]["validations"]:
            assert validation["message"] and validation["reason"] == "Forbidden"
    selector = bindings["flexhub-inline-volumes"]["spec"]["matchResources"]["namespaceSelector"]
    assert selector["matchExpressions"] == [
        {"key": "flexhub/inline-volumes", "operator": "NotIn", "values": ["allowed"]}
    ]


@pytest.mark.parametrize(("name", "obj", "admitted"), CASES, ids=[c[0] for c in CASES])
def test_kubelet_key_policies_select_exactly_the_volumes_that_set_kubelet_keys(
    name: str, obj: dict[str, Any], admitted: bool
) -> None:
    assert _kubelet_key_policy(obj).admits(obj) is admitted


@pytest.mark.parametrize(("name", "obj", "admitted"), CASES, ids=[c[0] for c in CASES])
def test_flexhub_validate_reports_the_same_volumes(
    name: str, obj: dict[str, Any], admitted: bool, tmp_path: Path
) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(obj))
    results = validate_file(manifest, DRIVER)
    kubelet_key_errors = [e for _, e in results if "must not set kubernetes.io/ keys" in e]
    assert (not kubelet_key_errors) is admitted, results


def test_flexhub_validate_command_fails_on_a_kubelet_key(tmp_path: Path) -> None:
    manifest = tmp_path / "m.yaml"
    bad = pod(flex("data", {**LOOPFILE, "kubernetes.io/pod.namespace": "kube-system"}))
    manifest.write_text(yaml.safe_dump_all([pv(LOOPFILE), bad]))
    proc = subprocess.run(
        [sys.executable, "-m", "flexhub", "validate", str(manifest)],
        capture_output=True,
        text=True,
        # the session's throw-away node config: stevedore's cache goes to its state_dir
        env={"PATH": "/usr/bin:/bin", "FLEXHUB_CONFIG": os.environ["FLEXHUB_CONFIG"]},
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        "PersistentVolume/pv-db: ok (size 1 GiB)",
        'Pod/p volume data: spec.volumes[0].flexVolume.options["kubernetes.io/pod.namespace"]: '
        "kubelet's key: a volume's options must not set kubernetes.io/ keys (kubelet merges the "
        "options last, over its own)",
    ]


NFS = {"backend": "nfs", "server": "s", "share": "/x"}
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


@pytest.mark.parametrize(
    ("name", "obj", "by_default", "nfs_allowed"),
    INLINE_CASES,
    ids=[c[0] for c in INLINE_CASES],
)
def test_inline_volume_policy_admits_only_the_allowed_backends(
    name: str, obj: dict[str, Any], by_default: bool, nfs_allowed: bool
) -> None:
    spec = _policies()["flexhub-inline-volumes"]["spec"]
    assert [v["name"] for v in spec["variables"]] == ["driver", "allowedBackends"]
    assert Policy(spec).admits(obj) is by_default  # no backend: no inline flexhub volume
    only_nfs = Policy(spec, {"allowedBackends": "['nfs']"})
    assert only_nfs.admits(obj) is nfs_allowed


def test_a_bad_pod_is_rejected_even_among_other_volumes() -> None:
    bad = pod(*MANY, flex("v", {**LOOPFILE, "kubernetes.io/pod.uid": "u"}))
    fixed = copy.deepcopy(bad)
    del fixed["spec"]["volumes"][-1]["flexVolume"]["options"]["kubernetes.io/pod.uid"]
    policy = Policy(_policies()["flexhub-pods"]["spec"])
    assert not policy.admits(bad)
    assert policy.admits(fixed)


# -- mount: a pod.uid that contradicts the pod directory ---------------------------------------


@needs_root
def test_a_pod_uid_that_contradicts_the_pod_directory_is_a_failure(
    tmp_path: Path, node_tree: dict[str, Path]
) -> None:
    uid = "0b7c1f3e-2d4a-4e7b-9a51-3c2d1e0f9a8b"
    target = tmp_path / "any-root" / "pods" / uid / "volumes" / "k8s~flexhub" / "pv-1"
    target.mkdir(parents=True)
    user = {"backend": "echo", "tag": "t1"}
    lying = go_json(
        Kubelet.mount_options(
            {**user, "kubernetes.io/pod.uid": "other-pod"}, pv="pv-1", pod_uid=uid
        )
    )
    try:
        reply = run_flexhub(["mount", str(target), lying], node_tree["config"])
        assert reply.status == "Failure"
        assert reply.message == (
            f"kubernetes.io/pod.uid 'other-pod' contradicts the pod directory (pod {uid!r}): "
            "a volume's options must not set kubernetes.io/ keys"
        )
        assert not os.path.ismount(target)
        assert not (node_tree["state"] / "pods").exists()
        honest = go_json(Kubelet.mount_options(user, pv="pv-1", pod_uid=uid))
        assert run_flexhub(["mount", str(target), honest], node_tree["config"]).ok
        assert os.path.ismount(target)
        assert run_flexhub(["unmount", str(target)], node_tree["config"]).ok
        assert not os.path.ismount(target)
    finally:
        while os.path.ismount(target):
            subprocess.run(["umount", str(target)], check=True)
