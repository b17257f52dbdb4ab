"""What the provisioner and the node agent read and write through the API server, beside
the PVs' contents (:mod:`flexhub.provisioner.pvs`): a plain-dict read, the API server's
reason for a refusal, a PV's reclaim record checked against its name, the end of a reclaim
(the PV deleted, then its finalizer removed), and the finalizer a claim holds while its
storage may exist without a PV.

Every finalizer is removed with a compare-and-swap on the object's ``resourceVersion``
(a JSON patch whose ``test`` fails on a concurrent change), never over someone's write.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from flexhub.errors import FlexhubError, one_line
from flexhub.provisioner import pvs

__all__ = [
    "CLAIM_FINALIZER",
    "api_reason",
    "backend_record",
    "event_text",
    "finish_reclaim",
    "get",
    "hold_claim",
    "let_claim_go",
    "pointer",
    "read_record",
    "remove_finalizer",
    "seconds_since",
]

#: Held on a claim from just before its backend makes storage until its PV is saved: a claim
#: deleted in between (the provisioner killed, the PV refused) waits for the provisioner to
#: remove what was made for it, which no PV would ever reclaim.
CLAIM_FINALIZER = "flexhub/provisioning"
#: A provisioned PV's name: ``pvc-<claim uid>``.
_PV_NAME = re.compile(r"pvc-([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")


def get(api: Any, read: Callable[..., Any], *args: str) -> dict[str, Any] | None:
    """``read(*args)`` as a plain dict, or None when the object does not exist."""
    from kubernetes.client.rest import ApiException

    try:
        found = read(*args, _request_timeout=30)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    plain: dict[str, Any] = api.sanitize_for_serialization(found)
    return plain


def pointer(key: str) -> str:
    """``key`` as one JSON-pointer segment (``flexhub/seal`` → ``flexhub~1seal``)."""
    return key.replace("~", "~0").replace("/", "~1")


def api_reason(exc: Any) -> str:
    """The API server's own message of an ``ApiException`` (its Status body), one line;
    never the HTTP headers."""
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        body = {}
    message = body.get("message") if isinstance(body, dict) else None
    return event_text(message or f"{exc.status} {exc.reason}")


def seconds_since(stamp: object) -> float | None:
    import datetime

    if not isinstance(stamp, str | datetime.datetime):
        return None
    try:
        when = (
            stamp
            if isinstance(stamp, datetime.datetime)
            else datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        )
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return (datetime.datetime.now(datetime.UTC) - when).total_seconds()


def read_record(pv: Mapping[str, Any]) -> dict[str, str]:
    raw = (pv["metadata"].get("annotations") or {}).get(pvs.ANN_RECLAIM, "{}")
    try:
        record = json.loads(raw)
    except ValueError:
        raise FlexhubError(
            f"PV {pv['metadata']['name']}: annotation {pvs.ANN_RECLAIM} is not JSON"
        ) from None
    if not isinstance(record, dict) or "backend" not in record:
        raise FlexhubError(
            f"PV {pv['metadata']['name']}: annotation {pvs.ANN_RECLAIM} names no backend"
        )
    found = {str(k): str(v) for k, v in record.items()}
    uid = found.get("claimUid")
    if uid is not None and pv["metadata"]["name"] != f"pvc-{uid}":
        # the PV's name cannot be edited, its annotation can: a record naming another
        # claim's directory (its uid) would make this PV's reclaim delete that one
        raise FlexhubError(
            f"PV {pv['metadata']['name']}: annotation {pvs.ANN_RECLAIM} names claim uid "
            f"{uid[:80]!r}, not this PV's: refusing to reclaim"
        )
    return found


def backend_record(pv: Mapping[str, Any]) -> dict[str, str]:
    """The PV's reclaim record as its backend's reclaim and expansion get it: checked by
    :func:`read_record`, and with the ``claimUid`` the PV's name holds when the record has none
    (one saved before its backend wrote it), so the backend's own check that the PV's options
    name this claim's storage (an iSCSI iqn ``...:pvc-<uid>``) runs on every PV. The name of
    a PV cannot be edited; its options and annotations can."""
    record = read_record(pv)
    found = _PV_NAME.fullmatch(str(pv["metadata"]["name"]))
    if "claimUid" not in record and found is not None:
        record["claimUid"] = found.group(1)
    return record


def finish_reclaim(core: Any, pv: Mapping[str, Any]) -> None:
    """The storage is gone: delete the PV object, then let it go (remove the finalizer).
    Interrupted in between, the next sync reclaims again (a no-op) and finishes."""
    from kubernetes.client.rest import ApiException

    name = pv["metadata"]["name"]
    if not pv["metadata"].get("deletionTimestamp"):
        try:
            core.delete_persistent_volume(name, _request_timeout=30)
        except ApiException as exc:
            if exc.status != 404:
                raise
    for _ in range(5):  # the API server itself updates a PV just deleted: read, try again
        fresh = get(core.api_client, core.read_persistent_volume, name)
        if fresh is None or pvs.FINALIZER not in (fresh["metadata"].get("finalizers") or []):
            return
        try:
            remove_finalizer(core, fresh)
            return
        except ApiException as exc:
            if exc.status not in (409, 422):
                raise
    raise FlexhubError(
        f"PV {name}: could not remove the finalizer {pvs.FINALIZER} (it changes "
        "under every try); retried"
    )


def remove_finalizer(core: Any, pv: Mapping[str, Any]) -> None:
    """Remove flexhub's finalizer with a compare-and-swap on the PV's resourceVersion."""
    core.patch_persistent_volume(
        pv["metadata"]["name"], _without(pv, pvs.FINALIZER), _request_timeout=30
    )


def hold_claim(api: Any, core: Any, pvc: Mapping[str, Any]) -> dict[str, Any]:
    """Put :data:`CLAIM_FINALIZER` on the claim (a no-op when it is there) before its
    storage is made; the claim as it is now. The API server adds no finalizer to a claim
    being deleted: that refusal is an error, and the next sync sees the deletion."""
    meta = pvc["metadata"]
    if CLAIM_FINALIZER in (meta.get("finalizers") or []):
        return dict(pvc)
    body = {  # a strategic merge: the finalizer appended, the annotation set
        "metadata": {
            "finalizers": [CLAIM_FINALIZER],
            "annotations": {pvs.ANN_FROZEN: pvs.frozen_annotations(pvc)},
        }
    }
    held = core.patch_namespaced_persistent_volume_claim(
        meta["name"], meta["namespace"], body, _request_timeout=30
    )
    plain: dict[str, Any] = api.sanitize_for_serialization(held)
    return plain


def let_claim_go(core: Any, pvc: Mapping[str, Any]) -> None:
    """Remove :data:`CLAIM_FINALIZER` from the claim (its PV holds the storage now, or the
    storage is gone), reading it again while a concurrent write makes the swap fail."""
    from kubernetes.client.rest import ApiException

    namespace, name = pvc["metadata"]["namespace"], pvc["metadata"]["name"]
    fresh: Mapping[str, Any] | None = pvc
    for _ in range(5):
        if fresh is None or CLAIM_FINALIZER not in (fresh["metadata"].get("finalizers") or []):
            return
        try:
            core.patch_namespaced_persistent_volume_claim(
                name, namespace, _without(fresh, CLAIM_FINALIZER), _request_timeout=30
            )
            return
        except ApiException as exc:
            if exc.status == 404:
                return
            if exc.status not in (409, 422):
                raise
        fresh = get(core.api_client, core.read_namespaced_persistent_volume_claim, name, namespace)
    raise FlexhubError(
        f"claim {namespace}/{name}: could not remove the finalizer {CLAIM_FINALIZER} (it "
        "changes under every try); retried"
    )


def _without(obj: Mapping[str, Any], finalizer: str) -> list[dict[str, Any]]:
    """A JSON patch that removes ``finalizer`` (and a claim's frozen annotations, which
    only that finalizer's window needs) from ``obj`` only if ``obj`` is unchanged."""
    meta = obj["metadata"]
    patch: list[dict[str, Any]] = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]},
        {
            "op": "replace",
            "path": "/metadata/finalizers",
            "value": [f for f in meta.get("finalizers") or [] if f != finalizer],
        },
    ]
    if finalizer == CLAIM_FINALIZER and pvs.ANN_FROZEN in (meta.get("annotations") or {}):
        patch.append({"op": "remove", "path": f"/metadata/annotations/{pointer(pvs.ANN_FROZEN)}"})
    return patch


def event_text(error: object) -> str:
    """An Event's or log line's text: the errors module's folding, at an Event's length."""
    return one_line(str(error), limit=400)
