"""The optional provisioning interface of a backend: storage made for a claim, and reclaimed.

``flexhub provisioner`` (a Deployment) serves every StorageClass whose ``provisioner`` is
``flexhub``; the class's ``backend`` parameter picks the backend, the other parameters are
validated against the backend's :attr:`Provisioning.parameters_schema_file` and handed to it.
A backend that can provision mixes in :class:`Provisioning` next to its volume class::

    class NfsBackend(FilesystemBackend, Provisioning):
        parameters_schema_file = "provision-schema.json"

        def provision(self, claim, parameters, secrets): ...
        def reclaim(self, options, reclaim, secrets): ...

The provisioner owns everything on the API side: the PV's name (``pvc-<claim uid>``), its
claim reference, finalizer, access modes, reclaim policy and node affinity, retries and
Events. A backend only makes and removes storage, and it must be **idempotent**: the same
claim may be provisioned again after a crash (find and return what the first call made: name
assets from :attr:`Claim.uid`), and reclaiming storage that is already gone is success.

Everything :meth:`Provisioning.reclaim` needs is in what :meth:`Provisioning.provision`
returned (kept on the PV), never recomputed from a StorageClass that may have changed since.

.. versionadded:: 0.3
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from flexhub.errors import BackendError, NotSupported
from flexhub.node.frozen import Frozen
from flexhub.volume import Secrets

__all__ = ["Claim", "Provisioned", "Provisioning", "ReclaimOn"]

#: Where a backend's storage is reclaimed: by the provisioner (it reaches the storage over the
#: network) or by the flexhub DaemonSet pod of the node that holds it (a loop file).
ReclaimOn = str
PROVISIONER: ReclaimOn = "provisioner"
NODE: ReclaimOn = "node"


class Claim(Frozen):
    """The claim a volume is made for, as the provisioner read it from the API.

    ``size`` is the requested size in bytes; ``selected_node`` is the node the scheduler chose
    (``volume.kubernetes.io/selected-node``, set for ``WaitForFirstConsumer`` classes), ``""``
    otherwise.
    """

    # the fields, in order
    __slots__ = (  # noqa: RUF023
        "uid",
        "namespace",
        "name",
        "size",
        "access_modes",
        "annotations",
        "labels",
        "selected_node",
    )
    uid: str
    namespace: str
    name: str
    size: int
    access_modes: tuple[str, ...]
    annotations: Mapping[str, str]
    labels: Mapping[str, str]
    selected_node: str

    def __init__(
        self,
        uid: str,
        namespace: str,
        name: str,
        size: int,
        access_modes: tuple[str, ...] = ("ReadWriteOnce",),
        annotations: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        selected_node: str = "",
    ) -> None:
        self._set(
            uid=uid,
            namespace=namespace,
            name=name,
            size=size,
            access_modes=access_modes,
            annotations={} if annotations is None else annotations,
            labels={} if labels is None else labels,
            selected_node=selected_node,
        )

    @property
    def volume_name(self) -> str:
        """The PV's name, and the stem every asset made for this claim is named from."""
        return f"pvc-{self.uid}"


class Provisioned(Frozen):
    """What a backend made for a claim.

    :param options: the PV's ``flexVolume.options`` (``backend`` is added by the provisioner).
        Never a secret: options are readable by anyone who may read PVs.
    :param size: the capacity in bytes (at least the claim's).
    :param reclaim: what :meth:`Provisioning.reclaim` needs later, kept on the PV as an
        annotation (never a secret). Often empty: the options say it all.
    :param fs_type: the PV's ``flexVolume.fsType`` (``""``: none).
    :param secret: ``(namespace, name)`` of the Secret the PV's ``secretRef`` names (its type
        must be ``k8s/flexhub``), or ``None``.
    :param node: the node whose storage it is (the PV gets node affinity for it), or ``""``.
    """

    # the fields, in order
    __slots__ = (  # noqa: RUF023
        "options",
        "size",
        "reclaim",
        "fs_type",
        "secret",
        "node",
    )
    options: Mapping[str, str]
    size: int
    reclaim: Mapping[str, str]
    fs_type: str
    secret: tuple[str, str] | None
    node: str

    def __init__(
        self,
        options: Mapping[str, str],
        size: int,
        reclaim: Mapping[str, str] | None = None,
        fs_type: str = "",
        secret: tuple[str, str] | None = None,
        node: str = "",
    ) -> None:
        self._set(
            options=options,
            size=size,
            reclaim={} if reclaim is None else reclaim,
            fs_type=fs_type,
            secret=secret,
            node=node,
        )


