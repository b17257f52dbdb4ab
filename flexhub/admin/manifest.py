"""``flexhub validate``: find flexhub volumes (and StorageClasses) in manifests and report
every problem of each, in the manifest's own terms (``spec.flexVolume.options.flie``).

A StorageClass whose ``provisioner`` is ``flexhub`` is read as the provisioner reads it
(``parameters.onDelete: ...``), and its backend's rules run beside its schema errors; another
provisioner's class is skipped, with a note. A
``driver`` or ``provisioner`` that is almost flexhub's is a problem, with a did-you-mean.

kubelet stops at the first error of a call; a person fixing a manifest wants them all. For
each flexVolume of the driver: the keys a manifest must not set, every schema error, the
backend's own option rules (on the options with each one the schema refused set to its
example), and a ``secretRef`` the options need. Files with no flexhub volume are fine
(exit 0): ``validate`` runs over whole trees; a directory without manifests is refused.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from flexhub.errors import FlexhubError

__all__ = [
    "Report",
    "flex_volumes",
    "kubelet_key_error",
    "manifest_files",
    "near_volumes",
    "options_as_kubelet_sends",
    "validate_file",
    "validate_paths",
]

#: File names ``validate DIRECTORY`` reads.
SUFFIXES = (".yaml", ".yml", ".json")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class Report:
    """What ``validate`` found about one volume, StorageClass or file."""

    where: str
    problems: list[str] = field(default_factory=list)
    note: str = ""
    #: Not flexhub's (another provisioner's StorageClass): nothing was checked.
    skipped: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        if self.skipped:
            return [f"{self.where}: skipped ({self.note})"]
        if self.ok:
            return [f"{self.where}: ok" + (f" ({self.note})" if self.note else "")]
        count = len(self.problems)
        if count == 1:
            return [f"{self.where}: {self.problems[0]}"]
        return [f"{self.where}: {count} problems", *(f"  {p}" for p in self.problems)]


# --- reading -----------------------------------------------------------------------------------


def manifest_files(paths: list[Path]) -> list[Path]:
    """The files to read: each file as given, each directory's ``*.yaml|yml|json`` (sorted,
    recursively, dot-names skipped).

    :raises FlexhubError: a path that does not exist, or a directory without manifests.
    """
    files: list[Path] = []
    for path in paths:
        if str(path) == "-" or path.is_file():
            files.append(path)
        elif path.is_dir():
            found = []
            for top, dirs, names in os.walk(path):  # symlinked directories are not followed
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                found += [
                    Path(top) / n
                    for n in names
                    if not n.startswith(".") and Path(n).suffix in SUFFIXES
                ]
            listed = [p for p in sorted(found) if p.is_file()]
            if not listed:
                raise FlexhubError(
                    f"{path}: no manifests ({', '.join('*' + s for s in SUFFIXES)}) "
                    "in this directory"
                )
            files.extend(listed)
        elif path.exists():
            raise FlexhubError(f"{path}: not a file or directory")
        else:
            raise FlexhubError(f"{path}: No such file or directory")
    return files


def _load_documents(path: Path) -> list[Any]:
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text("utf-8")
    except UnicodeDecodeError:
        raise FlexhubError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise FlexhubError(f"{path}: {exc.strerror}") from None
    if text.lstrip().startswith("{"):
        try:
            return [json.loads(text)]
        except ValueError:
            pass
    import yaml

    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "parse error"
        raise FlexhubError(f"{path}: not valid YAML or JSON{where}: {problem}") from None


# --- finding volumes ---------------------------------------------------------------------------


def flex_volumes(doc: Any, driver: str) -> Iterator[tuple[str, str, Mapping[str, Any]]]:
    """Yield ``(where, path, flexVolume)`` for every flexVolume of ``driver`` in a manifest;
    ``path`` is the flexVolume's place in the object (``spec.volumes[0].flexVolume``)."""
    yield from _flex_volumes(doc, driver, "")


def near_volumes(doc: Any, driver: str) -> Iterator[tuple[str, str, Mapping[str, Any]]]:
    """Like :func:`flex_volumes`, for the flexVolumes whose driver is almost ``driver`` (its
    directory form ``vendor~name/name``, its bare name, a near spelling): a volume kubelet
    would never give flexhub, which ``validate`` must not pass over in silence."""
    yield from _flex_volumes(doc, driver, "", near=True)


