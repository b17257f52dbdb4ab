"""The Helm chart (deploy/helm/flexhub) renders with the pinned helm, carries every value an
operator sets to where it belongs, agrees on one version with flexhub, and is the source of
the plain manifest (which therefore cannot drift from it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import flexhub
from flexhub.config import load_config
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "deploy"))
import render_manifest  # type: ignore[import-not-found]

CHART = render_manifest.CHART


@pytest.fixture(scope="module")
def helm() -> Iterator[Path]:
    """The pinned helm (built from its Go module once per machine: several minutes cold)."""
    if shutil.which("go") is None and not render_manifest.helm_binary(build=False).is_file():
        pytest.skip("helm is built with Go, which is not installed (.ci/install-system.sh)")
    yield render_manifest.helm_binary()


def render(helm: Path, *values: str) -> dict[str, dict[str, Any]]:
    docs = yaml.safe_load_all(render_manifest.render(helm, *values))
    return {doc["kind"]: doc for doc in docs if doc}


def pod_of(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = docs["DaemonSet"]["spec"]["template"]["spec"]
    return spec


def test_the_chart_lints(helm: Path) -> None:
    proc = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_defaults_reach_every_linux_amd64_node_with_the_node_config(helm: Path) -> None:
    docs = render(helm)
    assert sorted(docs) == ["ConfigMap", "DaemonSet", "ServiceAccount"]  # namespace: Helm's
    pod = pod_of(docs)
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
    assert {"operator": "Exists"} in pod["tolerations"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["hostPID"] is True and pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert container["image"] == f"flexhub:{flexhub.__version__}"
    assert container["imagePullPolicy"] == "IfNotPresent"
    args = container["args"]
    assert args[args.index("--config-from") + 1] == "/etc/flexhub-node-config/flexhub.toml"
    assert args[args.index("--config") + 1] == "/etc/flexhub/flexhub.toml"
    assert "--plugin-dir" not in args  # detected on each node
    host = next(m for m in container["volumeMounts"] if m["name"] == "host")
    assert host == {"name": "host", "mountPath": "/host", "mountPropagation": "HostToContainer"}
    config = next(m for m in container["volumeMounts"] if m["name"] == "node-config")
    assert config["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == "node-config")
    assert volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    text = docs["ConfigMap"]["data"]["flexhub.toml"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert text == values["nodeConfig"]


def test_the_default_node_config_is_one_flexhub_accepts(helm: Path, tmp_path: Path) -> None:
    text = render(helm)["ConfigMap"]["data"]["flexhub.toml"]
    (tmp_path / "flexhub.toml").write_text(text)
    config = load_config(tmp_path / "flexhub.toml")
    assert str(config.state_dir) == "/var/lib/flexhub"
    assert config.backend_table("loopfile")["root"] == "/var/lib/flexhub/loopfiles"


def test_every_operator_value_lands_where_it_belongs(helm: Path) -> None:
    docs = render(
        helm,
        "pluginDir=/var/lib/kubelet/volumeplugins",
        "image.repository=registry.example/flexhub",
        "image.tag=9.9.9",
        "image.pullPolicy=Always",
        "nodeSelector.pool=storage",
        "tolerations[0].key=dedicated",
        "tolerations[0].operator=Equal",
        "tolerations[0].value=storage",
        "resources.limits.memory=512Mi",
        "priorityClassName=storage-critical",
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].key=zone",
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
        "serviceAccount.create=false",
        "serviceAccount.name=storage-nodes",
        "hostConfigPath=/etc/storage/flexhub.toml",
        "runtimeDir=/opt/flexhub-runtimes",
        'nodeConfig=log_level = "debug"',
    )
    assert "ServiceAccount" not in docs
    pod = pod_of(docs)
    assert pod["serviceAccountName"] == "storage-nodes"
    assert pod["nodeSelector"]["pool"] == "storage"
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "storage"}]
    assert pod["priorityClassName"] == "storage-critical"
    assert "nodeAffinity" in pod["affinity"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.example/flexhub:9.9.9"
    assert container["imagePullPolicy"] == "Always"
    assert container["resources"]["limits"]["memory"] == "512Mi"
    args = container["args"]
    assert args[args.index("--plugin-dir") + 1] == "/var/lib/kubelet/volumeplugins"
    assert args[args.index("--config") + 1] == "/etc/storage/flexhub.toml"
    assert args[args.index("--runtime-dir") + 1] == "/opt/flexhub-runtimes"
    probe = container["livenessProbe"]["exec"]["command"]
    assert probe[probe.index("--config") + 1] == "/etc/storage/flexhub.toml"
    assert docs["ConfigMap"]["data"]["flexhub.toml"].strip() == 'log_level = "debug"'


def test_a_changed_node_config_rolls_the_daemonset(helm: Path) -> None:
    def checksum(*values: str) -> str:
        annotations = render(helm, *values)["DaemonSet"]["spec"]["template"]["metadata"]
        return str(annotations["annotations"]["checksum/node-config"])

    assert checksum() != checksum('nodeConfig=log_level = "debug"')


def test_the_namespace_is_created_labelled_for_privileged_pods_when_asked(helm: Path) -> None:
    docs = render(helm, "namespace.create=true")
    namespace = docs["Namespace"]["metadata"]
    assert namespace["name"] == render_manifest.NAMESPACE
    assert namespace["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_the_daemonset_selector_is_the_one_shipped_before(helm: Path) -> None:
    """A selector is immutable: an older plain manifest's DaemonSet must upgrade in place."""
    selector = render(helm)["DaemonSet"]["spec"]["selector"]
    assert selector == {"matchLabels": {"app.kubernetes.io/name": "flexhub"}}


