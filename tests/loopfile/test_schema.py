"""The loopfile JSON Schema, validated as the core does: draft 2020-12 with common.json."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from flexhub_loopfile import LoopfileBackend
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from .conftest import REPO

SCHEMAS = REPO / "schemas"


def _load(name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / name).read_text("utf-8"))


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    schema = _load("loopfile.json")
    registry: Registry = Registry().with_resources(
        (s["$id"], Resource.from_contents(s)) for s in (_load("common.json"), schema)
    )
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, registry=registry)


def _errors(validator: Draft202012Validator, options: dict[str, Any]) -> list[str]:
    return [e.message for e in validator.iter_errors(options)]


def test_package_schema_is_the_repo_schema() -> None:
    link = REPO / "backends/loopfile/flexhub_loopfile/schema.json"
    assert link.is_symlink()
    assert os.readlink(link) == "../../../schemas/loopfile.json"
    assert LoopfileBackend.schema() == _load("loopfile.json")
    assert LoopfileBackend.schema()["$id"] == "https://flexhub.invalid/schemas/loopfile.json"


@pytest.mark.parametrize(
    "options",
    [
        {"backend": "loopfile", "file": "a.img"},
        {"backend": "loopfile", "file": "db/pg.img", "size": "10Gi"},
        {"backend": "loopfile", "file": "x_1/y-2/z+3.img", "size": "1073741824"},
        {"backend": "loopfile", "file": "a..b", "size": "1.5G"},
        {"backend": "loopfile", "file": "a.img", "preallocate": "true", "size": "1Gi"},
        {"backend": "loopfile", "file": "a.img", "preallocate": "false"},
        {"backend": "loopfile", "file": "a.img", "mountOptions": ""},
        {"backend": "loopfile", "file": "a.img", "mountOptions": "noatime,discard,nodev"},
        {"backend": "loopfile", "file": "a.img", "kubernetes.io/fsType": "xfs"},
        {"backend": "loopfile", "file": "a.img", "kubernetes.io/fsType": ""},
        {"backend": "loopfile", "file": "a.img", "kubernetes.io/readwrite": "ro"},
        {"backend": "loopfile", "file": "a.img", "kubernetes.io/pod.name": "web-0"},
        {"backend": "loopfile", "file": "a" * 255},
    ],
)
def test_accepts(validator: Draft202012Validator, options: dict[str, Any]) -> None:
    assert _errors(validator, options) == []


@pytest.mark.parametrize(
    "options",
    [
        {"file": "a.img"},
        {"backend": "loopfile"},
        {"backend": "nfs", "file": "a.img"},
        {"backend": "loopfile", "file": ""},
        {"backend": "loopfile", "file": "/etc/shadow"},
        {"backend": "loopfile", "file": "../etc/shadow"},
        {"backend": "loopfile", "file": "a/../../b"},
        {"backend": "loopfile", "file": "a/.."},
        {"backend": "loopfile", "file": ".."},
        {"backend": "loopfile", "file": "."},
        {"backend": "loopfile", "file": "./a"},
        {"backend": "loopfile", "file": "a//b"},
        {"backend": "loopfile", "file": "a/"},
        {"backend": "loopfile", "file": ".hidden"},
        {"backend": "loopfile", "file": "-rf"},
        {"backend": "loopfile", "file": "a b"},
        {"backend": "loopfile", "file": "a\nb"},
        {"backend": "loopfile", "file": "a\\b"},
        {"backend": "loopfile", "file": "é.img"},
        {"backend": "loopfile", "file": "a" * 256},
        {"backend": "loopfile", "file": 1},
        {"backend": "loopfile", "file": "a.img", "size": 1024},
        {"backend": "loopfile", "file": "a.img", "size": "1GB"},
        {"backend": "loopfile", "file": "a.img", "size": "-1Gi"},
        {"backend": "loopfile", "file": "a.img", "preallocate": "yes"},
        {"backend": "loopfile", "file": "a.img", "preallocate": True},
        {"backend": "loopfile", "file": "a.img", "mountOptions": "bind"},
        {"backend": "loopfile", "file": "a.img", "mountOptions": "noatime,remount"},
        {"backend": "loopfile", "file": "a.img", "mountOptions": "loop=/dev/sda"},
        {"backend": "loopfile", "file": "a.img", "kubernetes.io/fsType": "btrfs"},
        {"backend": "loopfile", "file": "a.img", "kubernetes.io/readwrite": "rx"},
        {"backend": "loopfile", "file": "a.img", "kubernetes.io/pod.name": 3},
        {"backend": "loopfile", "file": "a.img", "server": "srv1"},
        {"backend": "loopfile", "file": "a.img", "offset": "0"},
    ],
)
def test_rejects(validator: Draft202012Validator, options: dict[str, Any]) -> None:
    assert _errors(validator, options) != []


def test_every_property_is_a_string() -> None:
    schema = _load("loopfile.json")
    common = _load("common.json")["$defs"]
    for name, prop in schema["properties"].items():
        if "$ref" in prop:
            prop = common[prop["$ref"].rsplit("/", 1)[-1]]
        assert prop.get("type") == "string" or isinstance(prop.get("const"), str), name


def test_schema_file_in_repo_is_canonical() -> None:
    assert Path(SCHEMAS / "loopfile.json").read_text("utf-8").endswith("\n")


def test_core_validation_uses_the_schema() -> None:
    from flexhub.driver.validation import validate_options
    from flexhub.errors import InvalidOptions

    validate_options(
        LoopfileBackend,
        {"backend": "loopfile", "file": "db/pg.img", "size": "1Gi", "kubernetes.io/fsType": ""},
    )
    for bad in ({"file": "/etc/shadow"}, {"file": "a/../../b"}, {"size": "1GB"}, {"mode": "x"}):
        with pytest.raises(InvalidOptions):
            validate_options(LoopfileBackend, {"backend": "loopfile", "file": "a.img", **bad})
