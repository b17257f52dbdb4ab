"""A CSI request's volume as flexhub's: the backend, its validated options, the secrets.

The volume context is a FlexVolume PV's ``options`` (``backend`` picks the backend, every other
key is the backend's, validated against its schema), plus ``flexhub.csi/fsType`` and
``flexhub.csi/namespace`` when the controller set them. It is validated on exactly the
FlexVolume driver's path
(:func:`flexhub.driver.loader.load_backend`, :func:`flexhub.settings.check_backend_table`,
:func:`flexhub.driver.validation.validate_options`, the backend's ``check_options`` and
``check``). The capability's ``volume_mount_group`` is the volume's fsGroup, applied as the
FlexVolume driver applies ``kubernetes.io/mounterArgs.FsGroup`` (a read-write block volume's
filesystem root gets the group, ``g+rwx`` and setgid; cifs mounts with ``gid=``; NFS is never
chowned). The capability's ``mount_flags`` join the options' ``mountOptions``, so the
backend's schema and the core's allow-list judge them as they judge a PV's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc

from flexhub.backend import Backend, BlockBackend, FilesystemBackend
from flexhub.config import NodeConfig
from flexhub.csi.proto import csi_pb2
from flexhub.csi.status import CsiError
from flexhub.errors import InvalidOptions, remember_secrets
from flexhub.node import Node
from flexhub.volume import PodInfo, Secret, Secrets, Volume

__all__ = [
    "CONTEXT_FS_TYPE",
    "CONTEXT_NAMESPACE",
    "backend_class",
    "check_capability",
    "flexhub_volume",
    "is_block",
    "mount_group",
    "secrets_of",
]

#: The volume context key of the filesystem the controller chose (the class's ``fsType``).
CONTEXT_FS_TYPE = "flexhub.csi/fsType"
#: The volume context key of the claim's namespace: a backend that resolves a volume in its
#: pod's namespace (loopfile's per-namespace areas) gets it as the pod's, since a CSI stage
#: names no pod. Only the controller (or an admin's static PV) writes a volume context.
CONTEXT_NAMESPACE = "flexhub.csi/namespace"
_OWN_KEYS = (CONTEXT_FS_TYPE, CONTEXT_NAMESPACE)
#: Keys the sidecars add: ``csi.storage.k8s.io/pvc/name``, ... and external-provisioner's
#: ``storage.kubernetes.io/csiProvisionerIdentity`` in every PV it makes: never the backend's.
_SIDECAR_PREFIXES = ("csi.storage.k8s.io/", "storage.kubernetes.io/")

_Mode = csi_pb2.VolumeCapability.AccessMode.Mode
#: Access modes of one node (every backend) and of several (filesystem backends only).
SINGLE_NODE = frozenset(
    {
        _Mode.SINGLE_NODE_WRITER,
        _Mode.SINGLE_NODE_READER_ONLY,
        _Mode.SINGLE_NODE_SINGLE_WRITER,
        _Mode.SINGLE_NODE_MULTI_WRITER,
    }
)
MULTI_NODE = frozenset(
    {
        _Mode.MULTI_NODE_READER_ONLY,
        _Mode.MULTI_NODE_SINGLE_WRITER,
        _Mode.MULTI_NODE_MULTI_WRITER,
    }
)
READ_ONLY_MODES = frozenset({_Mode.SINGLE_NODE_READER_ONLY, _Mode.MULTI_NODE_READER_ONLY})


def invalid(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.INVALID_ARGUMENT, message)


def secrets_of(raw: Mapping[str, str]) -> Secrets:
    """The request's secrets (raw values, as CSI sends them), remembered for redaction."""
    remember_secrets(raw.values())
    return Secrets({key: Secret(value) for key, value in raw.items()})


def backend_class(name: str, config: NodeConfig) -> type[Backend]:
    from flexhub.driver.loader import load_backend
    from flexhub.settings import check_backend_table

    cls = load_backend(name or None, config)
    check_backend_table(config, name, cls)
    return cls


def is_block(capability: Any) -> bool:
    """Whether the capability asks for a raw block volume (access type ``block``)."""
    return bool(capability.WhichOneof("access_type") == "block")