def _is_near(value: Any, driver: str) -> bool:
    if not isinstance(value, str) or value == driver:
        return False
    import difflib

    wanted, given = driver.lower(), value.lower()
    name, directory = wanted.rsplit("/", 1)[-1], wanted.replace("/", "~")
    if given in (wanted, name, directory, f"{directory}/{name}") or given.startswith(name + "/"):
        return True
    return bool(difflib.get_close_matches(given, [wanted], cutoff=0.8))


def _flex_volumes(
    doc: Any, driver: str, base: str, *, near: bool = False
) -> Iterator[tuple[str, str, Mapping[str, Any]]]:
    def wanted(flex: Any) -> TypeGuard[dict[str, Any]]:
        if not isinstance(flex, dict):
            return False
        return _is_near(flex.get("driver"), driver) if near else flex.get("driver") == driver

    if not isinstance(doc, dict):
        return
    kind = doc.get("kind", "") or "object"
    metadata = doc.get("metadata")
    name = metadata.get("name", "?") if isinstance(metadata, dict) else "?"
    if kind == "List" or kind.endswith("List"):
        for i, item in enumerate(doc.get("items") or []):
            yield from _flex_volumes(item, driver, f"{base}items[{i}].", near=near)
        return
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return
    flex = spec.get("flexVolume")
    if wanted(flex):
        yield f"{kind}/{name}", f"{base}spec.flexVolume", flex
    pod_specs = [("spec", spec)]
    template = spec.get("template")
    if isinstance(template, dict) and isinstance(template.get("spec"), dict):
        pod_specs.append(("spec.template.spec", template["spec"]))
    job = spec.get("jobTemplate")
    if isinstance(job, dict) and isinstance(job.get("spec"), dict):
        inner = job["spec"].get("template")
        if isinstance(inner, dict) and isinstance(inner.get("spec"), dict):
            pod_specs.append(("spec.jobTemplate.spec.template.spec", inner["spec"]))
    for where, pod_spec in pod_specs:
        for i, volume in enumerate(pod_spec.get("volumes") or []):
            if not isinstance(volume, dict):
                continue
            flex = volume.get("flexVolume")
            if wanted(flex):
                path = f"{base}{where}.volumes[{i}].flexVolume"
                yield f"{kind}/{name} volume {volume.get('name', '?')}", path, flex


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
    keys = _kubelet_keys(flex)
    if not keys:
        return ""
    return f"option {keys[0][:80]!r} is kubelet's: {_KUBELET_KEY_REASON}"


_KUBELET_KEY_REASON = (
    "a volume's options must not set kubernetes.io/ keys (kubelet merges the options last, "
    "over its own)"
)


def _kubelet_keys(flex: Mapping[str, Any]) -> list[str]:
    user = flex.get("options") or {}
    if not isinstance(user, dict):
        return []
    return sorted(k for k in user if isinstance(k, str) and k.startswith("kubernetes.io/"))


# --- checking ----------------------------------------------------------------------------------


def option_path(base: str, key: str) -> str:
    """Where option ``key`` of the options object comes from in the manifest (``base`` is
    the flexVolume's path; ``""`` for a bare options object)."""
    shown = key[:80]
    if not base:
        name = shown if _IDENTIFIER.fullmatch(shown) else json.dumps(shown)
        return f"options.{name}" if _IDENTIFIER.fullmatch(shown) else f"options[{name}]"
    if key == "kubernetes.io/fsType":
        return f"{base}.fsType"
    if key == "kubernetes.io/readwrite":
        return f"{base}.readOnly"
    if not key:
        return f"{base}.options"
    if _IDENTIFIER.fullmatch(shown):
        return f"{base}.options.{shown}"
    return f"{base}.options[{json.dumps(shown)}]"


def _option_rule(message: str, base: str) -> str:
    """A backend rule's message, its leading ``option 'x'`` turned into the manifest path."""
    for pattern in (r"invalid options?: ", r""):
        match = re.match(pattern + r"options? '([^']+)'[: ]\s*", message)
        if match:
            return f"{option_path(base, match.group(1))}: {message[match.end() :]}"
    match = re.match(r"invalid options? \$\['([^']+)'\]:?\s*", message)  # the reply's JSON path
    if match:
        return f"{option_path(base, match.group(1))}: {message[match.end() :]}"
    return f"{base}.options: {message.removeprefix('invalid options: ')}"


