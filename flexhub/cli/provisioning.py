"""``flexhub provisioner`` and ``flexhub node-agent``: the long-running API clients."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from flexhub.errors import FlexhubError, one_line

__all__ = ["register"]

_KUBECONFIG = typer.Option(help="kubeconfig file (default: the pod's service account)")
_CONFIG = typer.Option(help="flexhub config for the backends' settings (default: FLEXHUB_CONFIG)")


@contextlib.contextmanager
def _api_config(kubeconfig: Path | None) -> Iterator[None]:
    """The API client's config problems as one line that says what to pass (the client
    raises its ``ConfigException`` before anything else is done)."""
    from kubernetes.config import ConfigException

    if kubeconfig is not None and not kubeconfig.is_file():
        raise FlexhubError(f"--kubeconfig {kubeconfig}: no such file")
    try:
        yield
    except ConfigException as exc:
        if kubeconfig is not None:
            raise FlexhubError(f"--kubeconfig {kubeconfig}: {one_line(str(exc), 300)}") from None
        raise FlexhubError(
            f"no in-cluster config ({one_line(str(exc), 200).rstrip('.')}: not in a pod with a "
            "service account) and no --kubeconfig: pass --kubeconfig FILE (e.g. ~/.kube/config)"
        ) from None


def provisioner(
    kubeconfig: Annotated[Path | None, _KUBECONFIG] = None,
    config: Annotated[Path | None, _CONFIG] = None,
    leader_elect: Annotated[
        bool, typer.Option(help="only the holder of the Lease provisions")
    ] = True,
    lease_namespace: Annotated[
        str, typer.Option(help="namespace of the Lease (default: the pod's)")
    ] = "",
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error")] = "info",
    workers: Annotated[int, typer.Option(min=1, max=64, help="claims and PVs synced at once")] = 4,
) -> int:
    """Make a PV for every claim of a StorageClass whose provisioner is flexhub, and reclaim
    its storage when the PV is released (logs to stderr; runs until SIGTERM)."""
    from flexhub.provisioner.service import run_provisioner

    with _api_config(kubeconfig):
        return run_provisioner(kubeconfig, config, leader_elect, lease_namespace,
                               log_level=log_level, workers=workers)  # fmt: skip


def provisioner_seal(
    volumes: Annotated[list[str], typer.Argument(help="PV names, checked by you first")],
    kubeconfig: Annotated[Path | None, _KUBECONFIG] = None,
    namespace: Annotated[
        str, typer.Option(help="the provisioner's namespace, where its key Secret is")
    ] = "flexhub-system",
) -> None:
    """Seal PVs with the provisioner's key after you checked their options and reclaim
    record (PVs made by a flexhub that did not seal them, or edited on purpose): until then
    the provisioner refuses to reclaim or grow their storage with its own rights."""
    from flexhub.errors import FlexhubError
    from flexhub.provisioner.service import seal_volumes

    try:
        with _api_config(kubeconfig):
            lines = seal_volumes(kubeconfig, volumes, namespace)
        for line in lines:
            typer.echo(line)
    except FlexhubError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def node_agent(
    node: Annotated[str, typer.Option(help="this node's name (default: $NODE_NAME)")] = "",
    kubeconfig: Annotated[Path | None, _KUBECONFIG] = None,
    config: Annotated[Path | None, _CONFIG] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error")] = "info",
) -> int:
    """Reclaim the storage of released PVs that lives on this node (loop files)."""
    from flexhub.provisioner.service import run_node_agent

    with _api_config(kubeconfig):
        return run_node_agent(kubeconfig, config, node or os.environ.get("NODE_NAME", ""),
                              log_level=log_level)  # fmt: skip


def reclaim_volume() -> None:
    """(Hidden: what the DaemonSet's node agent runs in the host through the installed driver.)
    Reclaim one released PV's storage on this node with this node's config: reads
    ``{"backend", "options", "record"}`` on stdin, answers one JSON line."""
    import json
    import sys

    from flexhub.admin.reclaim import MAX_REQUEST, parse_request, reclaim_volume

    try:
        backend, options, record = parse_request(sys.stdin.buffer.read(MAX_REQUEST + 1))
        reclaim_volume(backend, options, record)
    except Exception as exc:  # one line on stdout, whatever failed: stderr goes nowhere
        message = " ".join(str(exc).split())[:400] or type(exc).__name__
        typer.echo(json.dumps({"status": "Failure", "message": message}))
        raise typer.Exit(1) from None
    typer.echo(json.dumps({"status": "Success"}))


def register(app: typer.Typer) -> None:
    app.command()(provisioner)
    app.command("node-agent")(node_agent)
    app.command("provisioner-seal")(provisioner_seal)
    app.command("reclaim-volume", hidden=True)(reclaim_volume)
