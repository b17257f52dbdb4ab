"""``flexhub.testing.lint.lint_schema``: each rule on good and bad schemas, and the shipped
schemas lint clean (issue 15)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from flexhub_iscsi import IscsiBackend
from flexhub_loopfile import LoopfileBackend
from flexhub_nfs import NfsBackend

from flexhub.driver.validation import validate_options
from flexhub.errors import InvalidOptions
from flexhub.testing.lint import lint_schema
from tests.conftest import REPO

COMMON = "https://flexhub.invalid/schemas/common.json#/$defs/"

GOOD: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://flexhub.invalid/schemas/lintme.json",
    "type": "object",
    "additionalProperties": False,
    "patternProperties": {"^kubernetes\\.io/": {"$ref": COMMON + "kubeletKeys"}},
    "properties": {
        "backend": {"const": "lintme"},
        "directory": {
            "description": "a directory name",
            "examples": ["team-a"],
            "type": "string",
            "pattern": "^[a-z0-9][a-z0-9._-]{0,62}$(?!\\n)",
        },
        "size": {"description": "the size", "examples": ["10Gi"], "$ref": COMMON + "quantity"},
        "mode": {"description": "a local $ref", "examples": ["fast"], "$ref": "#/$defs/mode"},
    },
    "$defs": {"mode": {"type": "string", "enum": ["fast", "safe"]}},
    "required": ["backend", "directory"],
}


def with_option(name: str, prop: Any) -> dict[str, Any]:
    schema = copy.deepcopy(GOOD)
    schema["properties"][name] = prop
    return schema


def only(problems: list[str]) -> str:
    assert len(problems) == 1, problems
    assert "\n" not in problems[0]
    return problems[0]


def test_a_good_schema_is_clean() -> None:
    assert lint_schema(GOOD) == []


def test_the_routing_key_needs_no_description_or_example() -> None:
    assert GOOD["properties"]["backend"] == {"const": "lintme"}
    assert lint_schema(GOOD) == []


def test_an_option_without_description() -> None:
    for description in (None, "", "  "):
        prop = {"examples": ["x"], "type": "string"}
        if description is not None:
            prop["description"] = description
        line = only(lint_schema(with_option("server", prop)))
        assert line.startswith("option 'server': no description; add \"description\"")


def test_an_option_without_examples() -> None:
    line = only(lint_schema(with_option("server", {"description": "d", "type": "string"})))
    assert line.startswith("option 'server': no examples; add \"examples\"")


def test_openapi_example_is_named() -> None:
    prop = {"description": "d", "type": "string", "example": "x"}
    line = only(lint_schema(with_option("server", prop)))
    assert '"example" is OpenAPI\'s' in line


@pytest.mark.parametrize("examples", [[], "x", {"a": "b"}])
def test_examples_must_be_a_non_empty_list(examples: Any) -> None:
    prop = {"description": "d", "type": "string", "examples": examples}
    line = only(lint_schema(with_option("server", prop)))
    assert "option 'server': \"examples\" must be a non-empty list" in line


def test_an_example_that_is_not_a_string() -> None:
    prop = {"description": "d", "examples": [3]}
    line = only(lint_schema(with_option("port", prop)))
    assert line.startswith("option 'port': example 3 is a int; option values are strings")


@pytest.mark.parametrize(
    ("prop", "bad"),
    [
        ({"type": "string", "pattern": "^[a-z]+$(?!\\n)"}, "Team-A"),
        ({"type": "string", "maxLength": 3}, "abcd"),
        ({"$ref": COMMON + "quantity"}, "1GB"),
        ({"$ref": COMMON + "boolString"}, "yes"),
        ({"$ref": "#/$defs/mode"}, "slow"),
    ],
)
def test_an_example_that_does_not_validate(prop: dict[str, Any], bad: str) -> None:
    good = {**prop, "description": "d", "examples": [bad]}
    line = only(lint_schema(with_option("opt", good)))
    assert line.startswith(f"option 'opt': example {bad!r} does not validate (")
    assert line.endswith("; fix the example or the schema")


def test_a_broken_ref_is_named() -> None:
    prop = {"description": "d", "examples": ["x"], "$ref": COMMON + "nosuch"}
    line = only(lint_schema(with_option("opt", prop)))
    assert line.startswith("option 'opt': its schema cannot be used (")


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("kubernetes.io/myOption", "kubelet never sends this kubernetes.io/ key"),
        ("kubernetes.io/secret/password", "secrets are removed before validation"),
        ("kubernetes.io/pod.name", "per-pod keys never reach the schema"),
        ("kubernetes.io/mounterArgs.FsGroup", "per-pod keys never reach the schema"),
    ],
)
def test_a_kubernetes_io_option(name: str, why: str) -> None:
    line = only(lint_schema(with_option(name, {"description": "d", "examples": ["x"]})))
    assert line.startswith(f"option {name!r}: {why}")


@pytest.mark.parametrize(
    "name", ["kubernetes.io/fsType", "kubernetes.io/readwrite", "kubernetes.io/pvOrVolumeName"]
)
def test_kubelet_keys_that_reach_the_schema_may_be_constrained(name: str) -> None:
    assert lint_schema(with_option(name, {"type": "string", "enum": ["", "xfs"]})) == []
    bad = {"type": "string", "enum": ["xfs"], "examples": ["ext4"]}
    assert "does not validate" in only(lint_schema(with_option(name, bad)))


ANCHORED = [
    "^a$",
    "\\Aa\\Z",
    "^(a|b)$",
    "^a$(?!\\n)",
    "^$(?!\\n)|^a+$(?!\\n)",
    "(^a$|^b$)",
    "(?:^a$|^b$)",
    "(?P<x>^a$)",
    "(?i)^a$",
    "^[$|]a\\|$",
    "^(?!.*(^|/)\\.\\.?(/|$(?!\\n)))[a-z]+$(?!\\n)",
]
NOT_ANCHORED = [
    "a",
    "^a",
    "a$",
    "^a|b$",
    "^a$|b",
    "^a$|",
    "(^a$)?",
    "^(a)$|^b+",
    "(?m)^a$",
    "^a\\$",
    "^a[$]",
    "(^a|b$)",
    "^a$|(?!x)b",
]


@pytest.mark.parametrize("pattern", ANCHORED)
def test_anchored_patterns_pass(pattern: str) -> None:
    prop = {"description": "d", "examples": ["a"], "type": "string", "pattern": pattern}
    problems = lint_schema(with_option("opt", prop))
    assert not [p for p in problems if "whole values" in p or "compile" in p], problems


@pytest.mark.parametrize("pattern", NOT_ANCHORED)
def test_unanchored_patterns_fail(pattern: str) -> None:
    prop = {"description": "d", "examples": ["a"], "type": "string", "pattern": pattern}
    problems = [p for p in lint_schema(with_option("opt", prop)) if "does not validate" not in p]
    line = only(problems)
    assert line.startswith(f"option 'opt': pattern {pattern!r} does not match whole values")
    assert "anchor every alternative" in line


def test_patterns_are_found_everywhere_and_located() -> None:
    schema = copy.deepcopy(GOOD)
    schema["$defs"]["loose"] = {"type": "string", "pattern": "[a-z]+"}
    schema["allOf"] = [{"properties": {"directory": {"pattern": "x"}}}]
    schema["properties"]["directory"]["anyOf"] = [{"pattern": "^ok$"}, {"pattern": "no"}]
    schema["properties"]["directory"]["examples"] = ["ok"]
    problems = lint_schema(schema)
    where = sorted(p.split(": pattern", 1)[0] for p in problems)
    assert where == [
        "option 'directory' (at anyOf/1)",
        "schema at $defs/loose",
        "schema at allOf/0/properties/directory",
    ], problems


def test_a_pattern_that_does_not_compile() -> None:
    prop = {"description": "d", "examples": ["a"], "type": "string", "pattern": "^(a$"}
    problems = lint_schema(with_option("opt", prop))
    assert any("pattern '^(a$' does not compile" in p for p in problems), problems


def test_pattern_properties_keys_are_prefixes_not_values() -> None:
    assert "^kubernetes\\.io/" in GOOD["patternProperties"]
    assert lint_schema(GOOD) == []


def test_an_invalid_schema() -> None:
    schema = with_option("opt", {"description": "d", "examples": ["a"], "type": 3})
    problems = lint_schema(schema)
    assert problems[0].startswith("schema: not valid JSON Schema 2020-12 at properties/opt/type")


def test_not_an_object() -> None:
    assert only(lint_schema([])).startswith("schema: is a list, not a JSON object")  # type: ignore[arg-type]
    assert only(lint_schema(with_option("opt", True))).startswith("option 'opt': its schema is")


@pytest.mark.parametrize("backend", [LoopfileBackend, NfsBackend, IscsiBackend])
def test_shipped_schemas_lint_clean(backend: Any) -> None:
    assert lint_schema(backend.schema()) == []


def test_common_schema_patterns_lint_clean() -> None:
    common = json.loads((REPO / "schemas/common.json").read_text("utf-8"))
    assert lint_schema(common) == []


#: The shipped schemas still constrain the kubelet keys they list.
KUBELET_KEY_CASES = [
    (LoopfileBackend, {"file": "a.img"}, "kubernetes.io/fsType", "btrfs"),
    (LoopfileBackend, {"file": "a.img"}, "kubernetes.io/readwrite", "rx"),
    (NfsBackend, {"server": "s1", "share": "/x"}, "kubernetes.io/fsType", "ext4"),
    (NfsBackend, {"server": "s1", "share": "/x"}, "kubernetes.io/readwrite", "RW"),
    (
        IscsiBackend,
        {"targetPortal": "10.0.0.5", "iqn": "iqn.2003-01.org.x:y", "lun": "0"},
        "kubernetes.io/fsType",
        "nfs",
    ),
    (
        IscsiBackend,
        {"targetPortal": "10.0.0.5", "iqn": "iqn.2003-01.org.x:y", "lun": "0"},
        "kubernetes.io/readwrite",
        "x",
    ),
]


@pytest.mark.parametrize(("backend", "options", "key", "bad"), KUBELET_KEY_CASES)
def test_kubelet_keys_are_still_constrained(
    backend: Any, options: dict[str, str], key: str, bad: str
) -> None:
    name = backend.__module__.removeprefix("flexhub_")
    good = {"backend": name, **options}
    validate_options(backend, good)
    with pytest.raises(InvalidOptions) as exc:
        validate_options(backend, {**good, key: bad})
    assert f"$['{key}']" in exc.value.message
