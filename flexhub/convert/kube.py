"""The API calls of ``flexhub convert``: reads as plain dicts, writes that tolerate a rerun
(a create that finds the object, a delete that finds it gone), deletes with a uid
precondition (never another object of the same name)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from flexhub.errors import ConvertError, one_line

__all__ = ["Kube", "api_error"]

#: What a request may take.
_REQUEST = 30


def _status(exc: BaseException) -> int:
    return int(getattr(exc, "status", 0) or 0)


class Kube:
    """The calls over one API client."""

    def __init__(self, api: Any) -> None:
        from kubernetes import client

        self.api = api
        self.core = client.CoreV1Api(api)

    def _get(self, read: Callable[..., Any], *args: str) -> dict[str, Any] | None:
        from kubernetes.client.rest import ApiException

        try:
            found = read(*args, _request_timeout=_REQUEST)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        plain: dict[str, Any] = self.api.sanitize_for_serialization(found)
        return plain

    # -- reads -------------------------------------------------------------------------------

    def claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get(self.core.read_namespaced_persistent_volume_claim, name, namespace)

    def pv(self, name: str) -> dict[str, Any] | None:
        return self._get(self.core.read_persistent_volume, name)

    def config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get(self.core.read_namespaced_config_map, name, namespace)

    def sealing_key(self, namespace: str) -> bytes | None:
        """The FlexVolume provisioner's sealing key in ``namespace`` (``None``: none there,
        or no usable one)."""
        from flexhub.errors import FlexhubError
        from flexhub.provisioner.seal import load_key

        try:
            return load_key(self.core, namespace, create=False)
        except FlexhubError:
            return None

    def lease_age(self, namespace: str, name: str) -> float | None:
        """Seconds since Lease ``namespace/name`` was last renewed (``None``: no such Lease,
        or never renewed)."""
        import datetime

        from kubernetes import client

        read = client.CoordinationV1Api(self.api).read_namespaced_lease
        found = self._get(read, name, namespace)
        renewed = ((found or {}).get("spec") or {}).get("renewTime") or ""
        try:
            when = datetime.datetime.fromisoformat(str(renewed).replace("Z", "+00:00"))
        except ValueError:
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        return (datetime.datetime.now(datetime.UTC) - when).total_seconds()

    def namespace_exists(self, namespace: str) -> bool:
        return self._get(self.core.read_namespace, namespace) is not None

    def claims(self, namespace: str) -> list[str]:
        found = self.core.list_namespaced_persistent_volume_claim(
            namespace, _request_timeout=_REQUEST
        )
        return sorted(c.metadata.name for c in found.items)

    def saved_claims(self, backup_namespace: str, namespace: str) -> list[str]:
        """The claims of ``namespace`` with a saved copy in ``backup_namespace``."""
        found = self.core.list_namespaced_config_map(
            backup_namespace,
            label_selector="app.kubernetes.io/managed-by=flexhub-convert",
            _request_timeout=_REQUEST,
        )
        names = []
        for cm in found.items:
            ns, _, name = ((cm.metadata.annotations or {}).get("flexhub/claim") or "").partition(
                "/"
            )
            if ns == namespace and name:
                names.append(name)
        return sorted(names)

    def pods_using(self, namespace: str, claim: str) -> list[str]:
        """Pods of ``namespace`` (neither Succeeded nor Failed) whose volumes name ``claim``."""
        found = self.core.list_namespaced_pod(namespace, _request_timeout=_REQUEST)
        names = []
        for pod in found.items:
            if (pod.status and pod.status.phase) in ("Succeeded", "Failed"):
                continue
            for volume in (pod.spec and pod.spec.volumes) or []:
                source = volume.persistent_volume_claim
                # a generic ephemeral volume's claim is named <pod>-<volume>
                ephemeral = volume.ephemeral is not None and (
                    f"{pod.metadata.name}-{volume.name}" == claim
                )
                if ephemeral or (source is not None and source.claim_name == claim):
                    names.append(pod.metadata.name)
                    break
        return sorted(names)

    def nodes_using(self, names: set[str]) -> list[str]:
        """Nodes whose ``status.volumesInUse`` names one of ``names`` (a PV name or a CSI
        volume handle). kubelet reports only attachable plugins' volumes there: never a
        FlexVolume of flexhub, whose ``init`` answers ``attach: false``."""
        found = self.core.list_node(_request_timeout=_REQUEST)
        nodes = []
        for node in found.items:
            for unique in (node.status and node.status.volumes_in_use) or []:
                if {unique.rsplit("/", 1)[-1], unique.rsplit("^", 1)[-1]} & names:
                    nodes.append(node.metadata.name)
                    break
        return sorted(nodes)

    # -- writes ------------------------------------------------------------------------------

    def create_claim(self, body: Mapping[str, Any]) -> dict[str, Any]:
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        return self._create(
            lambda: self.core.create_namespaced_persistent_volume_claim(
                ns, body, _request_timeout=_REQUEST
            ),
            lambda: self.claim(ns, name),
        )

    def create_pv(self, body: Mapping[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return self._create(
            lambda: self.core.create_persistent_volume(body, _request_timeout=_REQUEST),
            lambda: self.pv(name),
        )

    def create_config_map(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return self._create(
            lambda: self.core.create_namespaced_config_map(
                namespace, body, _request_timeout=_REQUEST
            ),
            lambda: self.config_map(namespace, name),
        )

    def _create(
        self, create: Callable[[], Any], read: Callable[[], dict[str, Any] | None]
    ) -> dict[str, Any]:
        from kubernetes.client.rest import ApiException

        try:
            plain: dict[str, Any] = self.api.sanitize_for_serialization(create())
            return plain
        except ApiException as exc:
            if exc.status != 409:
                raise
        found = read()
        if found is None:
            raise ConvertError("an object that was there a moment ago is gone: run again")
        return found

    def patch_config_map(
        self,
        namespace: str,
        name: str,
        data: Mapping[str, str],
        labels: Mapping[str, str] | None = None,
    ) -> None:
        from kubernetes.client.rest import ApiException

        body: dict[str, Any] = {"data": dict(data)}
        if labels:
            body["metadata"] = {"labels": dict(labels)}
        try:
            self.core.patch_namespaced_config_map(name, namespace, body, _request_timeout=_REQUEST)
        except ApiException as exc:
            if exc.status != 404:
                raise
            raise ConvertError(
                f"ConfigMap {namespace}/{name} is gone meanwhile (a rollback beside this run?): "
                "run flexhub convert again"
            ) from None

    def delete_config_map(self, namespace: str, name: str) -> None:
        self._delete(lambda: self.core.delete_namespaced_config_map(name, namespace))

    def set_pv(
        self,
        pv: Mapping[str, Any],
        policy: str,
        finalizers: list[str] | None = None,
        unchanged: bool = False,
        annotations: Mapping[str, str] | None = None,
    ) -> None:
        """Set the reclaim policy (and, when given, the finalizers) of the PV as read: a JSON
        patch tested against its uid, so it never lands on another PV of that name; with
        ``unchanged``, against its resourceVersion too (a PV changed since it was read, by
        a rollback running beside, is left alone: the API server answers 422)."""
        patch: list[dict[str, Any]] = [
            {"op": "test", "path": "/metadata/uid", "value": pv["metadata"]["uid"]},
        ]
        if unchanged:
            version = pv["metadata"]["resourceVersion"]
            patch.append({"op": "test", "path": "/metadata/resourceVersion", "value": version})
        patch.append(
            {"op": "replace", "path": "/spec/persistentVolumeReclaimPolicy", "value": policy}
        )
        if finalizers is not None:
            patch.append({"op": "add", "path": "/metadata/finalizers", "value": finalizers})
        for key, value in (annotations or {}).items():  # a PV convert wrote: it has some
            path = "/metadata/annotations/" + key.replace("~", "~0").replace("/", "~1")
            patch.append({"op": "add", "path": path, "value": value})
        from kubernetes.client.rest import ApiException

        name = pv["metadata"]["name"]
        try:
            self.core.patch_persistent_volume(name, patch, _request_timeout=_REQUEST)
        except ApiException as exc:
            if exc.status not in (409, 422) or not unchanged:
                raise
            raise ConvertError(
                f"PV {name} changed while its reclaim policy was set (another flexhub convert "
                "or rollback beside this run?): its policy is unchanged; run flexhub convert "
                "again"
            ) from None

    def delete_claim(self, namespace: str, name: str, uid: str) -> None:
        body = {"preconditions": {"uid": uid}}
        self._delete(
            lambda: self.core.delete_namespaced_persistent_volume_claim(
                name, namespace, body=body, _request_timeout=_REQUEST
            )
        )

    def delete_pv(self, name: str, uid: str) -> None:
        body = {"preconditions": {"uid": uid}}
        self._delete(
            lambda: self.core.delete_persistent_volume(name, body=body, _request_timeout=_REQUEST)
        )

    @staticmethod
    def _delete(delete: Callable[[], Any]) -> None:
        from kubernetes.client.rest import ApiException

        try:
            delete()
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone, or another object of the name now
                raise

    # -- waits -------------------------------------------------------------------------------

    @staticmethod
    def wait(what: str, done: Callable[[], str | None], timeout: float, hint: str = "") -> None:
        """Poll ``done`` (``None``: done; else why not yet) until done or ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            why = done()
            if why is None:
                return
            if time.monotonic() > deadline:
                raise ConvertError(
                    one_line(f"{what}: not after {timeout:.0f} s ({why}){hint}", 400)
                )
            time.sleep(0.5)


def api_error(exc: BaseException) -> str:
    """One line of an ``ApiException``: the status and the API server's message."""
    import json

    body = getattr(exc, "body", None)
    message = ""
    if body:
        try:
            message = str(json.loads(body).get("message", ""))
        except (ValueError, AttributeError):
            message = str(body)
    return one_line(f"API {_status(exc)} {getattr(exc, 'reason', '')}: {message}", 300)