def test_chart_app_and_flexhub_agree_on_one_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == flexhub.__version__


def test_the_plain_manifest_is_the_chart_rendered(helm: Path) -> None:
    """deploy/kubernetes/flexhub.yaml is generated; an edit of either alone fails here."""
    assert render_manifest.main(["--check", "--helm", str(helm)]) == 0, (
        "run python3 deploy/render_manifest.py"
    )
    docs = list(yaml.safe_load_all(render_manifest.MANIFEST.read_text()))
    assert [d["kind"] for d in docs] == ["Namespace", "ServiceAccount", "ConfigMap", "DaemonSet"]


def render_list(helm: Path, *values: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(render_manifest.render(helm, *values)) if doc]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def rules(role: dict[str, Any]) -> set[tuple[str, str, tuple[str, ...]]]:
    """``(apiGroup, resource, sorted verbs)`` of every rule of ``role``."""
    return {
        (group, resource, tuple(sorted(rule["verbs"])))
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }


PROVISIONING_KINDS = {
    "Deployment",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "StorageClass",
}


def test_defaults_render_no_provisioner_node_agent_or_storage_class(helm: Path) -> None:
    docs = render_list(helm)
    assert not {d["kind"] for d in docs} & PROVISIONING_KINDS
    (container,) = pod_of(render(helm))["containers"]
    assert "--node-agent" not in container["args"] and "env" not in container


def test_the_provisioner_gets_a_deployment_and_exactly_the_rbac_it_calls(helm: Path) -> None:
    docs = render_list(helm, "provisioner.enabled=true", "provisioner.logLevel=debug")
    ns = render_manifest.NAMESPACE
    deployment = one(docs, "Deployment", "flexhub-provisioner")
    assert deployment["apiVersion"] == "apps/v1" and deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    # never selected by the DaemonSet's selector (app.kubernetes.io/name: flexhub)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "flexhub-provisioner"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pod["serviceAccountName"] == "flexhub-provisioner"
    assert pod["automountServiceAccountToken"] is True
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
    (container,) = pod["containers"]
    assert container["image"] == f"flexhub:{flexhub.__version__}"  # the DaemonSet's
    assert container["command"][-3:] == ["-m", "flexhub", "provisioner"]
    assert container["args"] == [
        "--config",
        "/etc/flexhub-node-config/flexhub.toml",
        "--leader-elect",
        "--lease-namespace",
        ns,
        "--log-level",
        "debug",
    ]
    assert container["securityContext"] == {"privileged": True}  # nfs/cifs mounts
    assert container["volumeMounts"] == [
        {"name": "node-config", "mountPath": "/etc/flexhub-node-config", "readOnly": True}
    ]
    (volume,) = pod["volumes"]
    assert volume["configMap"]["name"] == "flexhub-node-config"
    account = one(docs, "ServiceAccount", "flexhub-provisioner")
    assert account["metadata"]["namespace"] == ns
    cluster_role = one(docs, "ClusterRole", "flexhub-provisioner")
    assert cluster_role["apiVersion"] == "rbac.authorization.k8s.io/v1"
    assert rules(cluster_role) == {
        ("", "persistentvolumes", ("create", "delete", "get", "list", "patch", "watch")),
        ("", "persistentvolumeclaims", ("get", "list", "patch", "watch")),
        ("storage.k8s.io", "storageclasses", ("get",)),
        ("", "nodes", ("get",)),
        ("", "secrets", ("get",)),
        ("", "events", ("create", "patch")),
    }
    role = one(docs, "Role", "flexhub-provisioner")
    assert role["metadata"]["namespace"] == ns
    assert [(r["resources"], r.get("resourceNames"), r["verbs"]) for r in role["rules"]] == [
        (["leases"], None, ["create"]),
        (["leases"], ["flexhub-provisioner"], ["get", "update"]),  # the election's Lease
        (["secrets"], None, ["create"]),
        (["secrets"], ["flexhub-provisioner-key"], ["get"]),  # its signing key
    ]
    subject = [{"kind": "ServiceAccount", "name": "flexhub-provisioner", "namespace": ns}]
    for kind, ref in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        binding = one(docs, kind, "flexhub-provisioner")
        assert binding["subjects"] == subject
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": ref,
            "name": "flexhub-provisioner",
        }


