"""Read a flexhub StorageClass: what the provisioner needs of it, every mistake one line.

A StorageClass is read as a plain dict (``yaml.safe_load`` of a manifest, or the kubernetes
client's ``ApiClient().sanitize_for_serialization``). :func:`read_class` returns its
:class:`ClassSpec` or raises :class:`~flexhub.errors.InvalidOptions` with ONE line that starts
with the field at fault (``parameters.onDelete: ...``): the provisioner turns it into a
``ProvisioningFailed`` Event on the claim, and ``flexhub validate`` prints every problem
(:func:`class_problems`) in the same words.

The provisioner's own parameters are :data:`PROVISIONER_KEYS`; every other parameter is the
backend's, validated against its ``provision-schema.json``
(:meth:`~flexhub.provisioning.Provisioning.parameters_schema`) and its
:meth:`~flexhub.provisioning.Provisioning.check_parameters`. ``fsType`` is both: the
provisioner puts it on the PV, and the backend gets it too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from flexhub.errors import FlexhubError, InvalidOptions

__all__ = [
    "PROVISIONER_KEYS",
    "PROVISIONER_NAME",
    "ClassSpec",
    "class_problems",
    "read_class",
]

#: The ``provisioner`` of every StorageClass flexhub serves.
PROVISIONER_NAME = "flexhub"
#: The parameters the provisioner reads itself.
PROVISIONER_KEYS = frozenset({"backend", "onDelete", "secretName", "secretNamespace", "fsType"})
#: Those the backend gets too: ``fsType`` always, the Secret's name and namespace when its
#: parameters schema lists them (otherwise the provisioner alone reads them).
PASSED_ON = frozenset({"fsType", "secretName", "secretNamespace"})
#: Every ``onDelete`` flexhub knows; a backend honours some (``Provisioning.on_delete``).
ON_DELETE = ("delete", "retain", "archive")
WAIT = "WaitForFirstConsumer"

_BACKEND_NAME = re.compile(r"[a-z0-9_.-]{1,63}")
_SHOWN = 80


@dataclass(frozen=True)
class ClassSpec:
    """What the provisioner needs of one StorageClass.

    :param parameters: what the backend gets: every parameter but the provisioner's, plus
        ``fsType`` when set and :data:`PASSED_ON` keys its schema lists.
    :param on_delete: ``delete`` (default), ``retain`` or ``archive``.
    :param secret: ``(namespace, name)`` from ``secretNamespace``/``secretName``, or ``None``.
    :param reclaim_on: the backend's ``Provisioning.reclaim_on`` (``provisioner`` or ``node``).
    """

    name: str
    backend: str
    parameters: Mapping[str, str]
    on_delete: str
    secret: tuple[str, str] | None
    fs_type: str
    reclaim_on: str


def read_class(sc: Mapping[str, Any], backend_class_for: Callable[[str], type]) -> ClassSpec:
    """The :class:`ClassSpec` of the StorageClass ``sc``.

    :param backend_class_for: the backend class registered under a name
        (:func:`flexhub.driver.loader.load_backend`); an unknown name raises a
        :class:`~flexhub.errors.FlexhubError` or :class:`LookupError`.
    :raises InvalidOptions: the first mistake of the class, one line naming its field.
    :raises BackendError: an installed backend fails to import or its schema is broken (not
        the class's fault: retried).
    """
    spec, problems = class_problems(sc, backend_class_for)
    if problems or spec is None:
        raise InvalidOptions(problems[0] if problems else "not a flexhub StorageClass")
    return spec


def class_problems(
    sc: Mapping[str, Any], backend_class_for: Callable[[str], type]
) -> tuple[ClassSpec | None, list[str]]:
    """``(spec, [])`` for a good class, ``(None, every problem found)`` otherwise, each one
    line starting with its field (checks that need the backend stop at a backend problem).

    :raises BackendError: as :func:`read_class`.
    """
    from flexhub.provisioning import NODE, Provisioning

    if not isinstance(sc, Mapping):
        return None, ["not a StorageClass object"]
    metadata = sc.get("metadata")
    name = str(metadata.get("name", "")) if isinstance(metadata, Mapping) else ""
    kind = sc.get("kind")
    if kind is not None and kind != "StorageClass":
        return None, [f"kind: {_quoted(kind)} is not a StorageClass"]
    provisioner = sc.get("provisioner")
    if provisioner != PROVISIONER_NAME:
        return None, [f"provisioner: {_quoted(provisioner)} is not {PROVISIONER_NAME!r}"]
    problems: list[str] = []
    raw = sc.get("parameters")
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        return None, ["parameters: must be a map of strings"]
    parameters: dict[str, str] = {}
    for key, value in raw.items():
        if isinstance(value, str):
            parameters[str(key)] = value
        else:
            problems.append(f"{_path(str(key))}: must be a string, not {_kind(value)} (quote it)")
    backend = parameters.get("backend", "")
    cls = _backend_class(backend, "backend" in raw, backend_class_for, problems)
    if cls is None:
        return None, problems
    if not (isinstance(cls, type) and issubclass(cls, Provisioning)):
        problems.append(
            f"parameters.backend: backend {backend!r} cannot provision volumes "
            "(it does not mix in flexhub.provisioning.Provisioning): make its PVs by hand"
        )
        return None, problems
    on_delete = parameters.get("onDelete", "delete")
    honoured = sorted({"delete", *cls.on_delete})
    if on_delete not in ON_DELETE:
        problems.append(
            f"parameters.onDelete: must be one of {', '.join(ON_DELETE)}, not {_quoted(on_delete)}"
        )
    elif on_delete not in honoured:
        problems.append(
            f"parameters.onDelete: backend {backend} honours {', '.join(honoured)}, "
            f"not {on_delete!r}"
        )
    secret = _secret(parameters, problems)
    fs_type = parameters.get("fsType", "")
    schema = cls.parameters_schema()
    listed = set((schema.get("properties") or {}).keys())
    given = {k: v for k, v in parameters.items() if _backend_key(k, listed)}
    if not fs_type:
        given.pop("fsType", None)
    found = _schema_problems(schema, given, raw)
    problems += found
    strings = all(isinstance(v, str) for k, v in raw.items() if _backend_key(str(k), listed))
    if not found and strings:
        try:
            cls.check_parameters(given)
        except InvalidOptions as exc:
            problems.append(_parameter_rule(exc.message))
    mount_options = sc.get("mountOptions")
    if mount_options:
        takes = "mountOptions" in (schema.get("properties") or {})
        problems.append(
            "mountOptions: a FlexVolume PV cannot carry mountOptions (kubelet fails its mount): "
            + (
                "put them in parameters.mountOptions, comma-separated"
                if takes
                else f"backend {backend} takes none in its parameters"
            )
        )
    mode = sc.get("volumeBindingMode") or "Immediate"
    if cls.reclaim_on == NODE and mode != WAIT:
        problems.append(
            f"volumeBindingMode: backend {backend} keeps a volume on one node, so the class "
            f"must be {WAIT} (not {_quoted(mode)}): the volume is made where the pod is scheduled"
        )
    if problems:
        return None, problems
    spec = ClassSpec(
        name=name,
        backend=backend,
        parameters=MappingProxyType(dict(given)),
        on_delete=on_delete,
        secret=secret,
        fs_type=fs_type,
        reclaim_on=str(cls.reclaim_on),
    )
    return spec, []


# --- the pieces --------------------------------------------------------------------------------


def _backend_class(
    backend: str,
    present: bool,
    backend_class_for: Callable[[str], type],
    problems: list[str],
) -> type | None:
    """The class of ``parameters.backend``, or ``None`` with its problem added."""
    from flexhub.driver.loader import installed_backends
    from flexhub.settings import did_you_mean

    if not backend:
        if not present:  # a non-string backend has its problem already
            listed = ", ".join(installed_backends()) or "(none)"
            problems.append(f"parameters.backend: required (installed: {listed})")
        return None
    try:
        if not _BACKEND_NAME.fullmatch(backend):
            raise LookupError(backend)
        return backend_class_for(backend)
    except (LookupError, FlexhubError) as exc:
        installed = installed_backends()
        if backend in installed and not isinstance(exc, LookupError):
            raise  # installed but broken: the provisioner's problem, not the class's
        hint = did_you_mean(backend, installed).strip(" ()")
        problems.append(
            f"parameters.backend: unknown backend {backend[:_SHOWN]!r}"
            + (f", {hint}" if hint else f" (installed: {', '.join(installed) or '(none)'})")
        )
        return None


def _secret(parameters: Mapping[str, str], problems: list[str]) -> tuple[str, str] | None:
    name = parameters.get("secretName", "")
    namespace = parameters.get("secretNamespace", "")
    if name and not namespace:
        problems.append("parameters.secretNamespace: required with secretName")
    elif namespace and not name:
        problems.append("parameters.secretName: required with secretNamespace")
    return (namespace, name) if name and namespace else None


def _schema_problems(
    schema: Mapping[str, Any], given: Mapping[str, str], raw: Mapping[str, Any]
) -> list[str]:
    from flexhub.driver.validation import schema_problems

    found = schema_problems(None, given, schema=schema, noun="parameter")
    # a parameter that is there but not a string has been reported as such already
    found = [(k, t) for k, t in found if not (t == "required" and k in raw)]
    return [f"{_path(key) if key else 'parameters'}: {text}" for key, text in found]


def _backend_key(key: str, listed: set[str]) -> bool:
    """Whether ``key`` is one of the parameters the backend gets: its own, ``fsType``, and the
    Secret's name and namespace when its schema lists them (cifs mounts with that Secret)."""
    if key not in PROVISIONER_KEYS or key == "fsType":
        return True
    return key in PASSED_ON and key in listed


def _parameter_rule(message: str) -> str:
    """A ``check_parameters`` message, its leading ``parameter 'x'`` turned into the path."""
    match = re.match(r"(?:invalid )?parameters? '([^']+)'[: ]\s*", message)
    if match:
        return f"{_path(match.group(1))}: {message[match.end() :]}"
    return f"parameters: {message}"


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _path(key: str) -> str:
    import json

    shown = key[:_SHOWN]
    return (
        f"parameters.{shown}"
        if _IDENTIFIER.fullmatch(shown)
        else f"parameters[{json.dumps(shown)}]"
    )


def _quoted(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 4] + "...'"


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if value is None:
        return "null"
    return type(value).__name__
