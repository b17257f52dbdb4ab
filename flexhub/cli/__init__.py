"""The human CLI (typer), loaded only for admin commands, never on the kubelet path."""

from __future__ import annotations

from flexhub.cli.commands import COMMANDS

__all__ = ["COMMANDS", "run"]


def run(args: list[str]) -> int:
    """Run an admin command and return its exit code."""
    from flexhub.cli.app import main

    return main(args)