def test_the_provisioners_own_values_land_where_they_belong(helm: Path) -> None:
    docs = render_list(
        helm,
        "provisioner.enabled=true",
        "provisioner.replicas=3",
        "provisioner.image.repository=registry.example/flexhub-mount",
        "provisioner.image.tag=1.2",
        "provisioner.resources.limits.memory=1Gi",
        "provisioner.nodeSelector.pool=control",
        "provisioner.tolerations[0].operator=Exists",
        "provisioner.priorityClassName=system-cluster-critical",
        "provisioner.serviceAccount.create=false",
        "provisioner.serviceAccount.name=prov",
        "nodeConfig=",
    )
    deployment = one(docs, "Deployment", "flexhub-provisioner")
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "prov"
    assert not [
        d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "prov"
    ]
    assert one(docs, "ClusterRoleBinding", "flexhub-provisioner")["subjects"][0]["name"] == "prov"
    assert pod["nodeSelector"]["pool"] == "control"
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert pod["priorityClassName"] == "system-cluster-critical"
    (container,) = pod["containers"]
    assert container["image"] == "registry.example/flexhub-mount:1.2"
    assert container["resources"]["limits"]["memory"] == "1Gi"
    # no node config: no --config, nothing mounted
    assert "--config" not in container["args"] and "volumeMounts" not in container


LOOPFILE_CLASS = ("storageClasses[0].name=local", "storageClasses[0].parameters.backend=loopfile")
NFS_CLASS = (
    "storageClasses[1].name=team",
    "storageClasses[1].parameters.backend=nfs",
    "storageClasses[1].parameters.server=nfs1.example.com",
)


WITH_AGENT = [
    "ClusterRole//flexhub-node-agent",
    "ClusterRoleBinding//flexhub-node-agent",
    "Role/default/flexhub-node-agent-events",
    "RoleBinding/default/flexhub-node-agent-events",
    "ValidatingAdmissionPolicy//flexhub-node-agent",
    "ValidatingAdmissionPolicyBinding//flexhub-node-agent",
    "token",
    "--node-agent",
    "NODE_NAME",
]


def node_agent_objects(docs: list[dict[str, Any]]) -> list[str]:
    """What of the node agent a rendering holds: its RBAC objects, and in the DaemonSet its
    token (mounted), its flag and its node name."""
    found = [
        f"{d['kind']}/{d['metadata'].get('namespace', '')}/{d['metadata']['name']}"
        for d in docs
        if d["metadata"]["name"].startswith("flexhub-node-agent")
    ]
    pod = one(docs, "DaemonSet", "flexhub")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    if pod["automountServiceAccountToken"]:
        found.append("token")
    if "--node-agent" in container["args"]:
        found.append("--node-agent")
    if "env" in container:
        found.append("NODE_NAME")
    return found


