"""``flexhub convert``: move FlexVolume PVs of flexhub and their claims onto the CSI driver."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flexhub.errors import FlexhubError

__all__ = ["register"]


def convert(
    claims: Annotated[
        list[str] | None,
        typer.Argument(help="claim names in --namespace (or give --all)", show_default=False),
    ] = None,
    namespace: Annotated[
        str, typer.Option("--namespace", "-n", help="the claims' namespace")
    ] = "default",
    all_claims: Annotated[
        bool,
        typer.Option(
            "--all",
            help="every claim of the namespace bound to a FlexVolume PV of flexhub "
            "(with --rollback: every claim with a saved copy)",
        ),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="check, print every object it would write (YAML)")
    ] = False,
    rollback: Annotated[
        bool, typer.Option("--rollback", help="put the saved FlexVolume PV and claim back")
    ] = False,
    storage_class: Annotated[
        str,
        typer.Option(help="StorageClass of the CSI PV and claim (default: the claim's own)"),
    ] = "",
    backup_namespace: Annotated[
        str,
        typer.Option(help="namespace of the saved copies (ConfigMaps): flexhub's own"),
    ] = "flexhub-system",
    timeout: Annotated[
        float, typer.Option(min=1, help="seconds each wait (a delete, the binding) may take")
    ] = 120.0,
    kubeconfig: Annotated[
        Path | None, typer.Option(help="kubeconfig file (default: the pod's service account)")
    ] = None,
) -> None:
    """Move FlexVolume PVs of flexhub and their bound claims onto the CSI driver
    flexhub.csi.k8s.io: same storage, same name, data untouched (stop the claims' pods first).
    Each claim is saved first (a ConfigMap in --backup-namespace); a rerun after a crash
    carries on; --rollback puts the FlexVolume objects back."""
    from flexhub.cli.provisioning import _api_config as api_config
    from flexhub.convert.kube import Kube, api_error
    from flexhub.convert.steps import Settings, claims_to_convert, run
    from flexhub.provisioner.service import api_client

    if bool(claims) == all_claims:
        typer.echo("error: name the claims, or give --all (not both)", err=True)
        raise typer.Exit(2)
    settings = Settings(
        backup_namespace=backup_namespace,
        storage_class=storage_class,
        dry_run=dry_run,
        timeout=timeout,
    )

    def say(line: str) -> None:
        typer.echo(line)

    try:
        with api_config(kubeconfig):
            kube = Kube(api_client(kubeconfig))
        names = list(claims or [])
        if all_claims:
            names = claims_to_convert(kube, namespace, settings, rollback)
            if not names:
                typer.echo(f"no claim to {'roll back' if rollback else 'convert'} in {namespace}")
                return
        objects = run(kube, namespace, names, settings, rollback, say)
    except FlexhubError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except Exception as exc:
        if type(exc).__name__ != "ApiException":
            raise
        typer.echo(f"error: {api_error(exc)}", err=True)
        raise typer.Exit(1) from None
    if dry_run:
        import yaml

        typer.echo(yaml.safe_dump_all(objects, sort_keys=False), nl=False)


def register(app: typer.Typer) -> None:
    app.command()(convert)