class Provisioning:
    """Mixed into a backend class that can make and reclaim storage for claims."""

    #: The JSON Schema (draft 2020-12) of the StorageClass ``parameters`` the backend reads,
    #: beside its options schema in the same package. ``backend`` and the provisioner's own
    #: keys (``onDelete``, ``secretName``, ``secretNamespace``) are checked by the provisioner
    #: and need not be listed... unless the backend reads them too.
    parameters_schema_file: ClassVar[str] = "provision-schema.json"
    #: Where :meth:`reclaim` runs: ``"provisioner"`` or ``"node"`` (then the claim's selected
    #: node's flexhub DaemonSet pod calls it, and the class must be ``WaitForFirstConsumer``).
    reclaim_on: ClassVar[ReclaimOn] = PROVISIONER
    #: Whether :meth:`expand_storage` grows the storage on the provisioner's side (a LUN);
    #: ``False``: the node's ``expandfs`` does it all (a loop file), or nothing enforces the
    #: size (NFS).
    expands_storage: ClassVar[bool] = False
    #: The ``onDelete`` values the backend honours (``delete`` is always one).
    on_delete: ClassVar[frozenset[str]] = frozenset({"delete", "retain"})
    #: Whether the backend implements :meth:`snapshot`, :meth:`delete_snapshot`,
    #: :meth:`restore` and :meth:`clone` (served by the CSI controller only).
    snapshots: ClassVar[bool] = False

    @classmethod
    def parameters_schema(cls) -> dict[str, Any]:
        """Return the StorageClass parameters schema as a dict."""
        package = getattr(cls, "schema_package", "") or cls.__module__
        try:
            from importlib import resources

            text = resources.files(package).joinpath(cls.parameters_schema_file).read_text()
            loaded = json.loads(text)
        except (OSError, ValueError, ModuleNotFoundError) as exc:
            raise BackendError(
                f"backend parameters schema {package}/{cls.parameters_schema_file} "
                f"unreadable: {exc}"
            ) from None
        if not isinstance(loaded, dict):
            raise BackendError(f"backend parameters schema {package} is not an object")
        return loaded

    @classmethod
    def check_parameters(cls, parameters: Mapping[str, str]) -> None:
        """Rules on the parameters a schema cannot express; raise :class:`InvalidOptions`
        naming the parameter."""

    def provision(
        self, claim: Claim, parameters: Mapping[str, str], secrets: Secrets
    ) -> Provisioned:
        """Make storage for ``claim`` (or find what an earlier call made for it) and return it.

        ``secrets`` holds the Secret the class names (``secretName``/``secretNamespace``),
        decoded; empty when it names none.

        :raises InvalidOptions: a parameter is wrong (one line naming it); not retried soon.
        :raises FlexhubError: anything else; the provisioner retries with backoff.
        """
        raise NotSupported(f"{type(self).__name__} cannot provision")

    def reclaim(
        self, options: Mapping[str, str], reclaim: Mapping[str, str], secrets: Secrets
    ) -> None:
        """Delete (or archive, as ``reclaim["onDelete"]`` says) the storage of a released PV.

        ``options`` are the PV's ``flexVolume.options`` and ``reclaim`` what :meth:`provision`
        returned for it, plus ``onDelete`` and ``size`` (the volume's size now, in bytes; the
        same in ``expand_storage`` and ``snapshot``). Idempotent: storage already gone is
        success.
        """
        raise NotSupported(f"{type(self).__name__} cannot reclaim")

    def check_expansion(self, options: Mapping[str, str], new_size: int) -> None:
        """Refuse growing the volume of the PV ``options`` to ``new_size`` bytes where the
        backend bounds it (loopfile: the ``maxSize`` its PV carries), before anything grows:
        called for every backend, whether or not :attr:`expands_storage`.

        :raises InvalidOptions: one line naming the bound; nothing is grown.
        """

    def expand_storage(
        self,
        options: Mapping[str, str],
        reclaim: Mapping[str, str],
        new_size: int,
        secrets: Secrets,
    ) -> int:
        """Grow the storage to at least ``new_size`` bytes; return the new size. Only called
        when :attr:`expands_storage` is set."""
        raise NotSupported(f"{type(self).__name__} cannot expand storage")

    def capacity(self, parameters: Mapping[str, str]) -> int:
        """Optional (CSI ``GetCapacity``): the bytes a new volume of a class with
        ``parameters`` can have now, where the backend knows (with ``reclaim_on = "node"``:
        on the node this runs on). Read only: nothing is reserved."""
        raise NotSupported(f"{type(self).__name__} does not know its capacity")

    def max_volume_size(self, parameters: Mapping[str, str]) -> int | None:
        """Optional (CSI ``GetCapacity``'s ``maximum_volume_size``, which the scheduler
        compares with a claim): the largest volume a class with ``parameters`` allows,
        whatever the room (loopfile: ``maxSize``); ``None``: no bound but :meth:`capacity`.
        Called only after :meth:`capacity` answered for the same ``parameters``."""
        return None

    # Optional, for the CSI controller's snapshots and clones (``snapshots = True``). With
    # ``reclaim_on = "node"`` every call runs on the volume's node.

    def snapshot(
        self,
        options: Mapping[str, str],
        reclaim: Mapping[str, str],
        name: str,
        namespace: str,
        secrets: Secrets,
    ) -> dict[str, str]:
        """Copy the volume's data as it is now into a snapshot called ``name``
        (``snap-<uid>``), kept where no volume's options can reach it; idempotent (the same
        ``name`` again returns what the first call made).

        :returns: the snapshot's record (strings, never a secret), given back to
            :meth:`restore` and :meth:`delete_snapshot`: ``size`` (bytes) is required, ``how``
            says how the data was copied (shown in the reply's log).
        """
        raise NotSupported(f"{type(self).__name__} cannot make snapshots")

    def delete_snapshot(self, snapshot: Mapping[str, str], secrets: Secrets) -> None:
        """Delete a snapshot :meth:`snapshot` made; gone already is success."""
        raise NotSupported(f"{type(self).__name__} cannot delete snapshots")

    def restore(
        self,
        claim: Claim,
        parameters: Mapping[str, str],
        snapshot: Mapping[str, str],
        secrets: Secrets,
    ) -> Provisioned:
        """:meth:`provision` for ``claim`` with the snapshot's data (byte for byte, grown to
        ``claim.size`` when larger); idempotent as :meth:`provision`."""
        raise NotSupported(f"{type(self).__name__} cannot restore snapshots")

    def clone(
        self,
        claim: Claim,
        parameters: Mapping[str, str],
        options: Mapping[str, str],
        namespace: str,
        secrets: Secrets,
    ) -> Provisioned:
        """:meth:`provision` for ``claim`` with a copy of the data of the volume of
        ``options`` (in ``namespace``); idempotent as :meth:`provision`."""
        raise NotSupported(f"{type(self).__name__} cannot clone volumes")
