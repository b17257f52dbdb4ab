"""Lint a backend's JSON Schema for what PV authors and flexhub need from it.

A test-time tool (the conformance kit's ``test_schema_lint``, a backend's own tests), never
imported on the kubelet path, so it may use jsonschema. The rules:

* every option (a key of ``properties``, except ``backend``, which is the core's routing key)
  has a non-empty ``description`` and at least one example in ``examples``, every example is a
  string (kubelet sends only strings) and validates against the option's schema;
* every ``pattern`` anywhere in the schema matches whole values: each top-level alternative
  starts with ``^`` (or ``\\A``) and ends with ``$`` (or ``\\Z``), optionally followed by
  lookarounds such as ``(?!\\n)``;
* no option is named ``kubernetes.io/...``: those keys are kubelet's (a PV that sets one is
  refused by flexhub's admission policy). The keys kubelet sends that reach the schema
  (``kubernetes.io/fsType``, ``/readwrite``, ``/pvOrVolumeName``) may be listed to constrain
  them (no description or examples needed); secrets and the per-pod keys never reach it;
* the schema itself is valid JSON Schema draft 2020-12.

.. versionadded:: 0.2
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["lint_schema"]

#: The option every backend schema has, documented by flexhub itself.
_ROUTING_KEY = "backend"
_KUBELET_PREFIX = "kubernetes.io/"
#: kubelet's keys that reach the backend's schema, which may constrain them (no description or
#: examples needed: PV authors never write them).
_KUBELET_VALIDATED = frozenset(
    {"kubernetes.io/fsType", "kubernetes.io/readwrite", "kubernetes.io/pvOrVolumeName"}
)
_SHOWN = 50

#: Keywords whose value is one subschema, a list of them, or a name-to-subschema mapping.
_ONE = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")
_START = ("^", "\\A")
_END = ("$", "\\Z", "\\z")
_QUANTIFIERS = ("?", "*", "+", "{")


def lint_schema(schema: Mapping[str, Any]) -> list[str]:
    """Return one line per problem of ``schema`` (an empty list: it is clean).

    Each line names the option (or the schema location) and what to fix, for example
    ``option 'server': no examples; add "examples": ["nfs1.example.com"]``.
    """
    if not isinstance(schema, Mapping):
        return [f"schema: is a {type(schema).__name__}, not a JSON object; write an object"]
    problems, usable = _meta_problems(schema)  # examples validate only in a valid schema
    properties = schema.get("properties", {})
    if not isinstance(properties, Mapping):
        problems.append("schema: 'properties' is not an object; map each option to its schema")
        properties = {}
    for name, prop in properties.items():
        problems.extend(_option_problems(schema, str(name), prop, usable))
    for where, pattern in _patterns(schema, ()):
        problem = _pattern_problem(pattern)
        if problem:
            problems.append(f"{_describe(where)}: {problem}")
    return problems


def _meta_problems(schema: Mapping[str, Any]) -> tuple[list[str], bool]:
    """Where ``schema`` is not valid JSON Schema 2020-12, and whether it is usable at all.

    Invalid ``examples`` and ``pattern`` keywords are left to the more precise rules below.
    """
    from jsonschema import Draft202012Validator

    meta = Draft202012Validator(
        Draft202012Validator.META_SCHEMA, format_checker=Draft202012Validator.FORMAT_CHECKER
    )
    errors = list(meta.iter_errors(schema))
    problems = [
        f"schema: not valid JSON Schema 2020-12 at {'/'.join(map(str, e.path)) or '(root)'}: "
        f"{_short(e.message, 120)}; fix that keyword"
        for e in errors
        if not (e.path and e.path[-1] in ("examples", "pattern"))
    ]
    return problems, not errors


def _option_problems(schema: Mapping[str, Any], name: str, prop: Any, usable: bool) -> list[str]:
    where = f"option {name!r}"
    kubelets = name.startswith(_KUBELET_PREFIX)
    if kubelets and name not in _KUBELET_VALIDATED:
        return [f"{where}: {_kubelet_key_problem(name)}"]
    if not isinstance(prop, Mapping):
        return [
            f"{where}: its schema is {prop!r}, not an object; give it a type, a "
            "description and examples"
        ]
    problems: list[str] = []
    routing = name == _ROUTING_KEY or kubelets  # not written by PV authors
    description = prop.get("description")
    if not routing and not (isinstance(description, str) and description.strip()):
        problems.append(
            f'{where}: no description; add "description": what it means, its default and '
            "its format, for PV authors"
        )
    examples = prop.get("examples")
    if examples is None:
        if not routing:
            hint = (
                " (\"example\" is OpenAPI's, JSON Schema's is a list)" if "example" in prop else ""
            )
            problems.append(f'{where}: no examples{hint}; add "examples": ["<a valid value>"]')
        return problems
    if not isinstance(examples, list) or not examples:
        problems.append(f'{where}: "examples" must be a non-empty list; add ["<a valid value>"]')
        return problems
    validator = _validator(schema, prop) if usable else None
    if isinstance(validator, str):
        problems.append(f"{where}: its schema cannot be used ({validator}); fix it")
        return problems
    for example in examples:
        if not isinstance(example, str):
            problems.append(
                f"{where}: example {_show(example)} is a {type(example).__name__}; option "
                "values are strings (kubelet sends strings), quote it"
            )
            continue
        if validator is None:
            continue
        errors = _errors(validator, example)
        if isinstance(errors, str):
            problems.append(f"{where}: its schema cannot be used ({errors}); fix it")
        elif errors:
            problems.append(
                f"{where}: example {_show(example)} does not validate "
                f"({_short(errors[0].message, 100)}); fix the example or the schema"
            )
    return problems


def _kubelet_key_problem(name: str) -> str:
    from flexhub.volume import PER_POD_KEYS, SECRET_PREFIX

    if name.startswith(SECRET_PREFIX):
        return (
            "secrets are removed before validation, a schema never sees them; drop it and "
            "check secrets in the backend's check()"
        )
    if name in PER_POD_KEYS:
        return "per-pod keys never reach the schema (the core bounds them); drop it"
    return (
        "kubelet never sends this kubernetes.io/ key and a PV may not set one; name your "
        "option without the prefix"
    )


def _validator(schema: Mapping[str, Any], prop: Mapping[str, Any]) -> Any:
    """A validator of ``prop`` that resolves ``$ref`` s as flexhub does (or an error text)."""
    from jsonschema.exceptions import SchemaError
    from referencing.exceptions import Unresolvable

    from flexhub.driver.validation import validator_for

    try:
        validator = validator_for(schema).evolve(schema=prop)
    except (SchemaError, Unresolvable) as exc:
        return f"{type(exc).__name__}: {_short(str(exc), 100)}"
    probe = _errors(validator, "")  # resolves every $ref once
    return probe if isinstance(probe, str) else validator


def _errors(validator: Any, example: str) -> list[Any] | str:
    """The validation errors of ``example``, or why the schema could not be applied."""
    try:
        return sorted(validator.iter_errors(example), key=lambda e: list(e.path))
    except Exception as exc:  # an unusable schema is a finding, never a crash of the lint
        return f"{type(exc).__name__}: {_short(str(exc), 100)}"


def _patterns(node: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every ``pattern`` keyword of the schema ``node``, with where it is."""
    if not isinstance(node, Mapping):
        return
    if "pattern" in node:
        yield path, node["pattern"]
    for key in _ONE:
        if key in node:
            yield from _patterns(node[key], (*path, key))
    for key in _LIST:
        value = node.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                yield from _patterns(sub, (*path, key, str(i)))
    for key in _MAP:
        value = node.get(key)
        if isinstance(value, Mapping):
            for name, sub in value.items():
                yield from _patterns(sub, (*path, key, str(name)))


