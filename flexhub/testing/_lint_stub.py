"""STUB, TO BE REPLACED AT MERGE: a minimal ``lint_schema`` used only until the ``scaffold``
branch's ``flexhub/testing/lint.py`` (the real one) is merged; then delete this file and the
fallback import in :mod:`flexhub.testing.conformance`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["lint_schema"]


def lint_schema(schema: Mapping[str, Any]) -> list[str]:
    """One line per problem of a backend's option schema (see the kit contract)."""
    from flexhub.validation import validator_for

    problems: list[str] = []
    properties = schema.get("properties", {})
    for name, prop in properties.items():
        if name.startswith("kubernetes.io/"):
            if name not in ("kubernetes.io/fsType", "kubernetes.io/readwrite"):
                problems.append(f"option {name!r}: a kubernetes.io/ key is kubelet's, not yours")
            continue
        if name == "backend" or not isinstance(prop, Mapping):
            continue
        if not prop.get("description"):
            problems.append(f"option {name!r} has no description")
        examples = prop.get("examples")
        if not examples:
            problems.append(f"option {name!r} has no examples")
        pattern = prop.get("pattern")
        if isinstance(pattern, str) and not (
            (pattern.startswith("^") and (pattern.endswith("$") or "$(?!" in pattern))
            or (pattern.startswith("\\A") and pattern.endswith("\\Z"))
        ):
            problems.append(f"option {name!r}: pattern {pattern!r} does not match whole values")
        for example in examples or []:
            sub = {**prop, "$defs": schema.get("$defs", {})}
            if any(True for _ in validator_for(sub).iter_errors(example)):
                problems.append(f"option {name!r}: example {example!r} does not validate")
    return problems
