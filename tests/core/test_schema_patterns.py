"""Schema lint: every ``pattern`` of every shipped schema matches the whole value.

jsonschema checks a pattern with Python's ``re.search``, where ``$`` also matches before a
final newline: ``^[a-z]+$`` accepts ``"abc\\n"``. Every anchor is therefore written
``$(?!\\n)`` (the same meaning in ECMA-262, where ``$`` is the end already). The kubelet path
also rejects control characters in every option (tests/core/test_hostile_input.py); these tests
hold the schemas to the rule on their own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

SCHEMA_FILES = [
    *sorted((REPO / "schemas").glob("*.json")),
    REPO / "tests/fixtures/site/flexhub_testbackends/echo.json",
    REPO / "backends/cifs/flexhub_cifs/schema.json",  # a third party's own schema file
]

#: Valid values for every pattern, by (schema file name, JSON pointer of the pattern).
SAMPLES: dict[tuple[str, str], list[str]] = {
    ("common.json", "/$defs/backendName/pattern"): ["loopfile", "my.store-2"],
    ("common.json", "/$defs/quantity/pattern"): ["10Gi", "1073741824", "1.5G"],
    ("common.json", "/$defs/blockMountOptions/pattern"): ["", "noatime", "noatime,discard"],
    ("iscsi.json", "/properties/targetPortal/pattern"): [
        "10.0.0.5:3260",
        "10.0.0.5",
        "[fd00::5]:3260",
        "san.example.com",
    ],
    ("iscsi.json", "/properties/portals/pattern"): ["", "10.0.1.5:3260", "a:1, b:2,[fd00::1]"],
    ("iscsi.json", "/properties/iqn/pattern"): [
        "iqn.2001-05.com.example:storage.db",
        "eui.0123456789abcdef",
        "naa.0123456789abcdef",
    ],
    ("iscsi.json", "/properties/lun/pattern"): ["0", "7", "16383"],
    ("iscsi.json", "/properties/iscsiInterface/pattern"): ["default", "iface0"],
    ("iscsi.json", "/properties/initiatorName/pattern"): ["iqn.2024-01.io.example:node-a"],
    ("loopfile.json", "/properties/file/pattern"): ["vol.img", "db/postgres.img", "a/b.c/d"],
    ("nfs.json", "/properties/server/pattern"): [
        "nfs1.example.com",
        "10.0.0.1",
        "fd00::1",
        "[fd00::1]",
    ],
    ("nfs.json", "/properties/share/pattern"): ["/", "/exports/team", "/a/b..c"],
    ("nfs.json", "/properties/subPath/pattern"): ["", "apps", "apps/web"],
    ("nfs.json", "/properties/subPathMode/pattern"): ["750", "0750", "2775"],
    ("nfs.json", "/properties/mountOptions/pattern"): ["", "hard", "hard,timeo=600,nconnect=4"],
    ("schema.json", "/properties/server/pattern"): ["files.example.com", "10.0.0.7", "a"],
    ("schema.json", "/properties/share/pattern"): ["team", "backups$", "a.b-c_d"],
    ("schema.json", "/properties/subPath/pattern"): ["", "apps", "apps/web"],
    ("schema.json", "/properties/vers/pattern"): ["2.1", "3", "3.1.1", "3.02"],
    ("schema.json", "/properties/mountOptions/pattern"): ["", "seal", "soft,actimeo=1"],
    ("schema.json", "/properties/uid/pattern"): ["0", "1000"],
    ("schema.json", "/properties/gid/pattern"): ["0", "2000"],
    ("schema.json", "/properties/file_mode/pattern"): ["0660", "644"],
    ("schema.json", "/properties/dir_mode/pattern"): ["0770", "755"],
    ("echo.json", "/properties/tag/pattern"): ["t1"],
    ("echo.json", "/properties/size/pattern"): ["4m"],
}


def _patterns(node: Any, pointer: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{pointer}/{key}"
            if key == "pattern" and isinstance(value, str):
                yield here, value
            else:
                yield from _patterns(value, here)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _patterns(value, f"{pointer}/{index}")


def _all_patterns() -> list[tuple[str, str, str]]:
    found = []
    for path in SCHEMA_FILES:
        for pointer, pattern in _patterns(json.loads(path.read_text("utf-8"))):
            found.append((path.name, pointer, pattern))
    return found


PATTERNS = _all_patterns()


def _end_anchors(pattern: str) -> list[int]:
    """Positions of every ``$`` anchor (not escaped, not inside a character class)."""
    positions = []
    in_class = False
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            index += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "$":
            positions.append(index)
        index += 1
    return positions


def test_every_pattern_has_samples() -> None:
    assert PATTERNS
    missing = [(name, ptr) for name, ptr, _ in PATTERNS if (name, ptr) not in SAMPLES]
    assert missing == [], "add valid sample values for these patterns to SAMPLES"


@pytest.mark.parametrize(("name", "pointer", "pattern"), PATTERNS, ids=lambda v: str(v)[:40])
def test_every_end_anchor_refuses_a_final_newline(name: str, pointer: str, pattern: str) -> None:
    anchors = _end_anchors(pattern)
    assert anchors, f"{name}{pointer} has no $ anchor"
    for position in anchors:
        assert pattern[position : position + 7] == "$(?!\\n)", f"{name}{pointer} at {position}"


@pytest.mark.parametrize(("name", "pointer", "pattern"), PATTERNS, ids=lambda v: str(v)[:40])
def test_patterns_match_whole_values_only(name: str, pointer: str, pattern: str) -> None:
    compiled = re.compile(pattern)
    for value in SAMPLES.get((name, pointer), []):
        assert compiled.search(value), f"{name}{pointer} should accept {value!r}"
        for bad in (value + "\n", "\n" + value, value + "\r\n", value + "\nx"):
            assert not compiled.search(bad), f"{name}{pointer} accepts {bad!r}"


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        ("loopfile", {"file": "vol.img", "size": "1Gi"}),
        ("nfs", {"server": "nfs1.example.com", "share": "/exports/team", "subPath": "apps"}),
        (
            "cifs",
            {"server": "files.example.com", "share": "team", "subPath": "a", "vers": "3.0"},
        ),
        (
            "iscsi",
            {"targetPortal": "10.0.0.5:3260", "iqn": "iqn.2001-05.com.example:db", "lun": "0"},
        ),
    ],
)
def test_backend_schema_rejects_a_trailing_newline_in_each_value(
    backend: str, options: dict[str, str]
) -> None:
    """Through flexhub's own validator (the parse step's control-character rule bypassed)."""
    from flexhub.driver.loader import load_backend
    from flexhub.driver.validation import validate_options
    from flexhub.errors import InvalidOptions

    cls = load_backend(backend)
    validate_options(cls, {"backend": backend, **options})
    for key, value in options.items():
        with pytest.raises(InvalidOptions, match=re.escape(key)):
            validate_options(cls, {"backend": backend, **options, key: value + "\n"})


def test_schema_files_are_the_packaged_ones() -> None:
    for backend in ("loopfile", "nfs", "iscsi"):
        link = Path(REPO / f"backends/{backend}/flexhub_{backend}/schema.json")
        assert link.resolve() == (REPO / "schemas" / f"{backend}.json").resolve()
