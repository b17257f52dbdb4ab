"""An in-memory stand-in for the few Kubernetes API calls the controller and node agent make.

For unit logic only (which object is read, what is refused, what is written); the same
behaviour runs against the real API server in tests/cluster/. Objects are plain dicts, as
the controller reads them (``get`` sanitises through ``api.sanitize_for_serialization``).
"""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

from kubernetes.client.rest import ApiException

_versions = itertools.count(1)


def _missing(kind: str, name: str) -> ApiException:
    exc = ApiException(status=404, reason="Not Found")
    exc.body = json.dumps({"kind": "Status", "code": 404, "message": f'{kind} "{name}" not found'})
    return exc


class FakeApi:
    """What ``get`` needs of an ``ApiClient``; holds every object."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.volumes: dict[str, dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.classes: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.calls: list[str] = []
        #: ``create_persistent_volume`` raises this when set (a 422 from admission, say)
        self.refuse_pv: ApiException | None = None
        #: a strategic-merge patch of a claim (the hold) raises this when set (a 403, say)
        self.refuse_claim_patch: ApiException | None = None
        self.core = FakeCore(self)
        self.storage = FakeStorage(self)

    def sanitize_for_serialization(self, obj: Any) -> Any:
        return copy.deepcopy(obj)

    # ------------------------------------------------------------------ builders

    def add(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        meta.setdefault("resourceVersion", str(next(_versions)))
        if kind == "claim":
            self.claims[(meta["namespace"], meta["name"])] = obj
        elif kind == "volume":
            self.volumes[meta["name"]] = obj
        elif kind == "node":
            self.nodes[meta["name"]] = obj
        elif kind == "secret":
            self.secrets[(meta["namespace"], meta["name"])] = obj
        elif kind == "class":
            self.classes[meta["name"]] = obj
        return obj


class FakeCore:
    def __init__(self, api: FakeApi) -> None:
        self.api = api
        self.api_client = api

    def read_namespaced_persistent_volume_claim(self, name: str, namespace: str, **_: Any) -> Any:
        self.api.calls.append(f"get claim {namespace}/{name}")
        try:
            return self.api.claims[(namespace, name)]
        except KeyError:
            raise _missing("persistentvolumeclaims", name) from None

    def patch_namespaced_persistent_volume_claim(
        self, name: str, namespace: str, body: Any, **_: Any
    ) -> Any:
        """The finalizer patches the controller sends: a strategic merge that appends one,
        a JSON patch that swaps the list if the resourceVersion is unchanged."""
        self.api.calls.append(f"patch claim {namespace}/{name}")
        try:
            pvc = self.api.claims[(namespace, name)]
        except KeyError:
            raise _missing("persistentvolumeclaims", name) from None
        meta = pvc["metadata"]
        if isinstance(body, list):
            for op in body:
                if op["op"] == "test" and op["path"] == "/metadata/resourceVersion":
                    if meta["resourceVersion"] != op["value"]:
                        raise ApiException(status=409, reason="Conflict")
                elif op["op"] == "replace" and op["path"] == "/metadata/finalizers":
                    meta["finalizers"] = op["value"]
                elif op["op"] == "remove" and op["path"].startswith("/metadata/annotations/"):
                    key = op["path"].removeprefix("/metadata/annotations/")
                    key = key.replace("~1", "/").replace("~0", "~")
                    if key not in (meta.get("annotations") or {}):
                        raise ApiException(status=422, reason="Unprocessable Entity")
                    del meta["annotations"][key]
                else:
                    raise AssertionError(f"the fake API does not do {op}")
        else:
            if self.api.refuse_claim_patch is not None:
                raise self.api.refuse_claim_patch
            meta.setdefault("annotations", {}).update(body["metadata"].get("annotations") or {})
            added = [
                f for f in body["metadata"]["finalizers"] if f not in meta.get("finalizers", [])
            ]
            if added and meta.get("deletionTimestamp"):
                # as the API server: no new finalizer on an object being deleted
                raise ApiException(status=422, reason="Unprocessable Entity")
            meta["finalizers"] = [*meta.get("finalizers", []), *added]
        meta["resourceVersion"] = str(next(_versions))
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            del self.api.claims[(namespace, name)]
        return pvc

    def delete_namespaced_persistent_volume_claim(self, name: str, namespace: str, **_: Any) -> Any:
        """A tenant's delete (the controller never deletes a claim)."""
        pvc = self.api.claims[(namespace, name)]
        if pvc["metadata"].get("finalizers"):
            pvc["metadata"]["deletionTimestamp"] = "2026-12-05T00:00:00Z"
            pvc["metadata"]["resourceVersion"] = str(next(_versions))
        else:
            del self.api.claims[(namespace, name)]

    def read_persistent_volume(self, name: str, **_: Any) -> Any:
        self.api.calls.append(f"get pv {name}")
        try:
            return self.api.volumes[name]
        except KeyError:
            raise _missing("persistentvolumes", name) from None

    def read_node(self, name: str, **_: Any) -> Any:
        self.api.calls.append(f"get node {name}")
        try:
            return self.api.nodes[name]
        except KeyError:
            raise _missing("nodes", name) from None

    def read_namespaced_secret(self, name: str, namespace: str, **_: Any) -> Any:
        self.api.calls.append(f"get secret {namespace}/{name}")
        try:
            return self.api.secrets[(namespace, name)]
        except KeyError:
            raise _missing("secrets", name) from None

    def create_namespaced_secret(self, namespace: str, body: dict[str, Any], **_: Any) -> Any:
        self.api.calls.append(f"create secret {namespace}/{body['metadata']['name']}")
        key = (namespace, body["metadata"]["name"])
        if key in self.api.secrets:
            raise ApiException(status=409, reason="Conflict")
        body = copy.deepcopy(body)
        body["metadata"]["namespace"] = namespace
        return self.api.add("secret", body)

    def create_persistent_volume(self, body: dict[str, Any], **_: Any) -> Any:
        self.api.calls.append(f"create pv {body['metadata']['name']}")
        if self.api.refuse_pv is not None:
            raise self.api.refuse_pv
        if body["metadata"]["name"] in self.api.volumes:
            raise ApiException(status=409, reason="Conflict")
        return self.api.add("volume", copy.deepcopy(body))

    def patch_persistent_volume(self, name: str, body: Any, **_: Any) -> Any:
        self.api.calls.append(f"patch pv {name}")
        pv = self.api.volumes[name]
        if isinstance(body, list):  # a JSON patch: test + replace
            for op in body:
                if op["op"] == "test" and op["path"] == "/metadata/resourceVersion":
                    if pv["metadata"]["resourceVersion"] != op["value"]:
                        raise ApiException(status=409, reason="Conflict")
                elif op["op"] == "replace" and op["path"] == "/metadata/finalizers":
                    pv["metadata"]["finalizers"] = op["value"]
                elif op["op"] == "add" and op["path"].startswith("/metadata/annotations/"):
                    key = op["path"].removeprefix("/metadata/annotations/")
                    key = key.replace("~1", "/").replace("~0", "~")
                    pv["metadata"].setdefault("annotations", {})[key] = op["value"]
                else:
                    raise AssertionError(f"the fake API does not do {op}")
        else:  # a merge patch of metadata
            meta = body.get("metadata") or {}
            for field in ("annotations", "labels"):
                if field in meta:
                    merged = dict(pv["metadata"].get(field) or {})
                    for k, v in meta[field].items():
                        if v is None:
                            merged.pop(k, None)
                        else:
                            merged[k] = v
                    pv["metadata"][field] = merged
        pv["metadata"]["resourceVersion"] = str(next(_versions))
        if pv["metadata"].get("deletionTimestamp") and not pv["metadata"].get("finalizers"):
            del self.api.volumes[name]
        return pv

    def delete_persistent_volume(self, name: str, **_: Any) -> Any:
        self.api.calls.append(f"delete pv {name}")
        pv = self.api.volumes.get(name)
        if pv is None:
            raise _missing("persistentvolumes", name)
        if pv["metadata"].get("finalizers"):
            pv["metadata"]["deletionTimestamp"] = "2026-12-05T00:00:00Z"
        else:
            del self.api.volumes[name]
        return None

    def create_namespaced_event(self, namespace: str, body: dict[str, Any], **_: Any) -> Any:
        self.api.calls.append(f"create event {namespace}")
        body = copy.deepcopy(body)
        body["metadata"]["namespace"] = namespace
        body["metadata"]["resourceVersion"] = str(next(_versions))
        self.api.events.append(body)
        return body

    def patch_namespaced_event(
        self, name: str, namespace: str, body: dict[str, Any], **_: Any
    ) -> Any:
        self.api.calls.append(f"patch event {namespace}/{name}")
        for event in self.api.events:
            if event["metadata"]["name"] == name and event["metadata"]["namespace"] == namespace:
                event.update({k: v for k, v in body.items() if k != "metadata"})
                return event
        raise _missing("events", name)


class FakeStorage:
    def __init__(self, api: FakeApi) -> None:
        self.api = api

    def read_storage_class(self, name: str, **_: Any) -> Any:
        self.api.calls.append(f"get class {name}")
        try:
            return self.api.classes[name]
        except KeyError:
            raise _missing("storageclasses", name) from None


def reasons(api: FakeApi) -> list[str]:
    return [event["reason"] for event in api.events]
