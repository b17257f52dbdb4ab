"""Validate a call's options against its backend's JSON Schema (draft 2020-12).

Secrets (``kubernetes.io/secret/*``) are removed before validation, so no schema error can
ever quote one. ``$ref`` s resolve only inside flexhub's own registry: never the network.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import flexhub
from flexhub.driver.memo import Memo, environment_fingerprint
from flexhub.errors import BackendError, InvalidOptions
from flexhub.node.fastpath import sha256
from flexhub.volume import PER_POD_KEYS, SECRET_PREFIX

if TYPE_CHECKING:
    from jsonschema.exceptions import ValidationError
    from referencing import Registry

    from flexhub.backend import Backend

__all__ = [
    "COMMON_SCHEMA_ID",
    "common_schema",
    "describe_error",
    "schema_problems",
    "validate_options",
]

COMMON_SCHEMA_ID = "https://flexhub.invalid/schemas/common.json"
_SHOWN_VALUE = 60
#: The bound the common schema puts on kubelet's keys, applied by the core to the per-pod ones.
MAX_KUBELET_VALUE = 4096
#: Bumped whenever what a validation memo stands for changes.
_MEMO_VERSION = "flexhub-validation-1"


@lru_cache(maxsize=1)
def common_schema() -> dict[str, Any]:
    """The shared definitions every backend schema may ``$ref``."""
    from importlib import resources

    text = resources.files("flexhub").joinpath("schemas/common.json").read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def _registry(schema: Mapping[str, Any]) -> Registry:
    from referencing import Registry, Resource
    from referencing.exceptions import NoSuchResource
    from referencing.jsonschema import DRAFT202012

    def refuse(uri: str) -> Resource:
        raise NoSuchResource(ref=uri)  # type: ignore[call-arg]

    resources_ = [Resource.from_contents(common_schema(), default_specification=DRAFT202012)]
    if "$id" in schema:
        resources_.append(Resource.from_contents(schema, default_specification=DRAFT202012))
    pairs = [(uri, r) for r in resources_ if (uri := r.id())]
    registry: Registry = Registry(retrieve=refuse).with_resources(pairs)  # type: ignore[call-arg]
    return registry


def validator_for(schema: Mapping[str, Any]) -> Any:
    from jsonschema import Draft202012Validator

    return Draft202012Validator(
        schema,
        registry=_registry(schema),
        format_checker=Draft202012Validator.FORMAT_CHECKER,
    )


def validate_options(
    backend: type[Backend], options: Mapping[str, str], memo: Memo | None = None
) -> None:
    """Validate ``options`` (all strings, as parsed from kubelet's JSON) for ``backend``.

    The schema sees the options without secrets and without the per-pod keys
    (:data:`~flexhub.volume.PER_POD_KEYS`, which the core bounds itself), so every pod of a
    volume validates the same object. With ``memo``, an object already found valid under the
    same schema, backend and installed distributions is not validated again, and jsonschema
    is not even imported.

    :raises InvalidOptions: one line naming the JSON path and what was expected.
    :raises BackendError: the backend's schema itself is broken.
    """
    for key in PER_POD_KEYS:
        if len(options.get(key, "")) > MAX_KUBELET_VALUE:
            raise InvalidOptions(
                f"invalid option $['{key}']: too long (maxLength {MAX_KUBELET_VALUE})"
            )
    public = {
        k: v
        for k, v in options.items()
        if not k.startswith(SECRET_PREFIX) and k not in PER_POD_KEYS
    }
    mark = _memo_key(backend, public) if memo is not None else ""
    if memo is not None and memo.has_mark(mark):
        return
    _validate(backend, public)
    if memo is not None:
        memo.put_mark(mark)


def _memo_key(backend: type[Backend], public: Mapping[str, str]) -> str:
    """The digest of everything a validation result depends on."""
    material = [
        _MEMO_VERSION,
        flexhub.__version__,
        f"{backend.__module__}:{backend.__qualname__}",
        _schema_source(backend),
        _read(Path(flexhub.__file__).parent / "schemas" / "common.json"),
        sorted(public.items()),
        environment_fingerprint(),
    ]
    encoded = json.dumps(material, sort_keys=True, ensure_ascii=True).encode("ascii")
    return sha256(encoded).hexdigest()


def _read(path: Path) -> str:
    try:
        return path.read_text("utf-8")
    except (OSError, ValueError):
        return ""


def _schema_source(backend: type[Backend]) -> str:
    """The backend's schema text: its file when the backend uses the default loader."""
    from flexhub.backend import Backend

    module = sys.modules.get(backend.schema_package or backend.__module__)
    path = getattr(module, "__file__", None)
    default_loader = getattr(backend.schema, "__func__", None) is Backend.schema.__func__  # type: ignore[attr-defined]
    if path and default_loader:
        text = _read(Path(path).parent / backend.schema_file)
        if text:
            return text
    return json.dumps(backend.schema(), sort_keys=True)


def _validate(backend: type[Backend], public: Mapping[str, str]) -> None:
    schema = backend.schema()
    from jsonschema.exceptions import SchemaError, best_match
    from referencing.exceptions import Unresolvable

    try:
        validator = validator_for(schema)
        error = best_match(validator.iter_errors(public))
    except (SchemaError, Unresolvable) as exc:
        raise BackendError(f"backend schema is broken: {type(exc).__name__}: {exc}") from None
    if error is not None:
        raise InvalidOptions(describe_error(error, schema))


def _show(value: object) -> str:
    text = repr(value)
    if len(text) > _SHOWN_VALUE:
        text = text[: _SHOWN_VALUE - 4] + "...'"
    return text


def describe_error(error: ValidationError, schema: Mapping[str, Any]) -> str:
    """Render one validation error as a short line a PV author can act on."""
    path = error.json_path
    kind = error.validator
    detail: str
    if kind == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        extras = sorted(set(error.instance) - set(allowed))
        extras = [e for e in extras if not e.startswith("kubernetes.io/")]
        name = extras[0] if extras else "?"
        import difflib

        hint = difflib.get_close_matches(name, allowed, n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        known = ", ".join(allowed)
        return f"invalid options: unknown option {name[:80]!r}{suggestion}; known: {known}"
    if kind == "required":
        missing = [r for r in error.validator_value if r not in error.instance]
        return (
            f"invalid options: missing required option {missing[0]!r}"
            if missing
            else str(error.message)
        )
    if kind == "enum":
        choices = ", ".join(repr(c) for c in error.validator_value)
        detail = f"must be one of {choices}, not {_show(error.instance)}"
    elif kind == "const":
        detail = f"must be {error.validator_value!r}, not {_show(error.instance)}"
    elif kind == "type":
        detail = f"must be a {error.validator_value}, not {type(error.instance).__name__}"
    elif kind == "pattern":
        description = error.schema.get("description") if isinstance(error.schema, dict) else None
        expected = description or f"text matching {error.validator_value}"
        detail = f"{_show(error.instance)} is not valid: expected {expected}"
    elif kind in ("maxLength", "minLength"):
        detail = (
            f"{'too long' if kind == 'maxLength' else 'too short'} ({kind} {error.validator_value})"
        )
    else:
        detail = error.message if len(error.message) < 200 else error.message[:197] + "..."
    return f"invalid option {path}: {detail}"


def schema_problems(
    backend: type[Backend] | None,
    options: Mapping[str, str],
    name: str = "",
    *,
    schema: Mapping[str, Any] | None = None,
    noun: str = "option",
) -> list[tuple[str, str]]:
    """Every schema error of ``options`` (secrets and per-pod keys left out, as on a call), as
    ``(option key or "", text)`` in the options' order, for ``flexhub validate``.

    The text does not repeat the key; a long allow-list is summarised (``flexhub schema
    NAME`` prints it), and a comma-separated value names the items that are not allowed.

    :param schema: another schema than the backend's options schema (a StorageClass's
        parameters schema); ``noun`` is what its keys are called (``unknown parameter``).
    :raises BackendError: the schema itself is broken.
    """
    public = {
        k: v
        for k, v in options.items()
        if not k.startswith(SECRET_PREFIX) and k not in PER_POD_KEYS
    }
    if schema is None:
        if backend is None:
            raise BackendError("schema_problems needs a backend or a schema")
        schema = backend.schema()
    from jsonschema.exceptions import SchemaError
    from referencing.exceptions import Unresolvable

    try:
        errors = list(validator_for(schema).iter_errors(public))
    except (SchemaError, Unresolvable) as exc:
        raise BackendError(f"backend schema is broken: {type(exc).__name__}: {exc}") from None
    allowed = sorted(k for k in schema.get("properties", {}) if not k.startswith("kubernetes.io/"))
    found: list[tuple[str, str]] = []
    for error in errors:
        found.extend(_problems(error, allowed, name, noun))
    order = {key: i for i, key in enumerate(options)}
    unique = list(dict.fromkeys(found))
    return sorted(unique, key=lambda p: order.get(p[0], -1))


def _problems(
    error: ValidationError, allowed: list[str], name: str, noun: str = "option"
) -> list[tuple[str, str]]:
    kind = error.validator
    if kind == "additionalProperties":
        extras = sorted(set(error.instance) - set(allowed))
        extras = [e for e in extras if not e.startswith("kubernetes.io/")]
        out = []
        for extra in extras:
            import difflib

            hint = difflib.get_close_matches(extra, allowed, n=1)
            text = f"unknown {noun}, did you mean {hint[0]}?" if hint else f"unknown {noun}"
            if not hint:
                text += f" (known: {_summary(allowed, name)})"
            out.append((extra, text))
        return out
    if kind == "required":
        missing = [r for r in error.validator_value if r not in error.instance]
        return [(m, "required") for m in missing]
    key = str(error.path[0]) if error.path else ""
    if kind == "enum":
        choices = ", ".join(_quoted(c) for c in error.validator_value)
        return [(key, f"must be one of {choices}, not {_quoted(error.instance)}")]
    if kind == "pattern":
        description = error.schema.get("description") if isinstance(error.schema, dict) else None
        expected = _short(str(description), name) if description else "another form"
        value = str(error.instance)
        bad = _unmatched_items(str(error.validator_value), value)
        if bad:
            shown = ", ".join(_quoted(b) for b in bad[:5])
            return [(key, f"{shown} not allowed: expected {expected}")]
        return [(key, f"{_show(value)} is not valid: expected {expected}")]
    if kind in ("maxLength", "minLength"):
        word = "too long" if kind == "maxLength" else "too short"
        return [(key, f"{word} ({kind} {error.validator_value})")]
    if kind == "type":
        return [(key, f"must be a {error.validator_value}")]
    message = error.message if len(error.message) < 200 else error.message[:197] + "..."
    return [(key, message)]


def _quoted(value: object) -> str:
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= _SHOWN_VALUE else text[: _SHOWN_VALUE - 4] + '..."'


def _summary(items: list[str], name: str, limit: int = 8) -> str:
    if len(items) <= limit:
        return ", ".join(items)
    where = f"flexhub schema {name}" if name else "flexhub schema BACKEND"
    return f"{', '.join(items[:limit])}, ... ({len(items)} in all: {where})"


def _short(description: str, name: str) -> str:
    """A schema description, an allow-list (``...allow-list: a, b, c (note)``) cut to the
    count of its items; any other description whole (its commas are no list of values)."""
    head, _, rest = description.partition(": ")
    if len(description) <= 120 or not rest or "allow-list" not in head:
        return description
    if rest.endswith(")") and " (" in rest:  # a closing note is not one of the items
        rest = rest[: rest.rindex(" (")]
    count = len([item for item in rest.split(",") if item.strip()])
    where = f"flexhub schema {name}" if name else "flexhub schema BACKEND"
    return f"{head} ({count} allowed; {where} lists them)"


def _unmatched_items(pattern: str, value: str) -> list[str]:
    """For a comma-separated ``value``: the items that fail ``pattern`` alone (``[]`` when
    that does not explain the failure, or the pattern is not Python's)."""
    import re

    if "," not in value:
        return []
    try:
        compiled = re.compile(pattern)
    except re.error:
        return []
    items = [item for item in value.split(",") if item]
    bad = [item for item in items if not compiled.search(item)]
    return bad if bad and len(bad) < len(items) else []


def check_backend_schema(backend: type[Backend]) -> None:
    """Meta-validate a backend's schema (tests and ``flexhub backends``, not per call)."""
    from jsonschema import Draft202012Validator

    Draft202012Validator.check_schema(backend.schema())
