"""The step machine of ``flexhub convert``, per claim.

Every step reads what exists and does only what is still missing, so a rerun after a kill at
any point ends where an uninterrupted run ends. The saved copy (a ConfigMap in the backup
namespace, :func:`~flexhub.convert.plan.backup_name`) is written before anything changes and is
what a rerun and ``--rollback`` work from once the original objects are gone.

Convert: check → save → old PV Retain (and without the FlexVolume provisioner's finalizer) →
refuse while a pod uses the claim → delete the old claim → delete the old PV → create the new
claim (``volumeName`` set) → write the CSI controller's record of the volume (a reclaimed PV
only, :mod:`flexhub.convert.adopt`) → create the CSI PV pre-bound to the new claim's uid (still
``Retain``) → wait bound → give it back ``Delete`` (a reclaimed PV only) → mark the copy done.
Rollback is the same walk back to the saved objects (the CSI PV ``Retain`` first), then drops
the record and the copy.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from flexhub.convert import adopt, plan
from flexhub.convert.kube import Kube
from flexhub.errors import ConvertError

__all__ = [
    "KILL_AFTER_ENV",
    "Settings",
    "claims_to_convert",
    "convert_claim",
    "rollback_claim",
    "run",
    "validate_options",
]

LOG = logging.getLogger(__name__)

#: Tests only: the step after which the process SIGKILLs itself (a crash at that point).
KILL_AFTER_ENV = "FLEXHUB_TEST_CONVERT_KILL_AFTER"
#: What a dry run shows in place of the uid the API server gives the new claim.
NEW_UID = "<uid of the new claim>"
_MANAGED = {"app.kubernetes.io/managed-by": "flexhub-convert"}
#: The saved copy's step once the CSI PV is bound and its Delete is being given back; with it
#: the copy's key :data:`DELETE_GIVEN` (kept by the later step ``done``): a PV gone after that
#: went with its storage. Copies of versions before it have neither (their PVs stayed Retain).
BOUND = "bound"
DELETE_GIVEN = "delete"
#: The saved copy's key a rollback writes before it changes anything (convert writes only
#: ``step`` and :data:`DELETE_GIVEN`: a data patch merges keys, so it never undoes this), and
#: the annotation it puts on the CSI PV as it sets it Retain (so that a convert beside it that
#: read the PV before finds it changed).
ROLLBACK = "rollback"
ANN_ROLLING_BACK = "flexhub/convert-rolling-back"
_ANN_RESTORED = "flexhub/convert-restored-from"


@dataclass(frozen=True)
class Settings:
    backup_namespace: str = "flexhub-system"
    storage_class: str = ""
    dry_run: bool = False
    timeout: float = 120.0


Say = Callable[[str], None]


def _killed_after(step: str) -> None:
    if os.environ.get(KILL_AFTER_ENV) == step:
        LOG.warning("killed after step %s (%s)", step, KILL_AFTER_ENV)
        os.kill(os.getpid(), signal.SIGKILL)


def validate_options(options: Mapping[str, str]) -> None:
    """The options against the backend's schema and checks, as the driver (and the CSI node)
    validates them: an unknown backend, a schema failure or a broken rule is one line."""
    from flexhub.driver.loader import load_backend
    from flexhub.driver.validation import validate_options as validate
    from flexhub.volume import Volume

    cls = load_backend(options.get("backend") or None)
    validate(cls, options)
    cls.check_options(Volume.from_options(options))


def _uid(obj: Mapping[str, Any] | None) -> str:
    return str(((obj or {}).get("metadata") or {}).get("uid") or "")


def _handle(pv: Mapping[str, Any] | None) -> str:
    """The ``volumeHandle`` of a CSI PV (``""``: none, or not a CSI PV)."""
    return str((((pv or {}).get("spec") or {}).get("csi") or {}).get("volumeHandle") or "")


def _annotation(obj: Mapping[str, Any] | None, key: str) -> str:
    return str((((obj or {}).get("metadata") or {}).get("annotations") or {}).get(key) or "")


def _backup_body(pv: Mapping[str, Any], pvc: Mapping[str, Any], step: str) -> dict[str, Any]:
    meta = pvc["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": plan.backup_name(meta["namespace"], meta["name"]),
            "labels": dict(_MANAGED),
            "annotations": {"flexhub/claim": f"{meta['namespace']}/{meta['name']}"},
        },
        "data": {
            "claim.json": plan.saved_text(pvc),
            "pv.json": plan.saved_text(pv),
            "step": step,
        },
    }


def _saved(backup: Mapping[str, Any], ns: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    data = backup.get("data") or {}
    try:
        pv, pvc = json.loads(data["pv.json"]), json.loads(data["claim.json"])
        meta = pvc["metadata"]
        if (meta["namespace"], meta["name"]) != (ns, name):
            raise ValueError("names another claim")
        plan.check_flex_pair(pv, pvc)
    except (KeyError, ValueError, TypeError, ConvertError) as exc:
        name_ = backup["metadata"]["name"]
        raise ConvertError(
            f"the saved copy {name_} of claim {ns}/{name} is unusable: {exc}"
        ) from None
    return pv, pvc


def _refuse_in_use(kube: Kube, ns: str, name: str, volume_names: set[str]) -> None:
    pods = kube.pods_using(ns, name)
    if pods:
        raise ConvertError(
            f"claim {ns}/{name} is used by pod(s) {', '.join(pods[:10])}"
            f"{' ...' if len(pods) > 10 else ''}: stop them (scale their workload to 0) first"
        )
    nodes = kube.nodes_using(volume_names)
    if nodes:
        raise ConvertError(
            f"claim {ns}/{name}: node(s) {', '.join(nodes[:10])} still report the volume "
            "in use: wait until they have unmounted it"
        )


def _wait_gone(kube: Kube, what: str, read: Callable[[], Mapping[str, Any] | None], uid: str,
               settings: Settings, hint: str = "") -> None:  # fmt: skip
    def gone() -> str | None:
        found = read()
        if found is None or _uid(found) != uid:
            return None
        finalizers = (found.get("metadata") or {}).get("finalizers") or []
        return f"finalizers {finalizers}" if finalizers else "still there"

    kube.wait(f"{what} not deleted", gone, settings.timeout, hint)


def _wait_bound(kube: Kube, ns: str, name: str, volume: str, settings: Settings) -> None:
    def bound() -> str | None:
        claim = kube.claim(ns, name) or {}
        phase = (claim.get("status") or {}).get("phase")
        if phase == "Bound" and (claim.get("spec") or {}).get("volumeName") == volume:
            return None
        return f"claim phase {phase}"

    kube.wait(f"claim {ns}/{name} bound to PV {volume}", bound, settings.timeout)


def convert_claim(
    kube: Kube, ns: str, name: str, settings: Settings, say: Say
) -> list[dict[str, Any]]:
    """Convert claim ``ns/name`` (or, dry, only check it); the objects written (or that
    would be)."""
    bns = settings.backup_namespace
    backup = kube.config_map(bns, plan.backup_name(ns, name))
    written: list[dict[str, Any]] = []
    if backup is None:
        pvc = kube.claim(ns, name)
        if pvc is None:
            raise ConvertError(f"claim {ns}/{name} not found")
        volume = (pvc.get("spec") or {}).get("volumeName") or ""
        if (pvc.get("status") or {}).get("phase") != "Bound" or not volume:
            raise ConvertError(f"claim {ns}/{name} is not bound to a PV: nothing to convert")
        found = kube.pv(volume)
        if found is None:
            raise ConvertError(f"claim {ns}/{name}: its PV {volume} not found")
        pv = found
        plan.check_flex_pair(pv, pvc)
        validate_options(pv["spec"]["flexVolume"].get("options") or {})
        _refuse_in_use(kube, ns, name, {volume})
        if not kube.namespace_exists(bns):
            raise ConvertError(
                f"backup namespace {bns} not found (pass --backup-namespace: the namespace "
                "flexhub is installed in)"
            )
        _check_reclaim(kube, pv, pvc, bns)
        body = _backup_body(pv, pvc, "saved")
        if settings.dry_run:
            written.append(body)
        else:
            backup = kube.create_config_map(bns, body)
            say(f"claim {ns}/{name}: saved PV {volume} and the claim in ConfigMap "
                f"{bns}/{body['metadata']['name']}")  # fmt: skip
            _killed_after("saved")
    else:
        pv, pvc = _saved(backup, ns, name)
        step = (backup.get("data") or {}).get("step")
        if step in ("done", BOUND) and _delete_given(backup):
            _refuse_reclaimed(kube, pv, pvc, bns, "convert")
        if step == "done":
            if _delete_given(backup) and not settings.dry_run:  # a record lost since: again
                _repair_record(kube, pv, pvc, bns, say)
            say(f"claim {ns}/{name}: converted already")
            return []
        validate_options(pv["spec"]["flexVolume"].get("options") or {})
        _check_reclaim(kube, pv, pvc, bns)
    return written + _forward(kube, pv, pvc, settings, say)


def _check_reclaim(kube: Kube, pv: Mapping[str, Any], pvc: Mapping[str, Any], bns: str) -> None:
    """A PV reclaimed on delete: its seal holds, its record makes a CSI record, and a CSI
    controller runs in ``bns`` to read it (:mod:`flexhub.convert.adopt`)."""
    if adopt.reclaimed(pv):
        adopt.check_sealed(pv, kube.sealing_key(bns))
        adopt.record_body(pv, pvc, plan.volume_handle(pv, pvc))
        adopt.check_controller(pv, bns, kube.lease_age(bns, adopt.CONTROLLER_LEASE))


def _delete_given(backup: Mapping[str, Any]) -> bool:
    """Whether convert gave the CSI PV its Delete back (and no rollback started since)."""
    data = backup.get("data") or {}
    return data.get(DELETE_GIVEN) == "given" and not data.get(ROLLBACK)


def _repair_record(kube: Kube, pv: Mapping[str, Any], pvc: Mapping[str, Any], bns: str,
                   say: Say) -> None:  # fmt: skip
    """A finished convert's record again, when lost (the same checks as the first run), while
    its PV lives (a Released one is being reclaimed: its record goes with it)."""
    _check_reclaim(kube, pv, pvc, bns)
    now = kube.pv(pv["metadata"]["name"]) or {}
    if (now.get("status") or {}).get("phase") != "Released":
        _write_record(kube, bns, pv, pvc, say)


def _refuse_reclaimed(kube: Kube, pv: Mapping[str, Any], pvc: Mapping[str, Any], bns: str,
                      what: str) -> None:  # fmt: skip
    """Refuse ``what`` once the converted PV, given Delete, is gone: deleted with its claim,
    its storage reclaimed by the CSI driver. Writing the claim and a PV (CSI's or the
    FlexVolume one) again would name storage that is no more."""
    volume, handle = pv["metadata"]["name"], plan.volume_handle(pv, pvc)
    now = kube.pv(volume)
    if now is None or _handle(now) != handle:
        meta = pvc["metadata"]
        raise ConvertError(
            f"claim {meta['namespace']}/{meta['name']}: its converted PV {volume} is gone "
            "(deleted with its claim under Delete: the CSI driver reclaimed its storage): "
            f"nothing to {what}; delete ConfigMap "
            f"{bns}/{plan.backup_name(meta['namespace'], meta['name'])} once you have checked"
        )


def _csi_pv(pv: Mapping[str, Any], pvc: Mapping[str, Any], claim_uid: str, sc: str) -> Any:
    body = plan.csi_pv(pv, pvc, claim_uid, sc)
    if adopt.reclaimed(pv):
        adopt.adopt_into(body, pv)
    return body


def _forward(
    kube: Kube, pv: dict[str, Any], pvc: dict[str, Any], settings: Settings, say: Say
) -> list[dict[str, Any]]:
    ns, name = pvc["metadata"]["namespace"], pvc["metadata"]["name"]
    volume = pv["metadata"]["name"]
    old_claim, old_pv = _uid(pvc), _uid(pv)
    handle = plan.volume_handle(pv, pvc)
    reclaimed = adopt.reclaimed(pv)
    if settings.dry_run:
        new = plan.csi_claim(pvc, pv, settings.storage_class)
        record = [adopt.record_body(pv, pvc, handle)] if reclaimed else []
        return [new, *record, _csi_pv(pv, pvc, NEW_UID, new["spec"].get("storageClassName", ""))]
    now = kube.pv(volume)
    if now is not None and _uid(now) == old_pv:
        finalizers = now["metadata"].get("finalizers") or []
        kept = [f for f in finalizers if f != plan.FLEX_FINALIZER]
        if now["spec"].get("persistentVolumeReclaimPolicy") != "Retain" or kept != finalizers:
            kube.set_pv(now, "Retain", kept)
            say(f"PV {volume}: reclaim policy Retain")
    _killed_after("retained")
    claim = kube.claim(ns, name)
    if claim is not None and _uid(claim) == old_claim:
        _refuse_in_use(kube, ns, name, {volume})
        kube.delete_claim(ns, name, old_claim)
        hint = "; a pod may use it: stop it, then run flexhub convert again"
        _wait_gone(kube, f"claim {ns}/{name}", lambda: kube.claim(ns, name), old_claim,
                   settings, hint)  # fmt: skip
        say(f"claim {ns}/{name}: FlexVolume claim deleted")
    _killed_after("claim-deleted")
    now = kube.pv(volume)
    if now is not None and _uid(now) == old_pv:
        kube.delete_pv(volume, old_pv)
        _wait_gone(kube, f"PV {volume}", lambda: kube.pv(volume), old_pv, settings)
        say(f"PV {volume}: FlexVolume PV deleted (the storage stays)")
    _killed_after("pv-deleted")
    claim = kube.claim(ns, name)
    if claim is None:
        claim = kube.create_claim(plan.csi_claim(pvc, pv, settings.storage_class))
        say(f"claim {ns}/{name}: created, naming PV {volume}")
    elif _annotation(claim, plan.ANN_CONVERTED_FROM) != old_claim:
        raise ConvertError(
            f"claim {ns}/{name} was made again meanwhile (not by flexhub convert): delete it, "
            "then run flexhub convert again"
        )
    if (claim.get("spec") or {}).get("volumeName") not in ("", None, volume):
        # its annotation is the namespace author's to write: the CSI PV pre-binds to it
        raise ConvertError(
            f"claim {ns}/{name} names another PV than {volume}: delete it, then run flexhub "
            "convert again"
        )
    _killed_after("claim-created")
    if reclaimed:  # before the PV, and checked on every run: Delete without it would leak
        _write_record(kube, settings.backup_namespace, pv, pvc, say)
        _killed_after("record-written")
    now = kube.pv(volume)
    if now is None:
        sc = str((claim.get("spec") or {}).get("storageClassName") or "")
        now = kube.create_pv(_csi_pv(pv, pvc, _uid(claim), sc))
        say(f"PV {volume}: created on CSI driver {plan.CSI_DRIVER}, volumeHandle {handle}")
    if _handle(now) != handle:
        raise ConvertError(f"PV {volume} was made again meanwhile (not by flexhub convert)")
    _killed_after("pv-created")
    _wait_bound(kube, ns, name, volume, settings)
    policy = "Retain"
    if reclaimed:
        policy = "Delete"
        _restore_delete(kube, pv, pvc, settings, say)
        _killed_after("policy-restored")
    kube.patch_config_map(settings.backup_namespace, plan.backup_name(ns, name), {"step": "done"})
    say(f"claim {ns}/{name}: converted (PV {volume} bound, reclaim policy {policy})")
    return []


def _check_restored(claim: Mapping[str, Any], ns: str, name: str, volume: str,
                    old_claim: str) -> None:  # fmt: skip
    """A claim a rollback made (its annotation, which its namespace's author can also write)
    that still names no PV but ``volume``: nothing else may get the PV pre-bound."""
    if _annotation(claim, _ANN_RESTORED) != old_claim:
        raise ConvertError(
            f"claim {ns}/{name} exists and is not the converted one: delete it first"
        )
    if (claim.get("spec") or {}).get("volumeName") not in ("", None, volume):
        raise ConvertError(f"claim {ns}/{name} names another PV than {volume}: not restored")


def _restore_delete(kube: Kube, pv: Mapping[str, Any], pvc: Mapping[str, Any],
                    settings: Settings, say: Say) -> None:  # fmt: skip
    """Give the bound CSI PV its Delete back: the copy marked first (a rerun or rollback
    that then finds the PV gone knows its storage was reclaimed), the PV and claim read
    again and still bound to each other, the policy set only on the PV as read (a rollback
    beside that changed it meanwhile wins)."""
    ns, name = pvc["metadata"]["namespace"], pvc["metadata"]["name"]
    volume, handle = pv["metadata"]["name"], plan.volume_handle(pv, pvc)
    bns, backup_name = settings.backup_namespace, plan.backup_name(ns, name)
    copy = kube.config_map(bns, backup_name) or {}
    now, claim = kube.pv(volume), kube.claim(ns, name) or {}
    if (copy.get("data") or {}).get(ROLLBACK) or _annotation(now, ANN_ROLLING_BACK):
        raise ConvertError(
            f"claim {ns}/{name}: a rollback of it has begun (its saved copy and PV say so): the "
            "policy stays Retain; finish it with flexhub convert --rollback"
        )
    if now is None or _handle(now) != handle:
        raise ConvertError(f"PV {volume} was made again meanwhile (not by flexhub convert)")
    kube.patch_config_map(bns, backup_name, {"step": BOUND, DELETE_GIVEN: "given"})
    bound = (claim.get("status") or {}).get("phase") == "Bound" and (
        (claim.get("spec") or {}).get("volumeName") == volume
        and ((now.get("spec") or {}).get("claimRef") or {}).get("uid") == _uid(claim)
    )
    if not bound or _annotation(claim, plan.ANN_CONVERTED_FROM) != _uid(pvc):
        raise ConvertError(
            f"claim {ns}/{name} and PV {volume} are not bound to each other any more (a "
            "rollback beside this run?): the policy stays Retain; run flexhub convert again"
        )
    if now["spec"].get("persistentVolumeReclaimPolicy") != "Delete":
        kube.set_pv(now, "Delete", unchanged=True)
        say(f"PV {volume}: reclaim policy Delete again (the CSI driver reclaims its storage)")


def _write_record(kube: Kube, bns: str, pv: Mapping[str, Any], pvc: Mapping[str, Any],
                  say: Say) -> None:  # fmt: skip
    """The CSI controller's record of the volume (:mod:`flexhub.convert.adopt`), written
    when missing or not what the saved PV makes (its data or labels)."""
    handle = plan.volume_handle(pv, pvc)
    body = adopt.record_body(pv, pvc, handle)
    name, labels = body["metadata"]["name"], body["metadata"]["labels"]

    def same(found: Mapping[str, Any]) -> bool:
        have = (found.get("metadata") or {}).get("labels") or {}
        return found.get("data") == body["data"] and all(
            have.get(k) == v for k, v in labels.items()
        )

    found = kube.config_map(bns, name)
    if found is not None and same(found):
        return
    found = kube.create_config_map(bns, body)
    if not same(found):  # there, with other data or labels: ours again
        kube.patch_config_map(bns, name, body["data"], labels)
    say(f"PV {pv['metadata']['name']}: the CSI controller's record of {handle} written to "
        f"ConfigMap {bns}/{name}")  # fmt: skip


def _check_rollback(kube: Kube, ns: str, name: str, volume: str, old_claim: str,
                    handle: str) -> None:  # fmt: skip
    """What a rollback would refuse on its way, refused before it changes anything: a claim
    of that name that is neither the original, nor the converted, nor the restored one; a PV of
    that name that is none of the three either."""
    claim = kube.claim(ns, name)
    if claim is not None and old_claim not in (
        _uid(claim),
        _annotation(claim, plan.ANN_CONVERTED_FROM),
    ):
        _check_restored(claim, ns, name, volume, old_claim)
    now = kube.pv(volume)
    if now is None:
        return
    spec = now.get("spec") or {}
    known = (
        (spec.get("csi") or {}).get("volumeHandle") == handle
        or _annotation(now, _ANN_RESTORED) == old_claim
        or _annotation(now, plan.ANN_CONVERTED_FROM) == old_claim
        or ((spec.get("claimRef") or {}).get("uid") == old_claim and spec.get("flexVolume"))
    )
    if not known:
        raise ConvertError(f"PV {volume} was made again meanwhile (not by flexhub convert)")


def rollback_claim(
    kube: Kube, ns: str, name: str, settings: Settings, say: Say
) -> list[dict[str, Any]]:
    """Put claim ``ns/name`` and its PV back as saved (or, dry, show them)."""
    bns = settings.backup_namespace
    backup_name = plan.backup_name(ns, name)
    backup = kube.config_map(bns, backup_name)
    if backup is None:
        raise ConvertError(
            f"claim {ns}/{name}: no saved copy (ConfigMap {bns}/{backup_name}): it was not "
            "converted by flexhub convert, or was rolled back already"
        )
    pv, pvc = _saved(backup, ns, name)
    volume = pv["metadata"]["name"]
    old_claim, old_pv = _uid(pvc), _uid(pv)
    handle = plan.volume_handle(pv, pvc)
    _check_rollback(kube, ns, name, volume, old_claim, handle)
    if (backup.get("data") or {}).get("step") in ("done", BOUND) and _delete_given(backup):
        _refuse_reclaimed(kube, pv, pvc, bns, "roll back")
    claim = kube.claim(ns, name)
    if claim is not None and _annotation(claim, plan.ANN_CONVERTED_FROM) == old_claim:
        _refuse_in_use(kube, ns, name, {volume, handle})  # before anything changes
    if settings.dry_run:
        return [plan.flex_claim(pvc, pv), plan.flex_pv(pv, NEW_UID)]
    if not (backup.get("data") or {}).get(ROLLBACK):
        kube.patch_config_map(bns, backup_name, {ROLLBACK: "started"})
    claim, now = kube.claim(ns, name), kube.pv(volume)
    original_pv = now is not None and _uid(now) == old_pv
    if claim is not None and _uid(claim) == old_claim and original_pv:
        assert now is not None  # stopped before the claim was deleted: undo Retain only
        finalizers = now["metadata"].get("finalizers") or []
        restore = [f for f in pv["metadata"].get("finalizers") or [] if f == plan.FLEX_FINALIZER]
        policy = pv["spec"].get("persistentVolumeReclaimPolicy") or "Retain"
        kube.set_pv(now, policy, [*finalizers, *(f for f in restore if f not in finalizers)])
        say(f"PV {volume}: reclaim policy {policy} again")
        _drop_record(kube, bns, handle)
        kube.delete_config_map(bns, backup_name)
        return []
    ours = original_pv or (now is not None and _handle(now) == handle)
    if now is not None and ours and not original_pv and not _annotation(now, ANN_ROLLING_BACK):
        # written even when Retain already: a convert beside that read it finds it changed
        kube.set_pv(now, "Retain", annotations={ANN_ROLLING_BACK: old_claim})
    elif now is not None and ours and now["spec"].get("persistentVolumeReclaimPolicy") != "Retain":
        kube.set_pv(now, "Retain")
    _killed_after("rollback-retained")
    if claim is not None and _annotation(claim, plan.ANN_CONVERTED_FROM) == old_claim:
        _refuse_in_use(kube, ns, name, {volume, handle})
        kube.delete_claim(ns, name, _uid(claim))
        _wait_gone(kube, f"claim {ns}/{name}", lambda: kube.claim(ns, name), _uid(claim),
                   settings)  # fmt: skip
        say(f"claim {ns}/{name}: CSI claim deleted")
    _killed_after("rollback-claim-deleted")
    now = kube.pv(volume)
    if now is not None and ours and _annotation(now, _ANN_RESTORED) != old_claim:
        kube.delete_pv(volume, _uid(now))
        _wait_gone(kube, f"PV {volume}", lambda: kube.pv(volume), _uid(now), settings)
        say(f"PV {volume}: deleted (the storage stays)")
    _killed_after("rollback-pv-deleted")
    claim = kube.claim(ns, name)
    if claim is None:
        body = plan.flex_claim(pvc, pv)
        del body["metadata"]["annotations"][plan.ANN_CONVERTED_FROM]
        body["metadata"]["annotations"][_ANN_RESTORED] = old_claim
        claim = kube.create_claim(body)
        say(f"claim {ns}/{name}: FlexVolume claim created again")
    else:
        _check_restored(claim, ns, name, volume, old_claim)
    _killed_after("rollback-claim-created")
    now = kube.pv(volume)
    if now is None:
        body = plan.flex_pv(pv, _uid(claim))
        body["metadata"]["annotations"][_ANN_RESTORED] = old_claim
        now = kube.create_pv(body)
        say(f"PV {volume}: FlexVolume PV created again")
    if not (now.get("spec") or {}).get("flexVolume"):
        raise ConvertError(f"PV {volume} was made again meanwhile (not by flexhub convert)")
    _killed_after("rollback-pv-created")
    _wait_bound(kube, ns, name, volume, settings)
    _drop_record(kube, bns, handle)
    kube.delete_config_map(bns, backup_name)
    say(f"claim {ns}/{name}: rolled back (FlexVolume PV {volume} bound)")
    return []


def _drop_record(kube: Kube, bns: str, handle: str) -> None:
    """Remove the CSI controller's record of ``handle`` (none is fine): the FlexVolume PV
    is back, and the FlexVolume provisioner reclaims it."""
    from flexhub.csi.records import adoption_name, uid_of_volume

    kube.delete_config_map(bns, adoption_name(uid_of_volume(handle)))


def claims_to_convert(kube: Kube, ns: str, settings: Settings, rollback: bool) -> list[str]:
    """``--all``: the claims of ``ns`` with a saved copy, and (converting) those bound to a
    FlexVolume PV of flexhub."""
    names = []
    for name in (
        kube.claims(ns) if not rollback else kube.saved_claims(settings.backup_namespace, ns)
    ):
        if kube.config_map(settings.backup_namespace, plan.backup_name(ns, name)) is not None:
            names.append(name)
            continue
        claim = kube.claim(ns, name) or {}
        volume = (claim.get("spec") or {}).get("volumeName") or ""
        pv = kube.pv(volume) if volume else None
        flex = ((pv or {}).get("spec") or {}).get("flexVolume") or {}
        if flex.get("driver") == plan.FLEX_DRIVER:
            names.append(name)
    return sorted(set(names))


def run(
    kube: Kube, ns: str, names: list[str], settings: Settings, rollback: bool, say: Say
) -> list[dict[str, Any]]:
    """Each claim in turn, after every one was checked (a refusal of any changes nothing)."""
    step = rollback_claim if rollback else convert_claim
    if not settings.dry_run:
        for name in names:
            step(kube, ns, name, replace(settings, dry_run=True), lambda _line: None)
    objects: list[dict[str, Any]] = []
    for name in names:
        objects.extend(step(kube, ns, name, settings, say))
    return objects