def test_the_node_agent_runs_in_the_daemonset_with_its_own_roles(helm: Path) -> None:
    for values in (("nodeAgent.enabled=true",), LOOPFILE_CLASS):
        docs = render_list(helm, *values)
        assert node_agent_objects(docs) == WITH_AGENT, values
        (container,) = one(docs, "DaemonSet", "flexhub")["spec"]["template"]["spec"]["containers"]
        assert container["args"][-1] == "--node-agent"
        assert container["env"] == [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
        ]
        role = one(docs, "ClusterRole", "flexhub-node-agent")
        # no update (it patches), no nodes, and no Events anywhere but below
        assert rules(role) == {
            ("", "persistentvolumes", ("delete", "get", "list", "patch", "watch")),
        }
        events = one(docs, "Role", "flexhub-node-agent-events")
        # a PV's Events live in `default` (flexhub/provisioner/events.py): only there
        assert events["metadata"]["namespace"] == "default"
        assert rules(events) == {("", "events", ("create",))}
        subjects = [
            {"kind": "ServiceAccount", "name": "flexhub", "namespace": render_manifest.NAMESPACE}
        ]
        for kind, ref in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
            (binding,) = [
                d
                for d in docs
                if d["kind"] == kind and d["metadata"]["name"].startswith("flexhub-node-agent")
            ]
            assert binding["roleRef"]["kind"] == ref
            assert binding["roleRef"]["name"] == (
                "flexhub-node-agent" if ref == "ClusterRole" else "flexhub-node-agent-events"
            )
            assert binding["subjects"] == subjects


def test_auto_runs_the_node_agent_only_for_loopfile_classes(helm: Path) -> None:
    """The node agent's token may patch and delete every PV: it is on every node only when
    some class needs the nodes to reclaim (loopfile), never for nfs/cifs/iscsi alone, and
    never merely because the provisioner is on."""
    nfs_only = (
        *NFS_CLASS,
        "storageClasses[0].name=smb",
        "storageClasses[0].parameters.backend=cifs",
    )
    cases = {
        (): [],
        ("provisioner.enabled=true",): [],
        ("provisioner.enabled=true", *nfs_only): [],
        ("provisioner.enabled=true", "nodeAgent.enabled=auto", *nfs_only): [],
        ("storageClasses[0].name=bare",): [],  # no parameters at all
        ("provisioner.enabled=true", *LOOPFILE_CLASS): WITH_AGENT,
        ("provisioner.enabled=true", *LOOPFILE_CLASS, *NFS_CLASS): WITH_AGENT,
        (*NFS_CLASS, "storageClasses[0].name=l", "storageClasses[0].parameters.backend=loopfile"): (
            WITH_AGENT
        ),
        # explicit choices win over the classes
        ("provisioner.enabled=true", *LOOPFILE_CLASS, "nodeAgent.enabled=false"): [],
        ("provisioner.enabled=true", *nfs_only, "nodeAgent.enabled=true"): WITH_AGENT,
        ("nodeAgent.enabled=true",): WITH_AGENT,
    }
    for values, expected in cases.items():
        assert node_agent_objects(render_list(helm, *values)) == expected, values


