"""The ``pathPattern`` of a provisioning StorageClass: a claim's directory, relative to the
export (or share) root, rendered from the claim and checked to stay inside it.

Placeholders (nothing else may follow a ``$``)::

    ${namespace}  ${name}  ${uid}  ${pvName}  ${annotations['<key>']}

The rendered path is a plain relative path: segments of letters, digits and ``_ . + @ ~ = -``
(what the node driver's ``subPath`` accepts), none empty, ``.`` or ``..``, no leading ``/``,
no control character, each at most :data:`MAX_SEGMENT` characters. Anything else is refused
(:class:`InvalidOptions` naming ``pathPattern``), never rewritten.

Two claims never share a directory: the pattern's *last* segment must hold ``${uid}`` or
``${pvName}``, and an annotation's value must be one segment (no ``/``), so every claim of a
class renders the same number of segments and ends in its own uid: no claim's directory is
another's. Nor inside another's (whose reclaim would delete it), whatever class made that one:
every claim's directory's last segment holds its uid, so a segment *before* the last that holds
a uid (in any letter case: an SMB server may match names without it) could be another claim's
directory, and is refused (from an annotation, a namespace, or the pattern itself).

Public, for every backend that makes a directory per claim (nfs and cifs use it).

.. versionadded:: 0.3
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from flexhub.backend import InvalidOptions
from flexhub.provisioning import Claim

__all__ = [
    "ARCHIVE_PREFIX",
    "DEFAULT_PATTERN",
    "MAX_PATH",
    "MAX_SEGMENT",
    "check_pattern",
    "check_recorded",
    "render",
]

#: The default ``pathPattern``: readable by a person on the server, unique by the PV name.
DEFAULT_PATTERN = "${namespace}-${name}-${pvName}"
#: What an archived directory's name starts with (``archived-<its name>``, beside it).
ARCHIVE_PREFIX = "archived-"
#: Longest segment: NAME_MAX (255) less the archive prefix, so an archived name still fits.
MAX_SEGMENT = 255 - len(ARCHIVE_PREFIX)
#: Longest rendered path (the nfs node driver's subPath limit).
MAX_PATH = 255

_PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
_ANNOTATION = re.compile(r"annotations\['([^'\]]{1,253})'\]")
_FIELDS = ("namespace", "name", "uid", "pvName")
_SEGMENT = re.compile(r"[A-Za-z0-9_.+@~=-]+")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
#: What a claim's directory's name holds (its uid), in any case: a parent must not hold it.
_ANY_UID = re.compile(_UUID.pattern, re.IGNORECASE)

#: A claim that stands for every claim when a pattern is checked without one.
_SAMPLE = Claim(
    uid="00000000-0000-4000-8000-000000000000",
    namespace="default",
    name="claim",
    size=1,
)


def _bad(why: str) -> InvalidOptions:
    return InvalidOptions(f"invalid parameter $['pathPattern']: {why}")


def _shown(text: str) -> str:
    return repr(text[:80])


def _value(expression: str, claim: Claim, sample: bool) -> str:
    if expression in _FIELDS:
        return {
            "namespace": claim.namespace,
            "name": claim.name,
            "uid": claim.uid,
            "pvName": claim.volume_name,
        }[expression]
    match = _ANNOTATION.fullmatch(expression)
    if match is None:
        raise _bad(
            f"unknown placeholder ${{{expression[:40]}}} (known: ${{namespace}}, ${{name}}, "
            "${uid}, ${pvName}, ${annotations['key']})"
        )
    key = match.group(1)
    if sample:
        return "annotation"
    value = claim.annotations.get(key, "")
    if not value:
        raise _bad(f"the claim has no annotation {key!r} (or it is empty)")
    if "/" in value:
        raise _bad(f"annotation {key!r} of the claim holds a '/' (one path segment only)")
    return value


def _render(pattern: str, claim: Claim, sample: bool) -> str:
    out: list[str] = []
    position = 0
    for match in _PLACEHOLDER.finditer(pattern):
        out.append(pattern[position : match.start()])
        out.append(_value(match.group(1), claim, sample))
        position = match.end()
    out.append(pattern[position:])
    literal = _PLACEHOLDER.sub("", pattern)
    if "$" in literal:
        raise _bad("a '$' that does not start a ${...} placeholder")
    return "".join(out)


def check_path(path: str, what: str = "pathPattern") -> None:
    """Refuse a path that could leave the export's root or that subPath would refuse.

    :raises InvalidOptions: naming ``what``.
    """

    def bad(why: str) -> InvalidOptions:
        return InvalidOptions(f"invalid parameter $['{what}']: {why}")

    if not path:
        raise bad("renders an empty path")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise bad("renders a path with a control character")
    if path.startswith("/"):
        raise bad(f"renders an absolute path {_shown(path)} (it is relative to the export)")
    if len(path) > MAX_PATH:
        raise bad(f"renders a path longer than {MAX_PATH} characters")
    for segment in path.split("/"):
        if not segment:
            raise bad(f"renders an empty segment in {_shown(path)}")
        if segment in (".", ".."):
            raise bad(f"renders a {segment!r} segment in {_shown(path)}")
        if not _SEGMENT.fullmatch(segment):
            raise bad(
                f"renders the segment {_shown(segment)}: only letters, digits and _ . + @ ~ = -"
            )
        if len(segment) > MAX_SEGMENT:
            raise bad(f"renders a segment longer than {MAX_SEGMENT} characters")


#: An 8.3 short name's tail (``PVC-3F~1``): a Windows SMB server resolves it to a long name.
_SHORT_NAME = re.compile(r"~[0-9]")


def _check_parents(path: str) -> None:
    """Refuse a segment before the last that holds a uid: it could be (or later become)
    another claim's directory, which this claim's would then be inside (and its reclaim would
    delete this one's data)."""
    for segment in path.split("/")[:-1]:
        if _ANY_UID.search(segment):
            raise _bad(
                f"renders the segment {_shown(segment)} before the last one: it holds a uid, as "
                "a claim's directory does, and a claim's directory is never inside another's"
            )
        if _SHORT_NAME.search(segment):
            raise _bad(
                f"renders the segment {_shown(segment)} before the last one: it has the shape "
                "of an SMB 8.3 short name (~ and a digit), which a server may resolve to "
                "another claim's directory"
            )


def check_pattern(pattern: str) -> None:
    """Check a pattern without a claim: known placeholders, a safe path for any claim, and
    ``${uid}`` or ``${pvName}`` in the last segment and in no segment before it.

    :raises InvalidOptions: naming ``pathPattern``.
    """
    last = pattern.rsplit("/", 1)[-1]
    if "${uid}" not in last and "${pvName}" not in last:
        raise _bad(
            "its last segment must hold ${uid} or ${pvName}, so that no two claims share a "
            "directory (and one claim's reclaim never deletes another's data)"
        )
    path = _render(pattern, _SAMPLE, sample=True)
    check_path(path)
    _check_parents(path)


def render(pattern: str, claim: Claim) -> str:
    """The directory of ``claim``, relative to the export's root, checked.

    :raises InvalidOptions: naming ``pathPattern``: a bad pattern, a missing or multi-segment
        annotation, a result that is not a plain relative path, or one with a uid in a segment
        before the last (it could be inside another claim's directory).
    """
    check_pattern(pattern)
    path = _render(pattern, claim, sample=False)
    check_path(path)
    _check_parents(path)
    return path


def check_recorded(options: Mapping[str, str], reclaim: Mapping[str, str]) -> str:
    """The directory a reclaim may touch: the PV's ``subPath``, which must be the one the
    reclaim record holds, a plain relative path, and end in a segment that holds the claim's
    uid (so a hand-edited PV cannot point a delete at the export's root or another path).

    :raises InvalidOptions: naming the bad key.
    """
    path = reclaim.get("path", "")
    uid = reclaim.get("claimUid", "")
    check_path(path, "path")
    if options.get("subPath", "") != path:
        raise InvalidOptions(
            "invalid reclaim record: $['path'] is not the PV's subPath: refusing to reclaim"
        )
    if not _UUID.fullmatch(uid) or uid not in path.rsplit("/", 1)[-1]:
        raise InvalidOptions(
            "invalid reclaim record: $['claimUid'] is not a uid the directory's name holds: "
            "refusing to reclaim"
        )
    return path
