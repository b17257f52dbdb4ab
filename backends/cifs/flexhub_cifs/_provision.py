"""A provisioning StorageClass's parameters, checked, and the PV options made from them.

Pure functions, no I/O: :meth:`CifsBackend.check_parameters` runs :func:`read` on the class
alone, :meth:`CifsBackend.provision` on the class and the claim.

Owner and modes: an SMB server keeps a file's owner and mode itself (the Secret's user; a
client's chown and chmod are dropped without POSIX extensions), so what the pods see is set
by the PV's mount options, from these parameters: ``uid`` and ``gid`` (absent: root, and the
pod's fsGroup for the group when it has one), ``mode`` (``dir_mode``, default ``0770``) and
``fileMode`` (``file_mode``, default ``0660``): owner and group only, never others.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from flexhub.backend import Frozen, InvalidOptions, Volume
from flexhub.pathpattern import DEFAULT_PATTERN, check_pattern
from flexhub_cifs._options import build_plan

__all__ = ["DEFAULT_DIR_MODE", "DEFAULT_FILE_MODE", "PASSED_ON", "Spec", "read"]

DEFAULT_DIR_MODE = "0770"
DEFAULT_FILE_MODE = "0660"
#: Parameters copied into the PV's options as they are.
PASSED_ON = ("server", "share", "vers", "mountOptions", "uid", "gid")
_KNOWN = frozenset(
    {*PASSED_ON, "pathPattern", "mode", "fileMode", "secretName", "secretNamespace", "fsType"}
)
_MODE = re.compile(r"0?[0-7]{3}")
#: A Secret's name and namespace: DNS subdomain / label.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class Spec(Frozen):
    """What a class asks for: the options every PV of it shares, and its Secret."""

    __slots__ = ("options", "pattern", "secret", "fs_type")  # noqa: RUF023 - the fields, in order
    options: Mapping[str, str]
    pattern: str
    secret: tuple[str, str]
    fs_type: str

    def __init__(
        self,
        options: Mapping[str, str],
        pattern: str,
        secret: tuple[str, str],
        fs_type: str,
    ) -> None:
        self._set(options=options, pattern=pattern, secret=secret, fs_type=fs_type)

    def pv_options(self, path: str) -> dict[str, str]:
        """The PV's options for the claim directory ``path`` (``backend`` is the
        provisioner's)."""
        return {**self.options, "subPath": path}


def _mode(parameters: Mapping[str, str], key: str, default: str) -> str:
    text = parameters.get(key, "") or default
    if not _MODE.fullmatch(text):
        raise InvalidOptions(
            f"invalid parameter $['{key}']: {text[:20]!r} is not an octal mode like {default} "
            "(no setuid, setgid or sticky bit)"
        )
    return f"{int(text, 8):04o}"


def read(parameters: Mapping[str, str]) -> Spec:
    """Check a class's parameters (what its schema cannot say) and return what they ask.

    :raises InvalidOptions: one line naming the parameter.
    """
    unknown = sorted(set(parameters) - _KNOWN)
    if unknown:
        raise InvalidOptions(f"invalid parameter $['{unknown[0][:40]}']: not a cifs parameter")
    name = parameters.get("secretName", "")
    namespace = parameters.get("secretNamespace", "")
    if not _NAME.fullmatch(name):
        raise InvalidOptions(
            "invalid parameter $['secretName']: cifs needs the Secret (type k8s/flexhub, keys "
            "username, password[, domain]) the provisioner and the PVs use"
        )
    if not _NAMESPACE.fullmatch(namespace):
        raise InvalidOptions("invalid parameter $['secretNamespace']: the Secret's namespace")
    options = {key: parameters[key] for key in PASSED_ON if parameters.get(key, "")}
    options["dir_mode"] = _mode(parameters, "mode", DEFAULT_DIR_MODE)
    options["file_mode"] = _mode(parameters, "fileMode", DEFAULT_FILE_MODE)
    fs_type = parameters.get("fsType", "")
    plan = build_plan(Volume(options={"backend": "cifs", **options}, fs_type=fs_type))
    if plan.read_only:
        raise InvalidOptions(
            "invalid parameter $['mountOptions']: 'ro' leaves a new, empty volume unwritable"
        )
    pattern = parameters.get("pathPattern", "") or DEFAULT_PATTERN
    check_pattern(pattern)
    return Spec(options=options, pattern=pattern, secret=(namespace, name), fs_type=fs_type)
