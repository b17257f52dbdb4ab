"""The records of converted volumes: what ``DeleteVolume`` reclaims of a volume it never made.

``flexhub convert`` moves a FlexVolume PV onto the CSI driver with its ``volumeHandle``
``<backend>:<uid of the original claim>``: the controller holds no record of it in its state
directory (:mod:`flexhub.csi.records`). When the FlexVolume PV was the provisioner's, with its
reclaim record under the provisioner's seal, convert writes the record the controller would
have kept into a ConfigMap of flexhub's namespace, ``flexhub-volume-<uid>`` (key
``record.json``, labels :data:`~flexhub.csi.records.ADOPTION_LABELS`), and only then gives the
CSI PV back its ``Delete`` policy.

The controller trusts such a record because of who can write it: ConfigMaps in flexhub's
namespace are the cluster administrators' (and ``flexhub convert`` runs as one); none of the
chart's accounts may create, update or patch one (the CSI controller's may get and delete
them, tests/cluster/test_chart_csi.py). It still refuses, in one line and without acting, a
record that names another volume, another backend, or is malformed; and the backend's own
checks run on its options as on every record (a loop file is removed only when its name is
the claim's, ``pvc-<claimUid>.img``).

A local record wins (a converted volume grown by ``ControllerExpandVolume`` is recorded
locally with its new size). An API that does not answer is ``UNAVAILABLE``: the sidecar tries
again, where answering "gone already" would leave the storage behind for good. A controller
with no API client (no ``--kubeconfig``, no service account) adopts nothing, as before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import grpc

from flexhub.csi.records import (
    ADOPTION_LABELS,
    ADOPTION_RECORD_KEY,
    VolumeRecord,
    adoption_name,
    record_of,
    uid_of_volume,
)
from flexhub.csi.status import CsiError

__all__ = ["Adoptions", "check_record"]

LOG = logging.getLogger(__name__)

#: Seconds an API call may take.
API_TIMEOUT = 15


def _strings(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def check_record(data: Any, volume_id: str) -> VolumeRecord:
    """The record in ``data`` (a ``record.json`` object) of volume ``volume_id``.

    :raises ValueError: malformed, or it is not ``volume_id``'s (one line, quoting nothing
        of the record but its volume id, cut short).
    """
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    try:
        record = record_of(data)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"a field is missing or wrong ({type(exc).__name__})") from None
    text = ("name", "volume_id", "backend", "fs_type", "node", "namespace")
    if not all(isinstance(getattr(record, f), str) for f in text):
        raise ValueError("a field is not a string")
    if not all(_strings(data[f]) for f in ("parameters", "options", "reclaim")):
        raise ValueError("parameters, options and reclaim must map strings to strings")
    if isinstance(record.size, bool) or not isinstance(record.size, int) or record.size < 0:
        raise ValueError("size must be a whole number of bytes")
    if record.source not in (None, ""):
        raise ValueError("a converted volume has no content source")
    if record.volume_id != volume_id:
        raise ValueError(f"it is the record of volume {record.volume_id[:120]!r}")
    backend, _, _ = volume_id.rpartition(":")
    if record.backend != backend or record.options.get("backend") != backend:
        raise ValueError(f"its backend is not the volume id's ({backend[:40]!r})")
    return record


class Adoptions:
    """The converted volumes' records in ``namespace``, read through ``core`` (a
    ``CoreV1Api``)."""

    def __init__(self, core: Any, namespace: str) -> None:
        self.core = core
        self.namespace = namespace

    def get(self, volume_id: str) -> VolumeRecord | None:
        """The record convert left for ``volume_id``; ``None``: none (never converted, or
        deleted already).

        :raises CsiError: UNAVAILABLE, the API did not answer; FAILED_PRECONDITION, a record
            that is not ``volume_id``'s or is malformed.
        """
        uid = uid_of_volume(volume_id)
        if not uid:
            return None
        name = adoption_name(uid)
        from kubernetes.client.rest import ApiException

        try:
            found = self.core.read_namespaced_config_map(
                name, self.namespace, _request_timeout=API_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise self._unavailable(name, f"HTTP {exc.status} {exc.reason}") from None
        except Exception as exc:  # urllib3's: the address, never a token
            raise self._unavailable(name, type(exc).__name__) from None
        where = f"ConfigMap {self.namespace}/{name}"
        meta, data = _parts(found)
        labels = meta.get("labels") or {}
        try:
            if any(labels.get(k) != v for k, v in ADOPTION_LABELS.items()):
                raise ValueError("it is not flexhub convert's (its labels)")
            try:
                raw = json.loads(data.get(ADOPTION_RECORD_KEY) or "")
            except ValueError:
                raise ValueError(f"its {ADOPTION_RECORD_KEY} is not JSON") from None
            record = check_record(raw, volume_id)
        except ValueError as exc:
            raise CsiError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"volume {volume_id}: the converted volume's record {where} is refused: {exc}",
            ) from None
        LOG.info(
            "volume %s: converted by flexhub convert, its record read from %s", volume_id, where
        )
        return record

    def forget(self, volume_id: str) -> None:
        """Delete the record of ``volume_id`` (its storage is reclaimed); none is fine.

        :raises CsiError: UNAVAILABLE, the API did not answer (the sidecar calls again and
            the reclaim, done already, is a no-op).
        """
        uid = uid_of_volume(volume_id)
        if not uid:
            return
        name = adoption_name(uid)
        from kubernetes.client.rest import ApiException

        try:
            self.core.delete_namespaced_config_map(
                name, self.namespace, _request_timeout=API_TIMEOUT
            )
        except ApiException as exc:
            if exc.status != 404:
                raise self._unavailable(name, f"HTTP {exc.status} {exc.reason}") from None
        except Exception as exc:
            raise self._unavailable(name, type(exc).__name__) from None

    def _unavailable(self, name: str, why: str) -> CsiError:
        return CsiError(
            grpc.StatusCode.UNAVAILABLE,
            f"cannot reach the record of converted volumes {self.namespace}/{name}: {why}; "
            "try again",
        )


def _parts(found: Any) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """``(metadata, data)`` of a ConfigMap read (a model object or a dict)."""
    if isinstance(found, dict):
        return found.get("metadata") or {}, found.get("data") or {}
    meta = getattr(found, "metadata", None)
    labels = getattr(meta, "labels", None) or {}
    return {"labels": labels}, getattr(found, "data", None) or {}
