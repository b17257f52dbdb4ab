"""``flexhub validate``: find flexhub volumes in manifests and validate their options."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from flexhub.errors import FlexhubError

__all__ = ["flex_volumes", "kubelet_key_error", "options_as_kubelet_sends", "validate_file"]


def _load_documents(path: Path) -> list[Any]:
    text = sys.stdin.read() if str(path) == "-" else path.read_text("utf-8")
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            return [json.loads(text)]
        except ValueError:
            pass
    import yaml

    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise FlexhubError(f"{path}: not valid YAML or JSON: {exc}") from None


def flex_volumes(doc: Any, driver: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Yield ``(where, flexVolume)`` for every flexVolume of ``driver`` in a manifest."""
    if not isinstance(doc, dict):
        return
    kind = doc.get("kind", "")
    name = (doc.get("metadata") or {}).get("name", "?")
    if kind == "List":
        for item in doc.get("items") or []:
            yield from flex_volumes(item, driver)
        return
    spec = doc.get("spec") or {}
    if not isinstance(spec, dict):
        return
    flex = spec.get("flexVolume")
    if isinstance(flex, dict) and flex.get("driver") == driver:
        yield f"{kind or 'object'}/{name}", flex
    pod_specs = [spec]
    template = spec.get("template") or (spec.get("jobTemplate") or {}).get("spec", {}).get(
        "template"
    )
    if isinstance(template, dict):
        pod_specs.append(template.get("spec") or {})
    for pod_spec in pod_specs:
        for volume in pod_spec.get("volumes") or []:
            if not isinstance(volume, dict):
                continue
            flex = volume.get("flexVolume")
            if isinstance(flex, dict) and flex.get("driver") == driver:
                yield f"{kind or 'object'}/{name} volume {volume.get('name', '?')}", flex


def options_as_kubelet_sends(flex: Mapping[str, Any], volume_name: str = "") -> dict[str, Any]:
    """The options object kubelet would build for ``mount`` (without pod keys and secrets)."""
    options: dict[str, Any] = {
        "kubernetes.io/fsType": flex.get("fsType") or "",
        "kubernetes.io/readwrite": "ro" if flex.get("readOnly") else "rw",
        "kubernetes.io/pvOrVolumeName": volume_name,
    }
    user = flex.get("options") or {}
    if isinstance(user, dict):
        options.update(user)
    return options


def kubelet_key_error(flex: Mapping[str, Any]) -> str:
    """The error for user options that set a ``kubernetes.io/`` key, or ``""``.

    kubelet merges the user's options last, over its own keys (pod namespace and uid,
    readwrite, secrets, fsGroup), so such an option would lie to flexhub about the pod. The
    admission policy in ``deploy/admission-policy.yaml`` rejects the same volumes.
    """
    user = flex.get("options") or {}
    if not isinstance(user, dict):
        return ""
    keys = sorted(k for k in user if isinstance(k, str) and k.startswith("kubernetes.io/"))
    if not keys:
        return ""
    return (
        f"option {keys[0][:80]!r} is kubelet's: a volume's options must not set "
        "kubernetes.io/ keys (kubelet merges the options last, over its own)"
    )


def validate_options_object(options: Any) -> str:
    """Validate one options object; return the error text or ``""``."""
    from flexhub.driver.call import Call
    from flexhub.driver.kubelet import parse_options
    from flexhub.driver.loader import load_backend
    from flexhub.driver.validation import validate_options
    from flexhub.volume import Volume

    try:
        parsed = parse_options(json.dumps(options), Call("validate"))
        backend = load_backend(parsed.get("backend"))
        validate_options(backend, parsed)
        backend.check_options(Volume.from_options(parsed))
    except FlexhubError as exc:
        return exc.message
    return ""


def validate_file(path: Path, driver: str) -> list[tuple[str, str]]:
    """Validate every flexhub volume in ``path``; returns ``(where, error or "")`` pairs."""
    results: list[tuple[str, str]] = []
    for doc in _load_documents(path):
        if isinstance(doc, dict) and "kind" not in doc and "apiVersion" not in doc:
            results.append((f"{path}", validate_options_object(doc)))
            continue
        for where, flex in flex_volumes(doc, driver):
            name = where.rsplit(" ", 1)[-1] if " volume " in where else where.split("/", 1)[-1]
            error = kubelet_key_error(flex) or validate_options_object(
                options_as_kubelet_sends(flex, name)
            )
            results.append((where, error))
    return results
