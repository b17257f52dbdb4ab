"""What a backend is told about a volume: options, secrets, pod and filesystem settings."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from flexhub.errors import InvalidOptions
from flexhub.node.frozen import Frozen

__all__ = [
    "CONTROL_CHARACTERS",
    "DEFAULT_FS_TYPE",
    "KUBE_PREFIX",
    "PER_POD_KEYS",
    "SECRET_PREFIX",
    "PodInfo",
    "Secret",
    "Secrets",
    "Volume",
    "has_control_character",
]

KUBE_PREFIX = "kubernetes.io/"
SECRET_PREFIX = "kubernetes.io/secret/"
DEFAULT_FS_TYPE = "ext4"

#: Characters no option key or value may hold: C0 controls (newline, tab, ...), DEL, C1
#: controls (U+0085 NEXT LINE among them), and the Unicode line and paragraph separators
#: (U+2028, U+2029): every character Python's ``str.splitlines()`` breaks a line at, and every
#: one a line-based file or a log line could be split at. A trailing newline would otherwise
#: pass a schema pattern (Python's ``$`` matches before it) and name another file in sysfs.
#: Backends apply the same rule to decoded secret values that end up in line-based files.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def has_control_character(text: str) -> bool:
    """Whether ``text`` holds a character of :data:`CONTROL_CHARACTERS`."""
    return CONTROL_CHARACTERS.search(text) is not None


_FS_TYPE = "kubernetes.io/fsType"
_READWRITE = "kubernetes.io/readwrite"
_PV_NAME = "kubernetes.io/pvOrVolumeName"
_FS_GROUP = "kubernetes.io/mounterArgs.FsGroup"
_FS_GROUP_LEGACY = "kubernetes.io/fsGroup"

#: Keys kubelet adds to ``mount`` that differ between the pods of one volume: the core checks
#: them, backend schemas never see them.
PER_POD_KEYS = frozenset(
    {
        "kubernetes.io/pod.name",
        "kubernetes.io/pod.namespace",
        "kubernetes.io/pod.uid",
        "kubernetes.io/serviceAccount.name",
        _FS_GROUP,
        _FS_GROUP_LEGACY,
    }
)


class Secret:
    """A secret value: its ``repr`` and ``str`` never show it; ``reveal()`` does."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """Return the secret text, for handing to a tool, never for logging."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


class Secrets(Mapping[str, Secret]):
    """The ``kubernetes.io/secret/<key>`` values of a ``mount`` call, decoded when used.

    Keys are the Secret's own keys (without the prefix). Only ``mount`` carries secrets. A
    value is base64-decoded the first time a backend asks for its key: a key the backend does
    not use (a binary TLS key elsewhere in the same Secret) never fails the mount.
    """

    def __init__(
        self,
        values: Mapping[str, Secret] | None = None,
        *,
        encoded: Mapping[str, str] | None = None,
    ) -> None:
        self._values = dict(values or {})
        self._encoded = {k: v for k, v in (encoded or {}).items() if k not in self._values}

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> Secrets:
        """The ``kubernetes.io/secret/*`` entries of ``options``, still base64-encoded."""
        encoded = {
            key[len(SECRET_PREFIX) :]: raw
            for key, raw in options.items()
            if key.startswith(SECRET_PREFIX)
        }
        return cls(encoded=encoded)

    def __getitem__(self, key: str) -> Secret:
        """The decoded value of ``key``.

        :raises KeyError: the Secret has no such key.
        :raises InvalidOptions: its value is not base64 of UTF-8 text (named by key only).
        """
        if key not in self._values:
            import base64  # (only a call that carries a secret pays for it)
            import binascii

            raw = self._encoded[key]
            try:
                text = base64.b64decode(raw, validate=True).decode("utf-8")
            except (binascii.Error, ValueError):
                raise InvalidOptions(
                    f"secret key {key!r} is not base64-encoded UTF-8 text"
                ) from None
            self._values[key] = Secret(text)
        return self._values[key]

    def __contains__(self, key: object) -> bool:
        return key in self._values or key in self._encoded

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(set(self._values) | set(self._encoded)))

    def __len__(self) -> int:
        return len(set(self._values) | set(self._encoded))

    def __repr__(self) -> str:
        return f"Secrets(keys={sorted(self)!r})"

    def revealed(self) -> list[str]:
        """Every secret value that is text, for scrubbing text that a tool may have echoed."""
        values = []
        for key in self:
            try:
                value = self[key].reveal()
            except InvalidOptions:
                continue  # binary: it cannot be in text; its base64 form is scrubbed instead
            if value:
                values.append(value)
        return values


