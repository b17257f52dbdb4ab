"""deploy/admission-policy.yaml's shape, and its twins in flexhub: ``flexhub validate`` and the
pod.uid check of ``mount``. The policies themselves are evaluated by a real API server in
tests/cluster/test_admission.py, over the same cases (tests/admission_cases.py).

kubelet merges a volume's options last, over its own ``kubernetes.io/*`` keys. The policy
rejects flexhub volumes whose options set one; ``flexhub validate`` reports the same volumes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from flexhub.admin.harness import Kubelet, go_json
from flexhub.admin.manifest import validate_file
from tests.admission_cases import CASES, DRIVER, LOOPFILE, POLICY_FILE, flex, pod, pv
from tests.conftest import needs_root, run_flexhub


def _documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(POLICY_FILE.read_text("utf-8")) if d]


def _policies() -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d for d in _documents() if d["kind"] == "ValidatingAdmissionPolicy"
    }


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
