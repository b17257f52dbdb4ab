"""Node services shared by every backend: commands, mounts, locks, the state journal.

Backends reach them through one :class:`~flexhub.node.services.Node` object (``self.node``).
``Node`` is loaded on first use, so that a module of this package (the ``unmount`` fast path,
:mod:`flexhub.node.fastpath`) can be imported without the others.

This package imports nothing of the kubelet path (:mod:`flexhub.driver`), the admin tools, the
CLI, the conformance kit or the provisioner (``tests/core/test_layering.py``).
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: importing typing costs the unmount fast path (re, enum)
if TYPE_CHECKING:
    from typing import Any

    from flexhub.node.services import Node

__all__ = ["Node"]


def __getattr__(name: str) -> Any:
    if name == "Node":
        from flexhub.node.services import Node

        return Node
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
