"""The package layout is the architecture: which code a kubelet call pays for is visible in
the tree, and the arrows between the packages point one way.

- ``flexhub.driver`` (the kubelet path) imports nothing of ``flexhub.admin``, ``flexhub.cli``,
  ``flexhub.testing``, ``flexhub.provisioner`` or ``flexhub.csi``;
- ``flexhub.csi`` (the CSI front end) imports nothing of the admin tools, CLI or kit;
- ``flexhub.node`` imports nothing of those nor of ``flexhub.driver``;
- the public backend API (``flexhub.backend``, ``volume``, ``errors``, ``config``) imports only
  itself and ``flexhub.node``;
- backends import only ``flexhub.backend`` (and ``flexhub.provisioning``, the optional
  provisioning interface they mix in, and ``flexhub.pathpattern`` and ``flexhub.claimdir``,
  the helpers of a directory per claim) of flexhub.

Imports are read from the source (every ``import``/``from`` statement, also those inside
functions), so a lazy import breaks the rule as much as a top-level one.

No two modules inside ``flexhub/`` import each other, directly or round a longer loop. Every
import counts here too: one inside a function and one under ``if TYPE_CHECKING:``. A lazy or
type-only import keeps the interpreter from tripping over a circle, not the reader: the two
modules are still one tangle that cannot be read, tested or moved apart (``config`` and
``settings`` were tied exactly so). An arrow goes to the module an import names
(``from flexhub.admin import install`` names ``flexhub.admin.install``, ``from flexhub import
DRIVER_NAME`` names ``flexhub``); the parent packages a dotted import loads on the way are not
arrows, so a package's ``__init__`` that hands names on ties nothing by itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "flexhub"
UPPER = ("flexhub.admin", "flexhub.cli", "flexhub.testing", "flexhub.provisioner", "flexhub.csi")
PUBLIC_API = (
    "flexhub.backend",
    "flexhub.volume",
    "flexhub.errors",
    "flexhub.config",
    "flexhub.settings",
    "flexhub.pathpattern",
    "flexhub.claimdir",
)


def _module_name(path: Path, top: Path = REPO) -> str:
    parts = path.relative_to(top).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every flexhub module ``path`` imports (``from flexhub import x`` counts as ``flexhub.x``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "flexhub" or name.startswith("flexhub")}


def _import_graph(root: Path) -> dict[str, set[str]]:
    """Module name -> the modules of the package at ``root`` that it imports."""
    paths = sorted(root.rglob("*.py"))
    modules = {_module_name(path, root.parent) for path in paths}
    return {_module_name(path, root.parent): _arrows(path, root.parent, modules) for path in paths}


def _arrows(path: Path, top: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports, wherever the import stands."""
    here = _module_name(path, top)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {name for name in found if name in modules}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of modules that reach one another (Tarjan's strongly connected components of
    more than one module, or a module importing itself), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        on_stack.add(name)
        for other in sorted(graph.get(name, ())):
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in on_stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            part = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                part.append(top)
                if top == name:
                    break
            if len(part) > 1 or name in graph.get(name, ()):
                out.append(sorted(part))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(out)


def _describe(graph: dict[str, set[str]], circle: list[str]) -> str:
    members = set(circle)
    ties = [f"{a} -> {b}" for a in circle for b in sorted(graph[a] & members)]
    return "circle: " + "; ".join(ties)


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    root = REPO.joinpath(*package.split("."))
    files = [root.with_suffix(".py")] if root.with_suffix(".py").exists() else root.rglob("*.py")
    out = []
    for path in sorted(files):
        for name in sorted(_imports(path)):
            if _within(name, forbidden):
                out.append(f"{path.relative_to(REPO)} imports {name}")
    return out


def test_the_kubelet_path_imports_no_admin_tool_cli_kit_or_provisioner() -> None:
    assert _violations("flexhub.driver", UPPER) == []