def _describe(path: tuple[str, ...]) -> str:
    if len(path) >= 2 and path[0] == "properties":
        rest = "/".join(path[2:])
        return f"option {path[1]!r}" + (f" (at {rest})" if rest else "")
    return "schema at " + ("/".join(path) or "(root)")


def _pattern_problem(pattern: Any) -> str:
    if not isinstance(pattern, str):
        return f"pattern {pattern!r} is not a string; write a regular expression"
    try:
        re.compile(pattern)
    except re.error as exc:
        return f"pattern {_show(pattern)} does not compile ({exc}); fix the expression"
    if not _anchored(pattern):
        return (
            f"pattern {_show(pattern)} does not match whole values (a pattern is searched "
            "anywhere in the value); anchor every alternative: ^(...)$, or ^...$(?!\\n) "
            "to refuse a trailing newline too"
        )
    return ""


def _anchored(pattern: str) -> bool:
    """Whether every top-level alternative of ``pattern`` is anchored at both ends."""
    tokens = _tokens(pattern)
    if tokens is None:
        return False
    alternatives: list[list[str]] = [[]]
    for token in tokens:
        if token == "|":
            alternatives.append([])
        else:
            alternatives[-1].append(token)
    return all(_alternative_anchored(alt) for alt in alternatives)


def _alternative_anchored(tokens: list[str]) -> bool:
    tokens = list(tokens)
    while tokens and _is_flags(tokens[0]):
        if "m" in tokens[0].split(")", 1)[0]:  # multi-line: ^ and $ match at every line
            return False
        tokens.pop(0)
    while tokens and tokens[-1].startswith(_LOOKAROUND):
        tokens.pop()
    if len(tokens) == 1 and tokens[0].startswith("(") and not tokens[0].startswith("(?"):
        return _anchored(tokens[0][1:-1])
    if len(tokens) == 1 and tokens[0].startswith(("(?:", "(?P<")):
        inner = tokens[0][3:-1] if tokens[0].startswith("(?:") else tokens[0].split(">", 1)[1][:-1]
        return _anchored(inner)
    if len(tokens) < 2 or tokens[0] not in _START or tokens[-1] not in _END:
        return False
    return not tokens[1].startswith(_QUANTIFIERS)


def _is_flags(token: str) -> bool:
    return re.fullmatch(r"\(\?[aiLmsux]+\)", token) is not None


def _tokens(pattern: str) -> list[str] | None:
    """Split ``pattern`` into top-level atoms: escapes, classes, groups, single characters."""
    tokens: list[str] = []
    i = 0
    while i < len(pattern):
        end = _atom_end(pattern, i)
        if end is None:
            return None
        tokens.append(pattern[i:end])
        i = end
    return tokens


def _atom_end(pattern: str, i: int) -> int | None:
    char = pattern[i]
    if char == "\\":
        return i + 2 if i + 1 < len(pattern) else None
    if char == "[":
        return _class_end(pattern, i)
    if char == "(":
        depth = 0
        j = i
        while j < len(pattern):
            c = pattern[j]
            if c == "\\":
                j += 2
                continue
            if c == "[":
                end = _class_end(pattern, j)
                if end is None:
                    return None
                j = end
                continue
            if c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    return i + 1


def _class_end(pattern: str, i: int) -> int | None:
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    while j < len(pattern):
        if pattern[j] == "\\":
            j += 2
            continue
        if pattern[j] == "]":
            return j + 1
        j += 1
    return None


def _show(value: object) -> str:
    return _short(repr(value), _SHOWN)


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
