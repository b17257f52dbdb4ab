"""Every Kubernetes API call in flexhub/provisioner is allowed by the chart's RBAC for the
process that makes it, and the chart allows nothing that no call needs.

The calls are found in the source, not listed by hand: every reference to a method of the
official client's API classes (``self.core.read_node``, or a list method handed to
``watch_forever``), followed from ``run_provisioner`` and ``run_node_agent`` through the
names each function and class uses, across the package's modules. Each method's HTTP verb
and path come from the client's own code, so its RBAC verb, API group and resource are the
client's, never a guess. Only where a namespaced call lands is said here (``WHERE``), and
where the Events go is checked against :class:`flexhub.provisioner.events.Recorder` itself.
A new call without a rule, a rule without a call, or a namespaced call nobody placed fails.
"""

from __future__ import annotations

import ast
import inspect
import re
import shutil
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "deploy"))
import render_manifest  # type: ignore[import-not-found]

PACKAGE = REPO / "flexhub" / "provisioner"
NS = render_manifest.NAMESPACE
#: The components, each a process with its account in the rendered chart (release flexhub).
ROOTS = {"provisioner": ("service", "run_provisioner"), "node-agent": ("service", "run_node_agent")}
ACCOUNTS = {"provisioner": "flexhub-provisioner", "node-agent": "flexhub"}
#: Where each namespaced call lands: None, any namespace (a ClusterRole); else one namespace.
WHERE: dict[tuple[str, str, str], str | None] = {
    ("provisioner", "persistentvolumeclaims", "get"): None,  # every claim of the cluster
    ("provisioner", "persistentvolumeclaims", "list"): None,
    ("provisioner", "persistentvolumeclaims", "watch"): None,
    ("provisioner", "persistentvolumeclaims", "patch"): None,  # its finalizer (pvapi.hold_claim)
    ("provisioner", "secrets", "get"): None,  # a class's secretNamespace: any namespace
    ("provisioner", "secrets", "create"): NS,  # its own sealing key, made once (seal.py)
    ("provisioner", "events", "create"): None,  # a claim's Events, in the claim's namespace
    ("provisioner", "events", "patch"): None,  # a repeat counted (events.py aggregates)
    ("provisioner", "leases", "create"): NS,  # --lease-namespace: the release's (the chart)
    ("provisioner", "leases", "get"): NS,
    ("provisioner", "leases", "update"): NS,
    ("node-agent", "events", "create"): "default",  # a PV's Events (Recorder.volume)
}
#: The one object a namespaced get/update may name (a Role's resourceNames).
NAMES = {
    ("provisioner", "leases", "get"): "flexhub-provisioner",  # service.py: f"{name}-provisioner"
    ("provisioner", "leases", "update"): "flexhub-provisioner",
}
#: Granted beyond what the calls need: a read of the provisioner's sealing key, the Secret
#: ``flexhub-provisioner-key`` in its own namespace, by name (the cluster-wide ``secrets get``
#: covers it today; this one stays should an operator narrow that).
AHEAD = {
    ("provisioner", "", "secrets", "get", NS, "flexhub-provisioner-key"),
}
HTTP_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}

Atom = tuple[str, str, str, str, str | None, str | None]


@pytest.fixture(scope="module")
def helm() -> Iterator[Path]:
    if shutil.which("go") is None and not render_manifest.helm_binary(build=False).is_file():
        pytest.skip("helm is built with Go, which is not installed (.ci/install-system.sh)")
    yield render_manifest.helm_binary()


@cache
def api_classes() -> set[str]:
    """The client's API classes the package makes (``client.CoreV1Api(api)``)."""
    found = set()
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and re.fullmatch(r"[A-Z]\w*Api", func.attr):
                found.add(func.attr)
    return found