def _rule_key(message: str) -> str | None:
    """The option a backend rule's message names first, if any."""
    match = re.match(r"(?:invalid options?: )?options? '([^']+)'", message) or re.match(
        r"invalid options? \$\['([^']+)'\]", message
    )
    return match.group(1) if match else None


def _repaired(
    strings: Mapping[str, str], found: list[tuple[str, str]], schema: Mapping[str, Any]
) -> tuple[dict[str, str], set[str]]:
    """``strings`` with every option the schema refused set to its schema's first example (an
    unknown one dropped, a missing one added), so that the backend's own rules can run on the
    rest; and the keys so changed (a rule about one of those is not the manifest's problem)."""
    properties = schema.get("properties") or {}
    repaired = dict(strings)
    changed: set[str] = set()
    for key, _text in found:
        changed.add(key)
        prop = properties.get(key)
        examples = prop.get("examples") if isinstance(prop, dict) else None
        if isinstance(examples, list) and examples and isinstance(examples[0], str):
            repaired[key] = examples[0]
        else:
            repaired.pop(key, None)
    return repaired, changed


def check_options_object(options: Mapping[str, Any], base: str, *, has_secret: bool) -> list[str]:
    """Every problem of one options object (``base`` names it in the manifest)."""
    from flexhub.driver.loader import installed_backends, load_backend
    from flexhub.driver.validation import schema_problems
    from flexhub.errors import did_you_mean
    from flexhub.volume import Volume

    problems = []
    strings: dict[str, str] = {}
    for key, value in options.items():
        if not isinstance(value, str):
            kind = "a number" if isinstance(value, int | float) else type(value).__name__
            if isinstance(value, bool):
                kind = "a boolean"
            problems.append(
                f"{option_path(base, str(key))}: must be a string, not {kind} (quote it)"
            )
        else:
            strings[str(key)] = value
    name = strings.get("backend", "")
    installed = installed_backends()
    if not name:
        if "backend" not in options:
            listed = ", ".join(installed) or "(none)"
            problems.append(f"{option_path(base, 'backend')}: required (installed: {listed})")
        return problems
    if name not in installed:
        hint = did_you_mean(name, installed).strip(" ()")
        problems.append(
            f"{option_path(base, 'backend')}: unknown backend {name[:80]!r}"
            + (f", {hint}" if hint else f" (installed: {', '.join(installed) or '(none)'})")
        )
        return problems
    try:
        backend = load_backend(name)
        found = schema_problems(backend, strings, name)
    except FlexhubError as exc:
        return [*problems, f"{option_path(base, 'backend')}: {exc.message}"]
    found = [(k, t) for k, t in found if not (t == "required" and k in options)]  # not a string
    problems += [f"{option_path(base, key)}: {text}" for key, text in found]
    # The backend's own rules (cross-option, addresses, paths) run even when the schema
    # refused something: on the options with each refused one set to its schema's example,
    # so that one run shows every problem. Their first problem is reported unless it is
    # about an option already reported (or one set here), or a rule that needed one.
    refused = [(k, t) for k, t in found if k] + [(k, "") for k in options if k not in strings]
    checked, changed = _repaired(strings, refused, backend.schema())
    try:
        backend.check_options(Volume.from_options(checked))
    except FlexhubError as exc:
        if _rule_key(exc.message) not in changed:
            problems.append(_option_rule(exc.message, base))
    except Exception:
        if not problems:
            raise
    reason = backend.secret_needed(strings)
    if reason and not has_secret:
        problems.append(f"{base}.secretRef: required: {reason}")
    return problems


def _size_note(flex: Mapping[str, Any], doc: Mapping[str, Any]) -> str:
    """A loopfile-style ``size`` in human units, and whether it matches the PV's capacity."""
    options = flex.get("options")
    if not isinstance(options, dict) or not isinstance(options.get("size"), str):
        return ""
    size = _bytes(options["size"])
    if size is None:
        return ""
    note = f"size {human_size(size)}"
    spec = doc.get("spec") if isinstance(doc.get("spec"), dict) else {}
    capacity = spec.get("capacity") if isinstance(spec, dict) else None
    if isinstance(capacity, dict) and isinstance(capacity.get("storage"), str):
        claimed = _bytes(capacity["storage"])
        if claimed is not None and claimed != size:
            note += f", but spec.capacity.storage is {human_size(claimed)}"
    return note


