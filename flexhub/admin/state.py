"""``flexhub state``: what the node's journal says, checked against the mount table."""

from __future__ import annotations

import time
from typing import Any

from flexhub.config import NodeConfig
from flexhub.node.journal import Journal
from flexhub.node.mounts import MountTable

__all__ = ["node_state", "render_state"]


def node_state(config: NodeConfig) -> dict[str, list[dict[str, Any]]]:
    """Every readable pod and volume record, each with ``mounted`` from mountinfo (and, for
    a volume, ``release_deferred``: its release waits for unreachable storage).

    Records hold no secrets (the journal never stores one), so all of it may be shown.
    """
    journal = Journal(config.state_dir)
    table = MountTable()
    pods = []
    for pod in sorted(journal.pods(), key=lambda r: r.target):
        row = pod.as_dict()
        row["mounted"] = table.is_mount_point(pod.target)
        pods.append(row)
    volumes = []
    waiting = set(journal.deferred())
    for vol in sorted(journal.volumes(), key=lambda r: r.volume_id):
        row = vol.as_dict()
        row["mounted"] = table.is_mount_point(vol.staging)
        row["release_deferred"] = vol.volume_id in waiting
        row["pods"] = sum(1 for p in pods if p["volume_id"] == vol.volume_id and p["mounted"])
        volumes.append(row)
    return {"pods": pods, "volumes": volumes}


def _age(created: float) -> str:
    seconds = max(0, int(time.time() - created))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def render_state(state: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Human-readable lines for :func:`node_state`."""
    lines = [f"volumes ({len(state['volumes'])}):"]
    for vol in state["volumes"]:
        status = "staged" if vol["mounted"] else "NOT MOUNTED"
        if not vol["device"]:
            status = "attach in progress or interrupted"
        elif vol.get("release_deferred") and not vol["mounted"]:
            status = "RELEASE WAITS FOR ITS STORAGE"
        lines.append(
            f"  {vol['volume_id']}  backend={vol['backend']} device={vol['device'] or '-'} "
            f"fs={vol['fs_type']} pods={vol['pods']} {status} age={_age(vol['created'])}"
        )
        lines.append(f"    staging {vol['staging']}")
    lines.append(f"pod directories ({len(state['pods'])}):")
    for pod in state["pods"]:
        status = "mounted" if pod["mounted"] else "NOT MOUNTED"
        mode = "ro" if pod["read_only"] else "rw"
        lines.append(
            f"  {pod['target']}  backend={pod['backend']} volume={pod['volume_id']} {mode} "
            f"{status} age={_age(pod['created'])}"
        )
    return lines