def test_the_node_agents_admission_policy_binds_its_account(helm: Path) -> None:
    """The policy that keeps the agent's token to finishing reclaims matches exactly the
    DaemonSet's account (the cluster tier proves what it refuses), and can be left out."""
    for values, account in (((), "flexhub"), (("serviceAccount.name=nodes",), "nodes")):
        docs = render_list(helm, "nodeAgent.enabled=true", *values)
        policy = one(docs, "ValidatingAdmissionPolicy", "flexhub-node-agent")
        assert policy["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert policy["spec"]["failurePolicy"] == "Fail"
        (condition,) = policy["spec"]["matchConditions"]
        user = f"system:serviceaccount:{render_manifest.NAMESPACE}:{account}"
        assert condition["expression"] == f"request.userInfo.username == '{user}'"
        (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
        assert rule["operations"] == ["UPDATE", "DELETE"]
        binding = one(docs, "ValidatingAdmissionPolicyBinding", "flexhub-node-agent")
        assert binding["spec"] == {
            "policyName": "flexhub-node-agent",
            "validationActions": ["Deny"],
        }
    docs = render_list(helm, "nodeAgent.enabled=true", "nodeAgent.admissionPolicy=false")
    assert not {d["kind"] for d in docs} & {"ValidatingAdmissionPolicy"}
    assert one(docs, "ClusterRole", "flexhub-node-agent")


def template(helm: Path, version: str, *values: str) -> subprocess.CompletedProcess[str]:
    argv = [str(helm), "template", "x", str(CHART), "--kube-version", version]
    for value in values:
        argv += ["--set", value]
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def test_the_node_agents_admission_policy_is_never_dropped_silently(helm: Path) -> None:
    """Before 1.30 the cluster serves no admissionregistration.k8s.io/v1 policy: with the node
    agent on and ``nodeAgent.admissionPolicy`` not set to false, the chart refuses to render
    (one line saying what to do) rather than install the agent's token without its limits."""
    for version in ("1.29.0", "1.29.9"):
        for values in (("nodeAgent.enabled=true",), ("storageClasses[0].name=l",
                       "storageClasses[0].parameters.backend=loopfile")):  # fmt: skip
            proc = template(helm, version, *values)
            assert proc.returncode != 0, (version, values)
            (line,) = [ln for ln in proc.stderr.splitlines() if "admissionPolicy" in ln]
            assert "Kubernetes 1.30" in line and "nodeAgent.admissionPolicy=false" in line
        # the operator's explicit choice: the agent and its RBAC, no policy
        proc = template(helm, version, "nodeAgent.enabled=true", "nodeAgent.admissionPolicy=false")
        assert proc.returncode == 0, proc.stderr
        rendered = {d["kind"] for d in yaml.safe_load_all(proc.stdout) if d}
        assert "ClusterRole" in rendered and "ValidatingAdmissionPolicy" not in rendered
        # no node agent, no token to narrow: nothing to refuse
        proc = template(helm, version)
        assert proc.returncode == 0, proc.stderr
    for version in ("1.30.0", render_manifest.KUBE_VERSION):
        proc = template(helm, version, "nodeAgent.enabled=true")
        assert proc.returncode == 0, proc.stderr
        rendered = {d["kind"] for d in yaml.safe_load_all(proc.stdout) if d}
        assert {"ValidatingAdmissionPolicy", "ClusterRole"} <= rendered, version


@pytest.mark.parametrize(
    "argv",
    [
        ["--set", "nodeAgent.admissionPolicy=0"],
        ["--set-string", "nodeAgent.admissionPolicy="],
        ["--set-string", "nodeAgent.admissionPolicy=false"],
        ["--set", "nodeAgent.admissionPolicy=null"],
        ["--set-string", "admissionPolicies.acknowledgeInlineUndoesIsolation=false",
         "--set", "admissionPolicies.enabled=true",
         "--set", "admissionPolicies.inlineAllowedBackends[0]=loopfile"],
    ],
    ids=["zero", "empty", "string-false", "null", "ack-string"],
)  # fmt: skip
def test_only_a_boolean_false_drops_a_policy(helm: Path, argv: list[str]) -> None:
    """A key left empty in a values overlay, 0 or a string: the policy is kept (null: helm
    deletes the key, the default holds) or the render fails naming the value, never a
    node agent without its policy or an inline allow-list acknowledged by a string."""
    base = [str(helm), "template", "x", str(CHART), "--kube-version", "1.31.0",
            "--set", "storageClasses[0].name=l",
            "--set", "storageClasses[0].parameters.backend=loopfile"]  # fmt: skip
    proc = subprocess.run([*base, *argv], capture_output=True, text=True, check=False)
    if "null" in argv[-1]:
        # helm deletes a null key: the default, true, holds
        assert proc.returncode == 0, proc.stderr
        kinds = [d["kind"] for d in yaml.safe_load_all(proc.stdout) if d]
        assert "ValidatingAdmissionPolicy" in kinds, argv
    else:
        assert proc.returncode != 0
        # the schema's words (values.schema.json), or the template's where no schema runs
        assert "want boolean" in proc.stderr or "must be true or false" in proc.stderr, proc.stderr


def test_a_node_agent_value_other_than_true_false_or_auto_is_refused(helm: Path) -> None:
    argv = [str(helm), "template", "x", str(CHART), "--set", "nodeAgent.enabled=yes"]
    argv += ["--kube-version", render_manifest.KUBE_VERSION]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert proc.returncode != 0
    # values.schema.json refuses it first (the template's own check stays behind it)
    assert "at '/nodeAgent/enabled': value must be one of true, false, 'auto'" in proc.stderr


def test_storage_classes_render_with_the_given_fields(helm: Path) -> None:
    docs = render_list(
        helm,
        "storageClasses[0].name=local-loopfile",
        "storageClasses[0].volumeBindingMode=WaitForFirstConsumer",
        "storageClasses[0].allowVolumeExpansion=true",
        "storageClasses[0].default=true",
        "storageClasses[0].parameters.backend=loopfile",
        "storageClasses[0].parameters.preallocate=false",
        "storageClasses[1].name=nfs-team",
        "storageClasses[1].reclaimPolicy=Retain",
        "storageClasses[1].parameters.backend=nfs",
        "storageClasses[1].parameters.server=nfs1.example.com",
        "storageClasses[1].parameters.gid=2000",
    )
    local = one(docs, "StorageClass", "local-loopfile")
    assert local["apiVersion"] == "storage.k8s.io/v1"
    assert local["metadata"]["annotations"] == {
        "storageclass.kubernetes.io/is-default-class": "true"
    }
    assert local["provisioner"] == "flexhub"
    assert local["parameters"] == {"backend": "loopfile", "preallocate": "false"}  # strings
    assert local["reclaimPolicy"] == "Delete"
    assert local["volumeBindingMode"] == "WaitForFirstConsumer"
    assert local["allowVolumeExpansion"] is True
    team = one(docs, "StorageClass", "nfs-team")
    assert "annotations" not in team["metadata"] and "allowVolumeExpansion" not in team
    assert team["parameters"] == {"backend": "nfs", "server": "nfs1.example.com", "gid": "2000"}
    assert (team["reclaimPolicy"], team["volumeBindingMode"]) == ("Retain", "Immediate")
    assert "Deployment" not in {d["kind"] for d in docs}
    # a loopfile class: the nodes reclaim its files, so the node agent is on (auto)
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "ClusterRole"} == {
        "flexhub-node-agent"
    }


def test_the_values_examples_of_storage_classes_render_and_read_as_the_provisioner_reads(
    helm: Path, tmp_path: Path
) -> None:
    """The commented examples in values.yaml are real: rendered, each class is one the
    provisioner accepts (its backend's provision schema)."""
    from flexhub.driver.loader import load_backend
    from flexhub.provisioner.storageclass import read_class

    text = (CHART / "values.yaml").read_text()
    block = text[text.index("#   storageClasses:") :].split("\nstorageClasses:")[0]
    example = yaml.safe_load("\n".join(line[2:] for line in block.splitlines()))
    (tmp_path / "classes.yaml").write_text(yaml.safe_dump(example))
    argv = [str(helm), "template", "x", str(CHART), "-f", str(tmp_path / "classes.yaml")]
    argv += ["--kube-version", render_manifest.KUBE_VERSION]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    classes = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "StorageClass"]
    assert [c["metadata"]["name"] for c in classes] == ["local-loopfile", "nfs-team"]
    for sc in classes:
        read_class(sc, load_backend)  # raises InvalidOptions naming a wrong parameter