def mount_group(capability: Any) -> int | None:
    """The capability's ``volume_mount_group`` (node capability ``VOLUME_MOUNT_GROUP``: the
    pod's fsGroup, delegated to the driver) as a group id, ``None`` when absent.

    :raises CsiError: ``INVALID_ARGUMENT`` when it is no decimal group id.
    """
    if capability.WhichOneof("access_type") != "mount":
        return None
    raw = capability.mount.volume_mount_group
    if not raw:
        return None
    if not raw.isdigit() or not raw.isascii() or len(raw) > 10 or int(raw) > 0xFFFFFFFE:
        raise invalid(f"volume_mount_group {raw[:40]!r} is not a decimal group id")
    return int(raw)


def check_capability(capability: Any, cls: type[Backend] | None = None) -> str:
    """Refuse a capability flexhub cannot serve; return the reason (``""``: supported).

    Raw block volumes (access type ``block``) only for block backends; several nodes only
    for filesystem backends.
    """
    access = capability.WhichOneof("access_type")
    if access == "block":
        if cls is not None and not issubclass(cls, BlockBackend):
            return f"raw block volumes (access type block): a {cls.__name__} volume has no device"
    elif access != "mount":
        return "the volume capability has no access type (mount or block)"
    mode = capability.access_mode.mode
    if mode in SINGLE_NODE:
        return ""
    if mode in MULTI_NODE:
        if cls is None or issubclass(cls, FilesystemBackend):
            return ""
        return f"access mode {_Mode.Name(mode)}: a {cls.__name__} volume is one node's"
    return f"access mode {mode} is not supported"


def flexhub_volume(
    context: Mapping[str, str],
    capability: Any,
    secrets: Mapping[str, str],
    config: NodeConfig,
    *,
    read_only: bool = False,
    expanding: bool = False,
) -> tuple[Volume, Backend, Node]:
    """Validate a node request's volume as the FlexVolume driver validates a ``mount``
    (``expanding``: NodeExpandVolume, as it validates ``expandfs``, a call without a pod: it
    logs in to nothing, so an iSCSI CHAP volume's credentials are not required, and kubelet
    sends secrets there only with a ``nodeExpandSecretRef``). The volume returned keeps the
    context's namespace either way (loopfile resolves its file in it).

    :raises CsiError: ``INVALID_ARGUMENT`` for a context that names no backend or a
        capability flexhub cannot serve.
    :raises InvalidOptions: the options fail the backend's schema or checks.
    """
    from flexhub.driver.memo import Memo
    from flexhub.driver.validation import validate_options

    options = {
        k: v
        for k, v in context.items()
        if not k.startswith(_SIDECAR_PREFIXES) and k not in _OWN_KEYS
    }
    if not options.get("backend"):
        raise invalid("the volume context names no backend (key 'backend')")
    fs_group = mount_group(capability)
    cls = backend_class(options["backend"], config)
    reason = check_capability(capability, cls)
    if reason:
        raise invalid(reason)
    flags = [f for f in capability.mount.mount_flags if f]
    if flags:
        if any("," in f for f in flags):
            raise InvalidOptions("a mount flag must not contain a comma")
        given = [o for o in options.get("mountOptions", "").split(",") if o]
        options["mountOptions"] = ",".join([*given, *(f for f in flags if f not in given)])
    validate_options(cls, options, Memo(config.state_dir))
    volume = Volume(
        options=options,
        fs_type=capability.mount.fs_type
        or options.get("kubernetes.io/fsType", "")
        or context.get(CONTEXT_FS_TYPE, ""),
        # a PV's options may ask read-only as kubelet's own key (the FlexVolume driver honours it)
        read_only=read_only
        or capability.access_mode.mode in READ_ONLY_MODES
        or options.get("kubernetes.io/readwrite") == "ro",
        fs_group=fs_group,
        pod=PodInfo(namespace=context.get(CONTEXT_NAMESPACE, "")),
        secrets=secrets_of(secrets),
    )
    node = Node(config, backend=volume.backend)
    backend = cls(node)
    cls.check_options(volume)
    if expanding:
        backend.check(
            Volume(
                options=volume.options,
                fs_type=volume.fs_type,
                read_only=volume.read_only,
                fs_group=volume.fs_group,
                secrets=volume.secrets,
            )
        )
    else:
        backend.check(volume)
    return volume, backend, node
