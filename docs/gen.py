"""Write the docs' reference pages from the code, so that nothing is written twice.

    python3 docs/gen.py            # rewrite docs/reference/
    python3 docs/gen.py --check    # exit 1, naming them, when a committed page is stale

What it writes (each page says it is generated and from what):

- ``reference/backends/<name>.md`` for every backend shipped in ``backends/``: the PV options
  table from the backend's JSON Schema (``flexhub schema NAME``) and, for a backend that
  provisions, the StorageClass parameters table from its parameters schema
  (``provision-schema.json``) beside the provisioner's own parameters;
- ``reference/cli.md``: every command of the typer app (``flexhub/cli/``), its arguments and
  options, from the commands themselves;
- ``reference/chart-values.md``: every value of ``deploy/helm/flexhub/values.yaml``, its
  default and the comment above it (or beside it) as its description.

``tests/core/test_docs.py`` regenerates into a temporary directory and fails when a committed
page differs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
COMMON_REF = "https://flexhub.invalid/schemas/common.json#/$defs/"
VALUES = REPO / "deploy" / "helm" / "flexhub" / "values.yaml"

__all__ = ["generate", "main"]


def _cell(text: str) -> str:
    """Text for one table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _code(text: str) -> str:
    if "`" in text:
        return f"`` {text} ``"
    return f"`{text}`" if text else '`""`'


# -- backends -----------------------------------------------------------------------------