def test_node_services_import_nothing_above_them() -> None:
    assert _violations("flexhub.node", ("flexhub.driver", *UPPER)) == []


@pytest.mark.parametrize("module", PUBLIC_API)
def test_the_public_backend_api_stands_on_node_services_only(module: str) -> None:
    assert _violations(module, ("flexhub.driver", *UPPER)) == []


def test_backends_import_only_the_public_backend_api() -> None:
    allowed = {
        "flexhub",
        "flexhub.backend",
        "flexhub.provisioning",
        "flexhub.pathpattern",
        "flexhub.claimdir",
    }
    out = []
    for path in sorted((REPO / "backends").glob("*/flexhub_*/**/*.py")):
        for name in sorted(_imports(path)):
            if (
                name.startswith("flexhub.")
                and not name.startswith("flexhub_")
                and name not in allowed
                and not name.startswith(
                    (
                        "flexhub.backend.",
                        "flexhub.provisioning.",
                        "flexhub.pathpattern.",
                        "flexhub.claimdir.",
                    )
                )
            ):
                out.append(f"{path.relative_to(REPO)} imports {name}")
    assert out == []


def test_the_csi_front_end_stands_on_the_public_api_and_the_core() -> None:
    """flexhub.csi uses the backend and provisioning API, the core and the node services, the
    provisioner's StorageClass reader (the same validation of the same parameters) and its
    Event recorder (the node plugin's health Events: the same counting and rate limit); never
    the admin tools, the CLI or the conformance kit."""
    assert _violations("flexhub.csi", ("flexhub.admin", "flexhub.cli", "flexhub.testing")) == []
    provisioner = [
        v for v in _violations("flexhub.csi", ("flexhub.provisioner",))
        if not v.endswith(("flexhub.provisioner.storageclass", "storageclass.WAIT",
                           "storageclass.read_class", "flexhub.provisioner.events",
                           "events.CountingRecorder"))
    ]  # fmt: skip
    assert provisioner == []


def test_the_rule_sees_a_lazy_import(tmp_path: Path) -> None:
    """The reader finds an import inside a function, as the driver's lazy imports are."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from flexhub.admin import doctor\n    import flexhub.cli\n")
    assert _imports(module) == {"flexhub.admin", "flexhub.admin.doctor", "flexhub.cli"}


def test_the_top_level_holds_only_the_public_api_and_the_entry_point() -> None:
    """What a mount pays for is under driver/ and node/; admin tools are not beside them."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == [
        "__init__.py",
        "__main__.py",
        "backend.py",
        "claimdir.py",
        "config.py",
        "errors.py",
        "pathpattern.py",
        "provisioning.py",
        "settings.py",
        "volume.py",
    ]


def test_no_import_circle_inside_flexhub() -> None:
    graph = _import_graph(PACKAGE)
    assert [_describe(graph, circle) for circle in _circles(graph)] == []


def test_the_circle_rule_sees_lazy_and_type_only_imports(tmp_path: Path) -> None:
    """The two circles that came back were tied by a function-level import one way and a
    ``TYPE_CHECKING`` import (``config``/``settings``) or a second lazy one
    (``admin.install``/``admin.plugindir``) the other: both kinds are arrows."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "config.py").write_text("def load():\n    from pkg.settings import hint\n")
    (pkg / "settings.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.config import load\n"
    )
    (pkg / "sub" / "install.py").write_text("def f():\n    from pkg.sub import record\n")
    (pkg / "sub" / "record.py").write_text("def g():\n    from . import install\n")
    (pkg / "sub" / "face.py").write_text("from pkg import config\nfrom .. import settings\n")
    graph = _import_graph(pkg)
    assert graph["pkg.sub.face"] == {"pkg.config", "pkg.settings"}
    assert _circles(graph) == [
        ["pkg.config", "pkg.settings"],
        ["pkg.sub.install", "pkg.sub.record"],
    ]
