"""The Helm chart's values table, generated from ``values.yaml``'s comments.

    python3 deploy/values_table.py            # rewrite the table in the chart's README
    python3 deploy/values_table.py --check    # exit 1 if the README's table is stale

Each row is a value: its dotted key, its default (from ``values.yaml``) and its description
(the comment lines right above the key, then the comment on its line). A key whose
``values.schema.json`` entry lists its own properties (``image``, ``provisioner``...) is a
group: its keys are rows of their own; any other key (``resources``, ``nodeSelector``: free
Kubernetes objects) is one row. Comment lines indented past ``#   `` are an example, kept
whole below the table. :func:`values_table` returns the markdown, for any page to reuse.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parent / "helm" / "flexhub"
README = CHART / "README.md"
START, END = "<!-- values-table:start -->", "<!-- values-table:end -->"
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z][A-Za-z0-9_]*):(?P<rest>.*)$")


@dataclass
class _Entry:
    path: tuple[str, ...]
    text: list[str] = field(default_factory=list)
    example: list[str] = field(default_factory=list)
    #: its value is on its own line (a scalar, ``[]``, ``{a: b}``), not in keys below it
    inline_value: bool = False


def _inline_comment(rest: str) -> str:
    """The comment after a key's value (`` # ...``), if any, outside quotes."""
    quote = ""
    for i, char in enumerate(rest):
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char == "#" and (i == 0 or rest[i - 1] == " "):
            return rest[i + 1 :].strip()
    return ""


def _entries(text: str) -> list[_Entry]:
    """Every key of ``text`` (a values.yaml) in order, with the comments that describe it."""
    entries: list[_Entry] = []
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    example: list[str] = []
    block = False  # inside a block scalar (``nodeConfig: |``)
    block_indent = 0
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip(" "))
        if block:
            if not stripped or indent > block_indent:
                continue
            block = False
        if not stripped:
            comment, example = [], []
            continue
        if stripped.startswith("#"):
            body = stripped[1:]
            if body.startswith("   "):
                example.append(body[1:])
            else:
                comment.append(body.strip())
            continue
        match = _KEY.match(line)
        if match is None:
            continue  # a list item or a continuation: part of a value
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"]))
        entry = _Entry(tuple(key for _, key in stack), list(comment), list(example))
        inline = _inline_comment(match["rest"])
        value = match["rest"].split(" #", 1)[0].strip() if inline else match["rest"].strip()
        entry.inline_value = bool(value)
        if inline:
            entry.text.append(inline)
        entries.append(entry)
        comment, example = [], []
        if match["rest"].strip().startswith(("|", ">")):
            block, block_indent = True, indent
    return entries


def _schema_at(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    node = schema
    for key in path:
        node = node.get("properties", {}).get(key, {})
    return node


def _is_group(schema: dict[str, Any], path: tuple[str, ...]) -> bool:
    return "properties" in _schema_at(schema, path)


def _value(values: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = values
    for key in path:
        node = node[key]
    return node


def _default(values: dict[str, Any], path: tuple[str, ...]) -> str:
    node = _value(values, path)
    if isinstance(node, str) and "\n" in node:
        return "(below)"
    return "`" + json.dumps(node, separators=(", ", ": ")) + "`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def values_table(values_path: Path = CHART / "values.yaml", schema_path: Path | None = None) -> str:
    """The markdown values table of the chart (``| value | default | description |``, as
    docs/reference/chart-values.md has it), then the multi-line defaults and the examples
    its comments give."""
    text = values_path.read_text()
    values = yaml.safe_load(text)
    schema_file = schema_path or values_path.with_name("values.schema.json")
    schema = json.loads(schema_file.read_text())
    rows = ["| value | default | description |", "|---|---|---|"]
    examples: list[str] = []
    inside_leaf: tuple[str, ...] | None = None
    for entry in _entries(text):
        if inside_leaf is not None and entry.path[: len(inside_leaf)] == inside_leaf:
            continue  # a key inside a free object (resources.requests): part of its default
        inside_leaf = None
        key = ".".join(entry.path)
        group = _is_group(schema, entry.path) and not entry.inline_value
        if not group:
            inside_leaf = entry.path
        if group and not entry.text:
            continue
        default = "" if group else _default(values, entry.path)
        if default == "(below)":
            toml = _value(values, entry.path).rstrip("\n")
            examples += ["", f"Default of `{key}`:", "", "```toml", toml, "```"]
        rows.append(f"| `{key}` | {_cell(default)} | {_cell(' '.join(entry.text))} |")
        if entry.example:
            margin = min(len(line) - len(line.lstrip(" ")) for line in entry.example)
            lines = [line[margin:] for line in entry.example]
            examples += ["", f"Example of `{key}`:", "", "```yaml", *lines, "```"]
    return "\n".join(rows + examples) + "\n"


def readme_with_table(readme: str, table: str) -> str:
    """``readme`` with the text between its table markers replaced by ``table``."""
    head, found, rest = readme.partition(START)
    _, found_end, tail = rest.partition(END)
    if not found or not found_end:
        raise SystemExit(f"values_table: {README} has no {START} ... {END} markers")
    return f"{head}{START}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare")
    args = parser.parse_args(argv)
    current = README.read_text()
    wanted = readme_with_table(current, values_table())
    if args.check:
        if current != wanted:
            print(f"{README}: the values table is stale: run python3 deploy/values_table.py")
            return 1
        return 0
    README.write_text(wanted)
    print(README)
    return 0


if __name__ == "__main__":
    sys.exit(main())