def shipped_backends() -> dict[str, str]:
    """name -> ``module:Class`` of every backend in ``backends/*/pyproject.toml``."""
    found: dict[str, str] = {}
    for pyproject in sorted(REPO.glob("backends/*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text("utf-8"))
        points = data.get("project", {}).get("entry-points", {}).get("flexhub.backends", {})
        found.update(points)
    return dict(sorted(found.items()))


def _load_class(target: str) -> type:
    import importlib

    module, _, name = target.partition(":")
    cls: type = getattr(importlib.import_module(module), name)
    return cls


def _common() -> dict[str, Any]:
    common: dict[str, Any] = json.loads((REPO / "schemas" / "common.json").read_text("utf-8"))
    defs: dict[str, Any] = common["$defs"]
    return defs


def _resolved(prop: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    """``prop`` with its ``$ref`` into common.json merged in (its own keys win)."""
    out: dict[str, Any] = {}
    ref = prop.get("$ref", "")
    if ref.startswith(COMMON_REF):
        out.update(defs[ref[len(COMMON_REF) :]])
    out.update({k: v for k, v in prop.items() if k != "$ref"})
    return out


def _values(prop: Mapping[str, Any]) -> str:
    if "const" in prop:
        return _code(str(prop["const"]))
    if "enum" in prop:
        return ", ".join(_code(str(v)) for v in prop["enum"])
    parts = ["string"]
    if "minLength" in prop and prop["minLength"] > 0:
        parts.append(f"at least {prop['minLength']} characters")
    if "maxLength" in prop:
        parts.append(f"at most {prop['maxLength']} characters")
    if "pattern" in prop:
        parts.append("checked by a pattern")
    return ", ".join(parts)


def _options_table(schema: Mapping[str, Any], defs: Mapping[str, Any], *, kubelet: bool) -> str:
    required = set(schema.get("required", ()))
    rows = [
        "| name | required | values | description | examples |",
        "|---|---|---|---|---|",
    ]
    for name, raw in schema.get("properties", {}).items():
        if name.startswith("kubernetes.io/") != kubelet:
            continue
        prop = _resolved(raw, defs)
        examples = ", ".join(_code(str(e)) for e in prop.get("examples", ()))
        rows.append(
            f"| {_code(name)} | {'yes' if name in required else 'no'} | {_cell(_values(prop))} "
            f"| {_cell(prop.get('description', ''))} | {_cell(examples)} |"
        )
    return "\n".join(rows)


def _rules(schema: Mapping[str, Any]) -> list[str]:
    """The schema's rules across options, one line each."""
    lines = []
    for name, needs in schema.get("dependentRequired", {}).items():
        lines.append(f"- {_code(name)} needs {', '.join(_code(n) for n in needs)}.")
    for rule in schema.get("allOf", ()):
        cond = rule.get("if", {}).get("properties", {})
        if len(cond) == 1 and "const" in next(iter(cond.values())):
            key, value = next(iter(cond.items()))
            then = ", ".join(_code(n) for n in rule.get("then", {}).get("required", ()))
            other = ", ".join(_code(n) for n in rule.get("else", {}).get("required", ()))
            line = f"- with {_code(key)} {_code(str(value['const']))}: {then} required"
            lines.append(line + (f"; otherwise {other} required." if other else "."))
        else:
            lines.append(f"- `{json.dumps(rule, sort_keys=True)}`")
    return lines


#: The parameters the provisioner reads itself (flexhub/provisioner/storageclass.py's
#: PROVISIONER_KEYS), described once here.
PROVISIONER_PARAMETERS = {
    "backend": "The backend that makes the claims' storage (required).",
    "onDelete": "What reclaim does with the storage of a released PV ({honoured}; default delete).",
    "secretName": "The Secret the storage side authenticates with (type k8s/flexhub), "
    "recorded on each PV and read again for reclaim and expansion.",
    "secretNamespace": "The namespace of secretName.",
    "fsType": "The PV's fsType; the backend gets it too.",
}


def backend_page(name: str, target: str) -> str:
    from flexhub.provisioner.storageclass import PROVISIONER_KEYS

    if set(PROVISIONER_PARAMETERS) != set(PROVISIONER_KEYS):
        raise SystemExit("docs/gen.py: PROVISIONER_PARAMETERS differs from PROVISIONER_KEYS")
    cls = _load_class(target)
    defs = _common()
    schema: dict[str, Any] = cls.schema()  # type: ignore[attr-defined]
    out = [
        f"# {name}: options and StorageClass parameters",
        "",
        "<!-- generated by docs/gen.py from the backend's schemas: do not edit -->",
        "",
        f"Backend class `{target}`. Every value is a string. The full schema, patterns "
        f"included: `flexhub schema {name}`.",
        "",
        "## PV options",
        "",
        _cell(schema.get("description", "")),
        "",
        _options_table(schema, defs, kubelet=False),
        "",
    ]
    rules = _rules(schema)
    if rules:
        out += ["Rules across options:", "", *rules, ""]
    if any(k.startswith("kubernetes.io/") for k in schema.get("properties", {})):
        out += [
            "Keys kubelet sends that this schema constrains (a manifest never sets them):",
            "",
            _options_table(schema, defs, kubelet=True),
            "",
        ]
    parameters_schema = getattr(cls, "parameters_schema", None)
    if parameters_schema is None:
        out += ["## StorageClass parameters", "", f"`{name}` does not provision.", ""]
        return "\n".join(out)
    params: dict[str, Any] = parameters_schema()
    honoured = ", ".join(sorted(getattr(cls, "on_delete", ())))
    out += [
        "## StorageClass parameters",
        "",
        _cell(params.get("description", "")),
        "",
        f"Reclaim runs on: `{getattr(cls, 'reclaim_on', 'provisioner')}`.",
        "",
        "The provisioner's own parameters:",
        "",
        "| name | description |",
        "|---|---|",
    ]
    for key, text in PROVISIONER_PARAMETERS.items():
        out.append(f"| {_code(key)} | {_cell(text.format(honoured=honoured))} |")
    out += [
        "",
        f"The backend's (`{name}`'s parameters schema):",
        "",
        _options_table(params, defs, kubelet=False),
        "",
    ]
    rules = _rules(params)
    if rules:
        out += ["Rules across parameters:", "", *rules, ""]
    return "\n".join(out)


# -- the CLI --------------------------------------------------------------------------------


def _walk(group: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """Every visible command under ``group`` (typer's click command objects)."""
    for name in sorted(group.commands):
        cmd = group.commands[name]
        if cmd.hidden:
            continue
        yield f"{prefix} {name}", cmd
        if hasattr(cmd, "commands"):
            yield from _walk(cmd, f"{prefix} {name}")


def _is_option(param: Any) -> bool:
    return str(param.param_type_name) == "option"


def _param_row(param: Any) -> str:
    if _is_option(param):
        names = ", ".join(_code(o) for o in [*param.opts, *param.secondary_opts])
    else:
        names = _code(str(param.metavar or param.name).upper())
    help_text = str(getattr(param, "help", None) or "")
    default = ""
    if param.required:
        default = "required"
    elif param.default not in (None, False, (), []):
        default = _code(str(param.default))
    kind = "flag" if getattr(param, "is_flag", False) else _type_name(param)
    return f"| {names} | {_cell(kind)} | {default} | {_cell(help_text)} |"


def _type_name(param: Any) -> str:
    """A plain name of what the parameter takes, from its annotation."""
    import enum
    import types
    import typing

    descriptor = getattr(param, "type_descriptor", None)
    ann = getattr(descriptor, "annotation", None)
    many = ""
    while typing.get_origin(ann) in (list, typing.Union, types.UnionType):
        if typing.get_origin(ann) is list:
            many = " (several)"
        ann = next(a for a in typing.get_args(ann) if a is not type(None))
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return " \\| ".join(str(m.value) for m in ann) + many
    names: dict[Any, str] = {str: "text", int: "integer", float: "number", Path: "path"}
    name = names.get(ann) or str(getattr(ann, "__name__", "") or ann)
    return name + many


def _usage(path: str, cmd: Any, params: list[Any]) -> str:
    words = [path]
    if any(_is_option(p) for p in params):
        words.append("[OPTIONS]")
    if hasattr(cmd, "commands"):
        words.append("COMMAND [ARGS]...")
    for param in params:
        if not _is_option(param):
            name = str(param.metavar or param.name).upper()
            name += "..." if param.nargs == -1 else ""
            words.append(name if param.required else f"[{name}]")
    return " ".join(words)


def cli_page() -> str:
    from typer.main import get_command

    from flexhub.cli.app import app

    root: Any = get_command(app)
    out = [
        "# Command-line reference",
        "",
        "<!-- generated by docs/gen.py from the typer app in flexhub/cli/: do not edit -->",
        "",
        "The commands for people (kubelet's operations are described in "
        "[the kubelet protocol](../backends/protocol.md)). Every command has `-h`/`--help`.",
        "",
        "Global options: " + ", ".join(_code(o) for p in root.params for o in p.opts) + ".",
        "",
    ]
    for path, cmd in _walk(root, "flexhub"):
        params = [p for p in cmd.params if not getattr(p, "hidden", False)]
        out += [f"## `{path}`", "", "```text", _usage(path, cmd, params), "```", ""]
        doc = str(cmd.help or "").strip()
        if doc:
            out += [re.sub(r"\n\s*\n", "\n\n", doc), ""]
        if params:
            out += ["| name | type | default | description |", "|---|---|---|---|"]
            out += [_param_row(p) for p in params]
            out.append("")
    return "\n".join(out)


# -- the chart's values ----------------------------------------------------------------------


def _value_comments(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """dotted key -> its comment (the block above it, then the one beside it), and dotted key
    -> the example in its comment block (the block's indented lines)."""
    comments: dict[str, str] = {}
    examples: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    block: list[str] = []
    example: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("- ") and not stripped.startswith("#")):
            block, example = [], []
            continue
        if stripped.startswith("#"):
            body = stripped[1:]
            body = body[1:] if body.startswith(" ") else body
            if body.startswith(" ") or example:
                example.append(body)
            else:
                block.append(body.strip())
            continue
        match = re.match(r"( *)([A-Za-z][\w.-]*):(.*)", line)
        if not match:
            block, example = [], []
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = ".".join([k for _, k in stack] + [match.group(2)])
        stack.append((indent, match.group(2)))
        rest = match.group(3)
        beside = rest.split(" #", 1)[1].strip() if " #" in rest else ""
        comments[key] = " ".join(part for part in (" ".join(block), beside) if part)
        if example:
            examples[key] = textwrap.dedent("\n".join(example))
        block, example = [], []
    return comments, examples


def _leaves(values: Any, prefix: str, comments: Mapping[str, str]) -> Iterator[tuple[str, Any]]:
    """Every value to list: a mapping whose keys have comments of their own is listed key by
    key (itself only when it has a comment), any other value whole."""
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and any(comments.get(f"{path}.{k}") for k in value):
            if comments.get(path):
                yield path, None
            yield from _leaves(value, f"{path}.", comments)
        else:
            yield path, value


def chart_values_page() -> str:
    text = VALUES.read_text("utf-8")
    values = yaml.safe_load(text)
    comments, examples = _value_comments(text)
    out = [
        "# Helm chart values",
        "",
        "<!-- generated by docs/gen.py from deploy/helm/flexhub/values.yaml: do not edit -->",
        "",
        "The values of the chart `deploy/helm/flexhub`, their defaults and the comments of "
        "`values.yaml`. How they fit together: [Deploying to a cluster]"
        "(../operators/deploy.md).",
        "",
        "| value | default | description |",
        "|---|---|---|",
    ]
    blocks = []
    for path, value in _leaves(values, "", comments):
        if value is None:
            default = ""
        elif isinstance(value, str) and "\n" in value:
            default = "(below)"
            blocks += ["", f"Default of `{path}`:", "", "```toml", value.rstrip("\n"), "```"]
        else:
            default = _code(json.dumps(value))
        if path in examples:
            blocks += ["", f"Example of `{path}`:", "", "```yaml", examples[path], "```"]
        out.append(f"| {_code(path)} | {_cell(default)} | {_cell(comments.get(path, ''))} |")
    out += [*blocks, ""]
    return "\n".join(out)


# -- all of it ------------------------------------------------------------------------------


def generate() -> dict[str, str]:
    """Every generated page: its path under docs/ -> its text."""
    pages = {
        f"reference/backends/{name}.md": backend_page(name, target)
        for name, target in shipped_backends().items()
    }
    pages["reference/cli.md"] = cli_page()
    pages["reference/chart-values.md"] = chart_values_page()
    return {path: text.rstrip("\n") + "\n" for path, text in pages.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail on a stale page")
    parser.add_argument("--out", type=Path, default=DOCS, help="docs directory (default docs/)")
    args = parser.parse_args(argv)
    stale = []
    for path, text in generate().items():
        target = args.out / path
        old = target.read_text("utf-8") if target.exists() else None
        if old == text:
            continue
        if args.check:
            stale.append(path)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, "utf-8")
    if stale:
        print(f"stale docs pages (run python3 docs/gen.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