@cache
def endpoints() -> dict[str, tuple[str, str]]:
    """Every method of those classes: name → (HTTP method, path template)."""
    import kubernetes.client.api as apis

    found: dict[str, tuple[str, str]] = {}
    for class_name in sorted(api_classes()):
        cls = getattr(apis, class_name)
        for name in dir(cls):
            serialize = getattr(cls, f"_{name}_serialize", None)
            if name.startswith("_") or serialize is None:
                continue
            text = inspect.getsource(serialize)
            method = re.search(r"method='([A-Z]+)'", text)
            path = re.search(r"resource_path='([^']+)'", text)
            assert method and path, f"{class_name}.{name}: no method/path in the client's code"
            endpoint = (method.group(1), path.group(1))
            # in two classes (get_api_resources): known only by the class, never used here
            found[name] = endpoint if found.get(name, endpoint) == endpoint else ("?", name)
    return found


def rbac_of(method: str, path: str, watched: bool) -> tuple[str, str, list[str]]:
    """(API group, resource, RBAC verbs) of one client call."""
    parts = path.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    if rest[:2] == ["namespaces", "{namespace}"] and len(rest) > 2:
        rest = rest[2:]
    resource, named = rest[0], len(rest) > 1 and rest[1] == "{name}"
    if len(rest) > 2:
        resource += "/" + rest[2]  # a subresource
    if method == "GET":
        verbs = ["get"] if named else ["list", "watch"] if watched else ["list"]
    elif method == "DELETE":
        verbs = ["delete" if named else "deletecollection"]
    else:
        verbs = [HTTP_VERBS[method]]
    return group, resource, verbs


class Unit:
    """A module-level function or class: the API methods, the names it refers to, and what
    it imports from the package (local name → (module, name); ``*``: a whole module)."""

    def __init__(self, node: ast.AST) -> None:
        self.api: set[str] = set()
        self.names: set[str] = set()
        self.imports: dict[str, tuple[str, str]] = {}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and sub.attr in endpoints():
                self.api.add(sub.attr)
            elif isinstance(sub, ast.Name):
                self.names.add(sub.id)
            elif isinstance(sub, ast.ImportFrom) and sub.module:
                for alias in sub.names:
                    local = alias.asname or alias.name
                    if sub.module.startswith("flexhub.provisioner."):
                        self.imports[local] = (sub.module.rsplit(".", 1)[1], alias.name)
                    elif sub.module == "flexhub.provisioner":
                        self.imports[local] = (alias.name, "*")


@cache
def units() -> dict[str, dict[str, Unit]]:
    """module → name → Unit; the module's own top-level code (its imports) is the unit ``""``."""
    found: dict[str, dict[str, Unit]] = {}
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        module = found.setdefault(path.stem, {})
        top = ast.Module(body=[], type_ignores=[])
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                module[node.name] = Unit(node)
            else:
                top.body.append(node)
        module[""] = Unit(top)
    return found


def calls_of(component: str) -> set[tuple[str, bool]]:
    """(API method, handed to watch_forever) of everything ``component``'s root reaches:
    the functions and classes it names, in its module or imported from the package."""
    every = units()
    todo = [ROOTS[component]]
    seen: set[tuple[str, str]] = set()
    found: set[tuple[str, bool]] = set()
    while todo:
        module, name = todo.pop()
        if (module, name) in seen:
            continue
        seen.add((module, name))
        assert module in every, f"flexhub.provisioner.{module}: no such module"
        if name != "*" and name not in every[module]:
            continue  # a constant (ANN_SEAL): no call in it
        if name == "*":
            todo += [(module, each) for each in every[module] if each]
            continue
        unit = every[module][name]
        found |= {(method, "watch_forever" in unit.names) for method in unit.api}
        imported = {**every[module][""].imports, **unit.imports}
        for ref in unit.names:
            if ref in every[module] and ref:
                todo.append((module, ref))
            elif ref in imported:
                todo.append(imported[ref])
    return found


