"""``flexhub.provisioner.storageclass.read_class``: a StorageClass read into a ClassSpec, or
one line naming the field at fault (backend classes defined here, their schemas in memory)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import pytest

from flexhub.backend import FilesystemBackend
from flexhub.errors import BackendError, InvalidOptions
from flexhub.provisioner.storageclass import (
    PROVISIONER_KEYS,
    PROVISIONER_NAME,
    ClassSpec,
    class_problems,
    read_class,
)
from flexhub.provisioning import Provisioning

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "share": {"type": "string", "pattern": "^[a-z]+$", "description": "a share"},
        "mountOptions": {"type": "string"},
        "fsType": {"enum": ["", "ext4", "xfs"]},
    },
    "required": ["share"],
}


class Remote(FilesystemBackend, Provisioning):  # type: ignore[misc]  # two expand()s
    """Reclaimed by the provisioner; honours delete and archive."""

    on_delete: ClassVar[frozenset[str]] = frozenset({"delete", "archive"})

    @classmethod
    def parameters_schema(cls) -> dict[str, Any]:
        return SCHEMA

    @classmethod
    def check_parameters(cls, parameters: Mapping[str, str]) -> None:
        if parameters.get("share") == "forbidden":
            raise InvalidOptions("parameter 'share': forbidden is reserved")


class OnNode(Remote):
    reclaim_on: ClassVar[str] = "node"


class NoProvisioning(FilesystemBackend):
    pass


class Broken(Remote):
    @classmethod
    def parameters_schema(cls) -> dict[str, Any]:
        raise BackendError("backend parameters schema x/provision-schema.json unreadable")


CLASSES: dict[str, type] = {
    "loopfile": OnNode,
    "nfs": Remote,
    "cifs": NoProvisioning,
    "iscsi": Broken,
}


def lookup(name: str) -> type:
    return CLASSES[name]


def sc(parameters: Mapping[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": "fast"},
        "provisioner": PROVISIONER_NAME,
        "parameters": {"backend": "nfs", "share": "one", **(parameters or {})},
    }
    doc.update(fields)
    return doc


def refused(doc: Mapping[str, Any]) -> str:
    with pytest.raises(InvalidOptions) as caught:
        read_class(doc, lookup)
    message = caught.value.message
    assert "\n" not in message
    return message


def test_a_good_class() -> None:
    spec = read_class(
        sc(
            {
                "onDelete": "archive",
                "secretName": "creds",
                "secretNamespace": "storage",
                "fsType": "xfs",
                "mountOptions": "noatime",
            }
        ),
        lookup,
    )
    assert spec == ClassSpec(
        name="fast",
        backend="nfs",
        parameters={"share": "one", "fsType": "xfs", "mountOptions": "noatime"},
        on_delete="archive",
        secret=("storage", "creds"),
        fs_type="xfs",
        reclaim_on="provisioner",
    )
    assert not set(spec.parameters) & (PROVISIONER_KEYS - {"fsType"})


def test_defaults_and_no_fs_type_passed_when_unset() -> None:
    spec = read_class(sc(), lookup)
    assert (spec.on_delete, spec.secret, spec.fs_type) == ("delete", None, "")
    assert dict(spec.parameters) == {"share": "one"}
    with pytest.raises(TypeError):
        spec.parameters["share"] = "two"  # type: ignore[index]


def test_a_node_backend_needs_wait_for_first_consumer() -> None:
    doc = sc({"backend": "loopfile"})
    assert refused(doc).startswith(
        "volumeBindingMode: backend loopfile keeps a volume on one node, so the class must be "
        "WaitForFirstConsumer (not 'Immediate')"
    )
    spec = read_class({**doc, "volumeBindingMode": "WaitForFirstConsumer"}, lookup)
    assert spec.reclaim_on == "node"


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (sc(provisioner="k8s/flexhub"), "provisioner: 'k8s/flexhub' is not 'flexhub'"),
        (sc(kind="PersistentVolume"), "kind: 'PersistentVolume' is not a StorageClass"),
        (
            sc({"backend": "nsf"}),
            "parameters.backend: unknown backend 'nsf', did you mean nfs?",
        ),
        (sc({"backend": "../x"}), "parameters.backend: unknown backend '../x' (installed: "),
        (
            {**sc(), "parameters": {"share": "one"}},
            "parameters.backend: required (installed: ",
        ),
        (
            sc({"backend": "cifs"}),
            "parameters.backend: backend 'cifs' cannot provision volumes",
        ),
        (
            sc({"onDelete": "retain"}),
            "parameters.onDelete: backend nfs honours archive, delete, not 'retain'",
        ),
        (
            sc({"onDelete": "shred"}),
            "parameters.onDelete: must be one of delete, retain, archive, not 'shred'",
        ),
        (sc({"secretName": "creds"}), "parameters.secretNamespace: required with secretName"),
        (sc({"secretNamespace": "x"}), "parameters.secretName: required with secretNamespace"),
        (sc({"sahre": "x"}), "parameters.sahre: unknown parameter, did you mean share?"),
        (sc({"share": "ONE"}), "parameters.share: 'ONE' is not valid: expected a share"),
        ({**sc(), "parameters": {"backend": "nfs"}}, "parameters.share: required"),
        (sc({"fsType": "btrfs"}), 'parameters.fsType: must be one of "", "ext4", "xfs"'),
        (sc({"share": 7}), "parameters.share: must be a string, not a number (quote it)"),
        (sc({"share": "forbidden"}), "parameters.share: forbidden is reserved"),
        (
            sc(mountOptions=["noatime"]),
            "mountOptions: a FlexVolume PV cannot carry mountOptions (kubelet fails its "
            "mount): put them in parameters.mountOptions, comma-separated",
        ),
        ({**sc(), "parameters": ["backend"]}, "parameters: must be a map of strings"),
    ],
)
def test_each_mistake_is_one_line_naming_its_field(doc: dict[str, Any], expected: str) -> None:
    assert refused(doc).startswith(expected)


def test_mount_options_for_a_backend_without_them() -> None:
    class Bare(Remote):
        @classmethod
        def parameters_schema(cls) -> dict[str, Any]:
            return {**SCHEMA, "properties": {"share": SCHEMA["properties"]["share"]}}

    doc = sc(mountOptions=["noatime"])
    with pytest.raises(InvalidOptions, match="backend nfs takes none in its parameters"):
        read_class(doc, lambda name: Bare)


def test_every_problem_for_validate() -> None:
    spec, problems = class_problems(
        sc({"onDelete": "shred", "secretName": "x", "sahre": "y"}, mountOptions=["ro"]), lookup
    )
    assert spec is None
    assert [p.split(":")[0] for p in problems] == [
        "parameters.onDelete",
        "parameters.secretNamespace",
        "parameters.sahre",
        "mountOptions",
    ]


def test_a_broken_installed_backend_is_not_the_class_s_fault() -> None:
    """A schema that cannot be read is a BackendError (retried), not a class mistake."""
    with pytest.raises(BackendError):
        read_class(sc({"backend": "iscsi"}), lookup)


def test_an_installed_backend_that_fails_to_import_is_raised() -> None:
    def failing(name: str) -> type:
        raise BackendError(f"backend {name!r} failed to import: ImportError: x")

    with pytest.raises(BackendError, match="failed to import"):
        read_class(sc({"backend": "nfs"}), failing)


def test_the_real_loader_and_loopfile() -> None:
    """The installed loopfile backend through flexhub's own loader."""
    from flexhub.driver.loader import load_backend

    doc = {
        "kind": "StorageClass",
        "metadata": {"name": "local"},
        "provisioner": "flexhub",
        "volumeBindingMode": "WaitForFirstConsumer",
        "parameters": {"backend": "loopfile", "directory": "claims", "fsType": "xfs"},
    }
    spec = read_class(doc, load_backend)
    assert spec.reclaim_on == "node"
    assert dict(spec.parameters) == {"directory": "claims", "fsType": "xfs"}
    assert spec.on_delete == "delete"
    doc["parameters"] = {"backend": "loopfle"}
    with pytest.raises(InvalidOptions, match="unknown backend 'loopfle', did you mean loopfile"):
        read_class(doc, load_backend)
