"""Which namespace a loopfile volume belongs to, and the node settings that say so.

With ``[loopfile] isolation = "namespace"`` (the default) every namespace has its own area of
the loopfile root, ``<root>/namespaces/<namespace>/``, and a volume's ``file`` is resolved
inside the area of the pod's namespace (``kubernetes.io/pod.namespace``, which kubelet sends
with ``mount`` only). Two namespaces naming the same ``file`` get two separate files.
``isolation = "none"`` resolves ``file`` in the root itself, for single-tenant clusters.

Files made before isolation existed live at ``<root>/<file>``. ``[loopfile] legacy`` says
what a namespaced mount does when its area has no such file but the old location has one:
``"adopt"`` (default) moves the file into that namespace's area (one atomic rename, so exactly
one namespace can claim it), ``"refuse"`` fails the mount and tells the operator where to
move it.

``[loopfile] overcommit`` (a number >= 1, default 1) is how many times what the root's
filesystem can hold the root's files may promise together (:mod:`flexhub_loopfile._room`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flexhub.backend import FlexhubError, InvalidOptions, Volume

__all__ = [
    "AREA",
    "ISOLATION",
    "LEGACY",
    "SETTINGS",
    "SNAPSHOTS",
    "area",
    "check_settings",
    "isolated",
    "legacy_mode",
    "namespace_of",
    "overcommit",
]

#: The ``[loopfile]`` keys this module reads.
SETTINGS = ("isolation", "legacy", "overcommit")
#: The directory of the loopfile root that holds the namespaces' areas.
AREA = "namespaces"
#: The directory of the loopfile root that holds the snapshots (:mod:`._snapshot`).
SNAPSHOTS = "snapshots"
#: The values of ``[loopfile] isolation``; the first is the default.
ISOLATION = ("namespace", "none")
#: The values of ``[loopfile] legacy``; the first is the default.
LEGACY = ("adopt", "refuse")

#: A Kubernetes namespace name: an RFC 1123 DNS label.
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _choice(settings: Mapping[str, Any], key: str, values: tuple[str, ...]) -> str:
    value = settings.get(key, values[0])
    if value not in values:
        shown = " or ".join(f'"{v}"' for v in values)
        raise FlexhubError(f"node config: [loopfile] {key} must be {shown}")
    return str(value)


def isolated(settings: Mapping[str, Any]) -> bool:
    """Whether files are resolved in per-namespace areas (``isolation = "namespace"``).

    :raises FlexhubError: the setting has another value.
    """
    return _choice(settings, "isolation", ISOLATION) == "namespace"


def legacy_mode(settings: Mapping[str, Any]) -> str:
    """``"adopt"`` or ``"refuse"``: what happens to a file at its pre-isolation location."""
    return _choice(settings, "legacy", LEGACY)


def overcommit(settings: Mapping[str, Any]) -> float:
    """The allowed ratio of what the root's files promise to what its filesystem holds."""
    value = settings.get("overcommit", 1)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value < 1e6:
        raise FlexhubError("node config: [loopfile] overcommit must be a number >= 1")
    return float(value)


def check_settings(settings: Mapping[str, Any]) -> None:
    """Check every setting of this module at once (a typo fails every call, not some).

    :raises FlexhubError: naming the first wrong setting.
    """
    isolated(settings)
    legacy_mode(settings)
    overcommit(settings)


def namespace_of(volume: Volume) -> str:
    """The validated namespace of the pod ``volume`` is mounted for.

    :raises InvalidOptions: the call carries no pod (only ``mount`` does), no namespace, or
        one that is not a DNS label (it becomes a path component).
    """
    if volume.pod is None:
        raise InvalidOptions(
            "a loopfile volume is resolved in its pod's namespace, and this call names no pod"
        )
    namespace = volume.pod.namespace
    if not namespace:
        raise InvalidOptions("kubelet sent no kubernetes.io/pod.namespace for this loopfile mount")
    if not _LABEL.fullmatch(namespace):
        raise InvalidOptions(
            f"kubernetes.io/pod.namespace {namespace[:80]!r} is not a valid namespace name"
        )
    return namespace


def area(root: Path, namespace: str) -> Path:
    """The directory of ``namespace``'s files under the loopfile root."""
    return root / AREA / namespace