_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}


def _bytes(text: str) -> int | None:
    match = re.fullmatch(r"([0-9]+)(|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)", text.strip())
    return int(match.group(1)) * _UNITS[match.group(2)] if match else None


def human_size(size: int) -> str:
    """``1610612736`` → ``1.5 GiB``; below 1 KiB, bytes."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            text = f"{value:.1f}".removesuffix(".0") if unit != "B" else f"{size}"
            return f"{text} {unit}"
        value /= 1024
    return f"{size} B"  # pragma: no cover


def _storage_class(doc: Mapping[str, Any], driver: str) -> Report | None:
    """The report of a StorageClass: a flexhub one (``provisioner: flexhub``) is read as the
    provisioner reads it (:func:`flexhub.provisioner.storageclass.class_problems`), every
    problem in its own line; another provisioner's is skipped, with a note."""
    if doc.get("kind") != "StorageClass":
        return None
    from flexhub.provisioner.storageclass import PROVISIONER_NAME, class_problems

    metadata = doc.get("metadata")
    name = metadata.get("name", "?") if isinstance(metadata, dict) else "?"
    report = Report(f"StorageClass/{name}")
    provisioner = doc.get("provisioner")
    if provisioner == driver:
        report.problems.append(
            f"provisioner: {driver!r} is the FlexVolume driver's name; flexhub's provisioner "
            f"is {PROVISIONER_NAME!r}"
        )
        return report
    if provisioner != PROVISIONER_NAME and _is_near(provisioner, PROVISIONER_NAME):
        report.problems.append(_near_provisioner(str(provisioner), PROVISIONER_NAME))
        return report
    if provisioner != PROVISIONER_NAME:
        report.skipped = True
        report.note = f"provisioner {str(provisioner)[:80]!r} is not flexhub's"
        return report
    from flexhub.driver.loader import load_backend

    try:
        spec, problems = class_problems(doc, load_backend)
    except FlexhubError as exc:
        report.problems.append(f"parameters.backend: {exc.message}")
        return report
    report.problems = [_parameter_rule(p) for p in problems]
    if spec is None:
        for problem in _class_rules(doc, load_backend):
            if problem not in report.problems:
                report.problems.append(problem)
    if spec is not None:
        report.note = f"backend {spec.backend}, onDelete {spec.on_delete}"
    return report


def _near_driver(base: str, flex: Mapping[str, Any], driver: str) -> str:
    value = str(flex.get("driver"))
    text = f"{base}.driver: {value[:80]!r} is not flexhub's driver name, did you mean {driver}?"
    directory = driver.replace("/", "~")
    if value.startswith(directory + "/"):
        text += f" ({directory} is its directory)"
    return text


def _near_provisioner(provisioner: str, name: str) -> str:
    """The problem of a StorageClass provisioner that is almost flexhub's."""
    from flexhub.driver.loader import installed_backends

    text = f"provisioner: {provisioner[:80]!r} is not flexhub's provisioner name"
    text += f", did you mean {name}?"
    backend = provisioner.rpartition("/")[2]
    if "/" in provisioner and backend in installed_backends():
        text += f" (the backend goes in parameters.backend: {backend})"
    return text


def _parameter_path(key: str) -> str:
    shown = key[:80]
    if _IDENTIFIER.fullmatch(shown):
        return f"parameters.{shown}"
    return f"parameters[{json.dumps(shown)}]"


def _parameter_rule(problem: str) -> str:
    """``parameters: invalid parameter $['x']: why`` (a backend rule in the reply's JSON path
    form) as ``parameters.x: why``; any other problem as it is."""
    match = re.match(r"(?:parameters: )?invalid parameters? \$\['([^']+)'\]:?\s*", problem)
    return f"{_parameter_path(match.group(1))}: {problem[match.end() :]}" if match else problem


