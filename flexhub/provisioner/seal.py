"""The provisioner's seal on the PVs it writes: what it later acts on with its own rights.

Reclaim and storage expansion run with the provisioner's rights (it reads Secrets of every
namespace, it reaches every storage server), but they read their instructions from the PV:
the ``flexhub/reclaim`` record (backend, class Secret, the backend's own record) and the
``flexVolume`` options (server, share, path). Whoever may edit PVs (an administrator, and
also every node agent's token) could otherwise point a PV at another namespace's Secret and
an attacker's server, and have the provisioner present those credentials there.

So the provisioner seals what it wrote: an HMAC-SHA256, under a key only it can read (the
Secret :data:`KEY_SECRET` in its own namespace, made on its first start), over the PV's name,
its record, its driver, options, fsType, secretRef and reclaim policy. It acts on a PV with
its own rights only when the seal matches; a PV edited since (or written by a flexhub that
did not seal) is refused with an Event until an administrator checks it and seals it again
(``flexhub provisioner-seal``). The node agent cannot check seals (it must not hold the key);
what it does is bounded otherwise (its own node's files, named from the PV's uid).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from flexhub.errors import FlexhubError
from flexhub.provisioner.pvs import ANN_RECLAIM

LOG = logging.getLogger(__name__)

__all__ = ["ANN_SEAL", "KEY_SECRET", "Sealer", "load_key", "sealed_content"]

#: The PV annotation that holds the seal: ``v1:<hex digest>``.
ANN_SEAL = "flexhub/seal"
#: The Secret, in the provisioner's namespace, that holds the sealing key (``data.key``).
KEY_SECRET = "flexhub-provisioner-key"
_VERSION = "v1"
_KEY_BYTES = 32


def sealed_content(pv: Mapping[str, Any]) -> bytes:
    """The bytes the seal covers: everything the provisioner acts on with its own rights."""
    meta = pv.get("metadata") or {}
    spec = pv.get("spec") or {}
    source = spec.get("flexVolume") or {}
    content = {
        "name": meta.get("name"),
        "record": (meta.get("annotations") or {}).get(ANN_RECLAIM),
        "driver": source.get("driver"),
        "options": source.get("options") or {},
        "fsType": source.get("fsType") or "",
        "secretRef": source.get("secretRef") or {},
        # Delete asks the provisioner to remove the storage with its own rights: a PV an
        # administrator switched to Retain must be sealed again before it is reclaimed
        "reclaimPolicy": spec.get("persistentVolumeReclaimPolicy") or "",
    }
    return json.dumps(content, sort_keys=True, separators=(",", ":")).encode()


class Sealer:
    """Seal and check PVs under one key (never shown: not in ``repr``, logs or errors)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise FlexhubError("the sealing key is too short (at least 16 bytes)")
        self._key = key

    def __repr__(self) -> str:
        return "Sealer(key=<hidden>)"

    def seal(self, pv: Mapping[str, Any]) -> str:
        digest = hmac.new(self._key, sealed_content(pv), hashlib.sha256).hexdigest()
        return f"{_VERSION}:{digest}"

    def sealed(self, pv: Mapping[str, Any]) -> bool:
        """Whether ``pv`` carries this key's seal over what it holds now."""
        found = (pv.get("metadata", {}).get("annotations") or {}).get(ANN_SEAL, "")
        if not isinstance(found, str):
            return False
        return hmac.compare_digest(found.encode(errors="replace"), self.seal(pv).encode())


def load_key(core: Any, namespace: str, create: bool = True) -> bytes:
    """The sealing key from ``namespace``/:data:`KEY_SECRET`, made (random) when missing
    and ``create`` (the provisioner; an administrator's ``provisioner-seal`` only reads it:
    a key made in the wrong namespace would seal with a key no provisioner holds).

    Two provisioners starting together both try to create it: one wins, the other reads
    the winner's (409). A Secret without a usable key is an error: replacing it would
    unseal every PV."""
    from kubernetes.client.rest import ApiException

    for _ in range(3):
        try:
            secret = core.read_namespaced_secret(KEY_SECRET, namespace, _request_timeout=30)
        except ApiException as exc:
            if exc.status != 404:
                raise
        else:
            data = (secret.data if not isinstance(secret, dict) else secret.get("data")) or {}
            try:
                key = base64.b64decode(data.get("key", ""), validate=True)
            except ValueError:
                key = b""
            if len(key) < 16:
                raise FlexhubError(
                    f"Secret {namespace}/{KEY_SECRET} holds no sealing key (data.key, at "
                    "least 16 bytes): restore it from a backup, or delete it to make a new "
                    "one (every PV must then be sealed again)"
                )
            return key
        if not create:
            raise FlexhubError(
                f"no Secret {namespace}/{KEY_SECRET}: is the provisioner's namespace "
                f"{namespace!r} (--namespace), and has it run once?"
            )
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": KEY_SECRET,
                "labels": {"app.kubernetes.io/component": "provisioner"},
            },
            "type": "Opaque",
            "data": {"key": base64.b64encode(os.urandom(_KEY_BYTES)).decode()},
        }
        try:
            core.create_namespaced_secret(namespace, body, _request_timeout=30)
        except ApiException as exc:
            if exc.status != 409:
                raise
        else:
            LOG.info("made the sealing key Secret %s/%s", namespace, KEY_SECRET)
    raise FlexhubError(f"could not read or make the Secret {namespace}/{KEY_SECRET}")
