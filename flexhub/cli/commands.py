"""The admin commands' names: what ``flexhub/__main__.py`` tells apart from a kubelet
operation, and what the CLI offers a did-you-mean from, without loading typer."""

from __future__ import annotations

__all__ = ["COMMANDS"]

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
        "provisioner-seal",
        "reclaim-volume",
        "csi",
        "convert",
        "help",
    }
)
