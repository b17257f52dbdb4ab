"""Server-side apply of manifest files with the official client's dynamic client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.cluster.cluster import Cluster

FIELD_MANAGER = "flexhub-tests"


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def apply(cluster: Cluster, doc: dict[str, Any], dry_run: bool = False) -> Any:
    """Server-side apply one object; unknown or misplaced fields are errors (Strict)."""
    from kubernetes.dynamic import DynamicClient

    dynamic = DynamicClient(cluster.api)
    resource = dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
    query = [("fieldValidation", "Strict")]
    if dry_run:
        query.append(("dryRun", "All"))
    return dynamic.server_side_apply(
        resource,
        body=doc,
        namespace=doc.get("metadata", {}).get("namespace"),
        field_manager=FIELD_MANAGER,
        force_conflicts=True,
        query_params=query,
    )


def apply_file(cluster: Cluster, path: Path, dry_run: bool = False) -> list[Any]:
    return [apply(cluster, doc, dry_run) for doc in documents(path.read_text())]