def needed() -> set[Atom]:
    atoms: set[Atom] = set()
    for component in ROOTS:
        for method, watched in calls_of(component):
            http, path = endpoints()[method]
            assert http != "?", f"{method}: of which API class? (two have it)"
            group, resource, verbs = rbac_of(http, path, watched)
            for verb in verbs:
                key = (component, resource, verb)
                if "{namespace}" in path:
                    assert key in WHERE, f"{method} of the {component}: say in WHERE where it goes"
                    where = WHERE[key]
                else:
                    where = None
                atoms.add((component, group, resource, verb, where, NAMES.get(key)))
    return atoms


def granted(docs: list[dict[str, Any]]) -> set[Atom]:
    """Every (component, group, resource, verb, namespace, name) the chart's bindings give."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs}
    by_account = {(NS, account): component for component, account in ACCOUNTS.items()}
    atoms: set[Atom] = set()
    for binding in docs:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        where = binding["metadata"].get("namespace")  # None for a ClusterRoleBinding
        ref = binding["roleRef"]
        role = roles[(ref["kind"], where if ref["kind"] == "Role" else None, ref["name"])]
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount", subject
            component = by_account[(subject["namespace"], subject["name"])]
            for rule in role["rules"]:
                for name in rule.get("resourceNames") or [None]:
                    for group in rule["apiGroups"]:
                        for resource in rule["resources"]:
                            for verb in rule["verbs"]:
                                atoms.add((component, group, resource, verb, where, name))
    return atoms


def test_every_api_call_has_exactly_its_rule_in_the_chart(helm: Path) -> None:
    text = render_manifest.render(helm, "provisioner.enabled=true", "nodeAgent.enabled=true")
    docs = [d for d in yaml.safe_load_all(text) if d]
    need, have = needed(), granted(docs)
    assert need - have == set(), "calls the chart does not allow"
    assert have - need - AHEAD == set(), "rules no call needs"


def test_the_calls_found_are_the_ones_the_processes_make() -> None:
    """The source scan itself: what each component reaches, as read in the code today (a
    scan that finds nothing would pass the test above with an empty chart)."""
    assert {m for m, _ in calls_of("node-agent")} >= {
        "list_persistent_volume",
        "read_persistent_volume",
        "delete_persistent_volume",
        "patch_persistent_volume",
        "create_namespaced_event",
    }
    provisioner = {m for m, _ in calls_of("provisioner")}
    assert provisioner >= {
        "list_persistent_volume_claim_for_all_namespaces",
        "create_persistent_volume",
        "read_namespaced_secret",
        "read_storage_class",
        "replace_namespaced_lease",
        "create_namespaced_event",
    }
    # the node agent reaches none of the provisioner's own calls
    assert not {"read_namespaced_secret", "create_persistent_volume"} & {
        m for m, _ in calls_of("node-agent")
    }
    assert ("list_persistent_volume", True) in calls_of("node-agent")  # watched, too
    # the API is reached only through the client's API classes
    for path in PACKAGE.glob("*.py"):
        text = path.read_text()
        for raw in ("call_api", "param_serialize", "DynamicClient", "rest_client"):
            assert raw not in text, f"{path.name} calls the API around its classes ({raw})"


class _Core:
    def __init__(self) -> None:
        self.namespaces: list[str] = []

    def create_namespaced_event(self, namespace: str, _event: object, **_: object) -> None:
        self.namespaces.append(namespace)


def test_events_go_where_the_chart_lets_each_component_write_them() -> None:
    """The node agent records Events only on PVs (Recorder.volume), which land in
    ``default``: its Role's namespace. A claim's Events land in the claim's namespace (any:
    the provisioner's ClusterRole)."""
    from flexhub.provisioner.events import Recorder

    core = _Core()
    recorder = Recorder(core, "flexhub-node")
    recorder.volume({"metadata": {"name": "pvc-1"}}, "Warning", "R", "m")
    recorder.claim({"metadata": {"name": "c", "namespace": "team-a"}}, "Normal", "R", "m")
    assert core.namespaces == [WHERE[("node-agent", "events", "create")], "team-a"]
    tree = ast.parse((PACKAGE / "nodeagent.py").read_text())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "events"
    }
    assert used == {"volume"}, used