def test_the_provisioning_values_render_only_api_versions_the_cluster_serves(helm: Path) -> None:
    docs = render_list(
        helm, "namespace.create=true", "provisioner.enabled=true", "storageClasses[0].name=x"
    )
    versions = {d["kind"]: d["apiVersion"] for d in docs}
    assert versions == {
        "Namespace": "v1",
        "ServiceAccount": "v1",
        "ConfigMap": "v1",
        "StorageClass": "storage.k8s.io/v1",
        "ClusterRole": "rbac.authorization.k8s.io/v1",
        "ClusterRoleBinding": "rbac.authorization.k8s.io/v1",
        "Role": "rbac.authorization.k8s.io/v1",
        "RoleBinding": "rbac.authorization.k8s.io/v1",
        "DaemonSet": "apps/v1",
        "Deployment": "apps/v1",
    }


# -- the cluster's admission policies (deploy/admission-policy.yaml) ----------------------------

POLICY_FILE = REPO / "deploy" / "admission-policy.yaml"
INLINE = "flexhub-inline-volumes"


def policies(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The admission policies and bindings but the node agent's, in one order (helm sorts)."""
    kinds = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    found = [d for d in docs if d["kind"] in kinds and not d["metadata"]["name"].endswith("agent")]
    return sorted(found, key=lambda d: (d["kind"], d["metadata"]["name"]))


def allowed_inline(docs: list[dict[str, Any]]) -> str:
    policy = one(docs, "ValidatingAdmissionPolicy", INLINE)
    (variable,) = [v for v in policy["spec"]["variables"] if v["name"] == "allowedBackends"]
    expression: str = variable["expression"]
    return expression


def test_the_chart_renders_the_clusters_admission_policies_only_when_asked(helm: Path) -> None:
    """``admissionPolicies.enabled`` renders deploy/admission-policy.yaml itself (one source:
    the file is the chart's), with the chart's inline allow-list as its allowedBackends."""
    assert policies(render_list(helm)) == []
    the_file = policies([d for d in yaml.safe_load_all(POLICY_FILE.read_text()) if d])
    assert len(the_file) == 6
    assert policies(render_list(helm, "admissionPolicies.enabled=true")) == the_file
    docs = render_list(
        helm, "admissionPolicies.enabled=true", "admissionPolicies.inlineAllowedBackends={nfs,cifs}"
    )
    assert allowed_inline(docs) == '["nfs","cifs"]'
    rest = [d for d in policies(docs) if d["metadata"]["name"] != INLINE]
    assert rest == [d for d in the_file if d["metadata"]["name"] != INLINE]


def test_an_inline_allow_list_that_undoes_provisioned_isolation_is_refused(helm: Path) -> None:
    """Finding 13: an inline volume of a backend that one of the chart's classes provisions can
    mount that class's export (or target) root and read every claim's directory. The chart
    refuses to render such an allow-list, one line, unless the operator acknowledges it."""
    nfs_class = (
        "storageClasses[0].name=nfs-team",
        "storageClasses[0].parameters.backend=nfs",
        "storageClasses[0].parameters.server=nfs1.example.com",
        "storageClasses[0].parameters.share=/exports/k8s",
    )
    on = "admissionPolicies.enabled=true"
    proc = template(
        helm, render_manifest.KUBE_VERSION, *nfs_class, on,
        "admissionPolicies.inlineAllowedBackends={cifs,nfs}",
    )  # fmt: skip
    assert proc.returncode != 0
    (line,) = [ln for ln in proc.stderr.splitlines() if "inlineAllowedBackends" in ln]
    assert "nfs" in line and "nfs-team" in line
    assert "admissionPolicies.acknowledgeInlineUndoesIsolation=true" in line
    # acknowledged: rendered as asked
    proc = template(
        helm, render_manifest.KUBE_VERSION, *nfs_class, on,
        "admissionPolicies.inlineAllowedBackends={cifs,nfs}",
        "admissionPolicies.acknowledgeInlineUndoesIsolation=true",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert allowed_inline([d for d in yaml.safe_load_all(proc.stdout) if d]) == '["cifs","nfs"]'
    # a backend no class of the chart provisions is no concern of the chart's
    proc = template(
        helm, render_manifest.KUBE_VERSION, *nfs_class, on,
        "admissionPolicies.inlineAllowedBackends={cifs}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # an allow-list that would render nothing, or a name that is not a backend's, is refused
    for values, words in [
        (("admissionPolicies.inlineAllowedBackends={cifs}",), "admissionPolicies.enabled"),
        (
            (on, "admissionPolicies.inlineAllowedBackends={nfs']}"),
            "at '/admissionPolicies/inlineAllowedBackends/0': 'nfs\\']' does not match pattern",
        ),
    ]:
        proc = template(helm, render_manifest.KUBE_VERSION, *values)
        assert proc.returncode != 0, values
        assert words in proc.stderr, proc.stderr


def test_the_clusters_admission_policies_need_kubernetes_1_30(helm: Path) -> None:
    proc = template(helm, "1.29.0", "admissionPolicies.enabled=true")
    assert proc.returncode != 0
    assert "admissionPolicies.enabled needs Kubernetes 1.30 or later" in proc.stderr
    assert template(helm, "1.30.0", "admissionPolicies.enabled=true").returncode == 0


def test_the_lean_node_image_serves_the_daemonset_only_without_the_node_agent(helm: Path) -> None:
    """``image.nodeRepository`` (a release's ``flexhub-node``, built with ``--profile node``)
    reaches the DaemonSet when nothing in it needs the API client; with the node agent on, the
    DaemonSet keeps the full image, and the provisioner always has it."""
    lean = ("image.repository=reg/flexhub", "image.nodeRepository=reg/flexhub-node")
    images = {c["image"] for c in pod_of(render(helm, *lean))["containers"]}
    assert images == {"reg/flexhub-node:0.1.0"}
    docs = render(helm, *lean, "nodeAgent.enabled=true", "nodeAgent.admissionPolicy=false",
                  "provisioner.enabled=true")  # fmt: skip
    assert {c["image"] for c in pod_of(docs)["containers"]} == {"reg/flexhub:0.1.0"}
    provisioner = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert {c["image"] for c in provisioner} == {"reg/flexhub:0.1.0"}
