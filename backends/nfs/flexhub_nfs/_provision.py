"""A provisioning StorageClass's parameters, checked, and the PV options made from them.

Pure functions, no I/O: :meth:`NfsBackend.check_parameters` runs :func:`read` on the class
alone, :meth:`NfsBackend.provision` on the class and the claim.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from flexhub.backend import Frozen, InvalidOptions, Volume
from flexhub.pathpattern import DEFAULT_PATTERN, check_pattern, render
from flexhub.provisioning import Claim
from flexhub_nfs._options import build_plan

__all__ = ["DEFAULT_GID", "DEFAULT_MODE", "DEFAULT_UID", "PASSED_ON", "Spec", "read"]

#: Owner and mode of a claim's directory when the class does not say: root's, group root,
#: ``2770`` (owner and group may do everything, others nothing; setgid keeps new files in the
#: directory's group). Set ``gid`` to the group the pods run with (``fsGroup`` or
#: ``supplementalGroups``: kubelet gives it to the pod's processes).
DEFAULT_UID = 0
DEFAULT_GID = 0
DEFAULT_MODE = 0o2770
#: Parameters copied into the PV's options as they are.
PASSED_ON = ("server", "share", "nfsVersion", "mountOptions")
_KNOWN = frozenset({*PASSED_ON, "pathPattern", "uid", "gid", "mode", "fsType"})
_ID = re.compile(r"[0-9]{1,10}")
_MODE = re.compile(r"[0-3]?[0-7]{3}")
_MAX_ID = 4294967294


class Spec(Frozen):
    """What a class asks for: the options every PV of it shares, and the directory's owner."""

    __slots__ = (  # noqa: RUF023 - the fields, in order
        "options",
        "pattern",
        "uid",
        "gid",
        "mode",
        "fs_type",
    )
    options: Mapping[str, str]
    pattern: str
    uid: int
    gid: int
    mode: int
    fs_type: str

    def __init__(
        self,
        options: Mapping[str, str],
        pattern: str,
        uid: int,
        gid: int,
        mode: int,
        fs_type: str,
    ) -> None:
        self._set(options=options, pattern=pattern, uid=uid, gid=gid, mode=mode, fs_type=fs_type)

    def pv_options(self, path: str) -> dict[str, str]:
        """The PV's options for the claim directory ``path`` (``backend`` is the
        provisioner's): the export, its sub-directory, nothing to create at mount time."""
        return {**self.options, "subPath": path}


def _id(parameters: Mapping[str, str], key: str, default: int) -> int:
    text = parameters.get(key, "")
    if not text:
        return default
    if not _ID.fullmatch(text) or int(text) > _MAX_ID:
        raise InvalidOptions(
            f"invalid parameter $['{key}']: {text[:20]!r} is not a numeric id 0..{_MAX_ID}"
        )
    return int(text)


def read(parameters: Mapping[str, str]) -> Spec:
    """Check a class's parameters (what its schema cannot say) and return what they ask.

    :raises InvalidOptions: one line naming the parameter.
    """
    unknown = sorted(set(parameters) - _KNOWN)
    if unknown:
        raise InvalidOptions(f"invalid parameter $['{unknown[0][:40]}']: not an nfs parameter")
    options = {key: parameters[key] for key in PASSED_ON if parameters.get(key, "")}
    fs_type = parameters.get("fsType", "")
    plan = build_plan(Volume(options={"backend": "nfs", **options}, fs_type=fs_type))
    if plan.read_only:
        raise InvalidOptions(
            "invalid parameter $['mountOptions']: 'ro' leaves a new, empty volume unwritable"
        )
    mode_text = parameters.get("mode", "")
    if mode_text and not _MODE.fullmatch(mode_text):
        raise InvalidOptions(
            f"invalid parameter $['mode']: {mode_text[:20]!r} is not an octal mode like 2770"
        )
    mode = int(mode_text, 8) if mode_text else DEFAULT_MODE
    if mode & 0o700 != 0o700:
        raise InvalidOptions("invalid parameter $['mode']: the owner must keep rwx (0700)")
    pattern = parameters.get("pathPattern", "") or DEFAULT_PATTERN
    check_pattern(pattern)
    return Spec(
        options=options,
        pattern=pattern,
        uid=_id(parameters, "uid", DEFAULT_UID),
        gid=_id(parameters, "gid", DEFAULT_GID),
        mode=mode,
        fs_type=fs_type,
    )


def directory(spec: Spec, claim: Claim) -> str:
    """The claim's directory below the export, rendered and checked."""
    path = render(spec.pattern, claim)
    share = spec.options["share"]
    if len(share) + 1 + len(path) > 1024:
        raise InvalidOptions("invalid parameter $['pathPattern']: share and path exceed 1024")
    return path
