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


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
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
    """flexhub.csi uses the backend and provisioning API, the core and the node services, and
    the provisioner's StorageClass reader (the same validation of the same parameters); never
    the admin tools, the CLI or the conformance kit."""
    assert _violations("flexhub.csi", ("flexhub.admin", "flexhub.cli", "flexhub.testing")) == []
    provisioner = [
        v for v in _violations("flexhub.csi", ("flexhub.provisioner",))
        if not v.endswith(("flexhub.provisioner.storageclass", "storageclass.WAIT",
                           "storageclass.read_class"))
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