def _class_rules(doc: Mapping[str, Any], load_backend: Any) -> list[str]:
    """The backend's ``check_parameters`` problem of a class whose schema refused some
    parameters (the provisioner's reading stops there): run on the parameters with each
    refused one set to its schema's example, as for a volume's options."""
    from flexhub.driver.validation import schema_problems
    from flexhub.provisioner.storageclass import PASSED_ON, PROVISIONER_KEYS
    from flexhub.provisioning import Provisioning

    raw = doc.get("parameters")
    backend = raw.get("backend") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or not isinstance(backend, str):
        return []
    try:
        cls = load_backend(backend)
    except FlexhubError:
        return []  # reported by the provisioner's reading
    if not (isinstance(cls, type) and issubclass(cls, Provisioning)):
        return []
    schema = cls.parameters_schema()
    listed = set(schema.get("properties") or {})
    passed = {k for k in PASSED_ON if k in listed} | {"fsType"}
    given = {
        str(k): v
        for k, v in raw.items()
        if isinstance(v, str) and (k not in PROVISIONER_KEYS or k in passed)
    }
    if not given.get("fsType"):
        given.pop("fsType", None)
    found = schema_problems(None, given, schema=schema, noun="parameter")
    found += [(str(k), "") for k, v in raw.items() if not isinstance(v, str)]
    if not found:
        return []  # check_parameters ran in the provisioner's reading
    checked, changed = _repaired(given, found, schema)
    try:
        cls.check_parameters(checked)
    except FlexhubError as exc:
        key = _rule_key(exc.message.replace("parameter", "option", 1))
        if key not in changed:
            return [_parameter_rule(f"parameters: {exc.message}")]
    except Exception:  # a rule that trips over a refused parameter: that one is reported
        return []
    return []


def _items(doc: Any) -> Iterator[Mapping[str, Any]]:
    """``doc`` and, for a ``List`` (``kubectl get -o yaml``), its items."""
    if not isinstance(doc, dict):
        return
    kind = doc.get("kind") or ""
    if isinstance(kind, str) and kind.endswith("List"):
        for item in doc.get("items") or []:
            yield from _items(item)
        return
    yield doc


def validate_documents(path: Path, driver: str, *, named: bool = False) -> list[Report]:
    """Every report of one file (a file that cannot be read is one report of its own);
    ``named``: each report starts with the file's name."""
    prefix = f"{path}: " if named and str(path) != "-" else ""
    try:
        docs = _load_documents(path)
    except FlexhubError as exc:
        return [Report(str(path), [exc.message.removeprefix(f"{path}: ")])]
    reports: list[Report] = []
    for doc in docs:
        if isinstance(doc, dict) and "kind" not in doc and "apiVersion" not in doc:
            # a bare options object, as kubelet sends it (secrets would be its own keys)
            report = Report(str(path) if str(path) != "-" else "options")
            report.problems = check_options_object(doc, "", has_secret=True)
            reports.append(report)
            continue
        for item in _items(doc):
            sc = _storage_class(item, driver)
            if sc is not None:
                sc.where = prefix + sc.where
                reports.append(sc)
        for where, base, flex in near_volumes(doc, driver):
            reports.append(Report(prefix + where, [_near_driver(base, flex, driver)]))
        for where, base, flex in flex_volumes(doc, driver):
            report = Report(prefix + where)
            keys = _kubelet_keys(flex)
            report.problems += [
                f"{option_path(base, k)}: kubelet's key: {_KUBELET_KEY_REASON}" for k in keys
            ]
            user = flex.get("options")
            if user is not None and not isinstance(user, dict):
                report.problems.append(f"{base}.options: must be a map of strings")
                user = {}
            options = dict(user or {})
            for key in keys:
                options.pop(key, None)
            fs_type = flex.get("fsType")
            if fs_type:
                options["kubernetes.io/fsType"] = fs_type
            options["kubernetes.io/readwrite"] = "ro" if flex.get("readOnly") else "rw"
            report.problems += check_options_object(
                options, base, has_secret=isinstance(flex.get("secretRef"), dict)
            )
            if report.ok and isinstance(doc, dict):
                report.note = _size_note(flex, doc)
            reports.append(report)
    return reports


def validate_paths(paths: list[Path], driver: str) -> tuple[list[Report], list[Path]]:
    """Reports of every flexhub volume in ``paths``, and the files that hold none."""
    reports: list[Report] = []
    empty: list[Path] = []
    files = manifest_files(paths)
    named = len(files) > 1 or any(p.is_dir() for p in paths)
    for path in files:
        found = validate_documents(path, driver, named=named)
        if not found:
            empty.append(path)
        reports.extend(found)
    return reports, empty


def validate_file(path: Path, driver: str) -> list[tuple[str, str]]:
    """``(where, problems joined by "; " or "")`` for every flexhub volume in ``path``."""
    return [(r.where, "; ".join(r.problems)) for r in validate_documents(path, driver)]