class PodInfo(Frozen):
    """The pod a ``mount`` call is for (empty strings when kubelet sent none)."""

    # the fields, in order
    __slots__ = (  # noqa: RUF023
        "name",
        "namespace",
        "uid",
        "service_account",
    )
    name: str
    namespace: str
    uid: str
    service_account: str

    def __init__(
        self, name: str = "", namespace: str = "", uid: str = "", service_account: str = ""
    ) -> None:
        self._set(name=name, namespace=namespace, uid=uid, service_account=service_account)


class Volume(Frozen):
    """A volume as a backend sees it.

    ``options`` holds only the backend's own, schema-validated keys: never a ``kubernetes.io/``
    key and never a secret. For example, for a loopfile PV::

        Volume(options={"backend": "loopfile", "file": "db/pg.img", "size": "1Gi"},
               fs_type="ext4", read_only=False, name="pv-db", ...)
    """

    # the fields, in order
    __slots__ = (  # noqa: RUF023
        "options",
        "fs_type",
        "read_only",
        "name",
        "fs_group",
        "pod",
        "secrets",
    )
    options: Mapping[str, str]
    fs_type: str
    read_only: bool
    name: str
    fs_group: int | None
    pod: PodInfo | None
    secrets: Secrets

    def __init__(
        self,
        options: Mapping[str, str],
        fs_type: str = "",
        read_only: bool = False,
        name: str = "",
        fs_group: int | None = None,
        pod: PodInfo | None = None,
        secrets: Secrets | None = None,
    ) -> None:
        self._set(
            options=options,
            fs_type=fs_type,
            read_only=read_only,
            name=name,
            fs_group=fs_group,
            pod=pod,
            secrets=Secrets() if secrets is None else secrets,
        )

    @property
    def backend(self) -> str:
        return self.options.get("backend", "")

    @property
    def mount_options(self) -> tuple[str, ...]:
        """The ``mountOptions`` option split on commas (validated by the backend's schema)."""
        raw = self.options.get("mountOptions", "")
        return tuple(part.strip() for part in raw.split(",") if part.strip())

    def fs_type_or_default(self) -> str:
        return self.fs_type or DEFAULT_FS_TYPE

    @classmethod
    def from_options(cls, options: Mapping[str, str], *, with_pod: bool = False) -> Volume:
        """Build a volume from a validated options object as kubelet sends it."""
        own = {k: v for k, v in options.items() if not k.startswith(KUBE_PREFIX)}
        readwrite = options.get(_READWRITE, "rw")
        if readwrite not in ("rw", "ro"):
            raise InvalidOptions(f"invalid option $['{_READWRITE}']: must be 'rw' or 'ro'")
        fs_group_raw = options.get(_FS_GROUP) or options.get(_FS_GROUP_LEGACY) or ""
        fs_group: int | None = None
        if fs_group_raw:
            if not fs_group_raw.isdigit() or len(fs_group_raw) > 10:
                raise InvalidOptions(f"{_FS_GROUP} must be a decimal group id")
            fs_group = int(fs_group_raw)
        pod = None
        if with_pod:
            pod = PodInfo(
                name=options.get("kubernetes.io/pod.name", ""),
                namespace=options.get("kubernetes.io/pod.namespace", ""),
                uid=options.get("kubernetes.io/pod.uid", ""),
                service_account=options.get("kubernetes.io/serviceAccount.name", ""),
            )
        return cls(
            options=own,
            fs_type=options.get(_FS_TYPE, ""),
            read_only=readwrite == "ro",
            name=options.get(_PV_NAME, ""),
            fs_group=fs_group,
            pod=pod,
            secrets=Secrets.from_options(options),
        )
