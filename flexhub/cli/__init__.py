"""The human CLI (typer), loaded only for admin commands, never on the kubelet path."""

from __future__ import annotations

__all__ = ["COMMANDS", "run"]

#: Admin commands; any other first word is treated as a kubelet operation.
COMMANDS = frozenset(
    {
        "backends",
        "schema",
        "validate",
        "version",
        "state",
        "install",
        "uninstall",
        "demo",
        "doctor",
        "daemonset",
        "fence",
        "new-backend",
        "provisioner",
        "node-agent",
        "reclaim-volume",
        "csi",
        "help",
    }
)


def run(args: list[str]) -> int:
    """Run an admin command and return its exit code."""
    from flexhub.cli.app import main

    return main(args)
