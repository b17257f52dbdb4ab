"""What the running kernel can mount: ``/proc/filesystems`` and its module tree.

A mount of a filesystem type the kernel does not know fails with ``No such device`` (the
kernel tried to load the module and found none), which reads like a missing device or package.
:func:`missing_filesystem` names the real cause, for a mount's Failure and ``flexhub doctor``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["has_module", "kernel_knows", "missing_filesystem", "missing_module_message"]

#: Output of ``mount`` and its helpers when the kernel lacks the filesystem type.
NO_FILESYSTEM = ("No such device", "unknown filesystem type", "not supported by the system")


def missing_module_message(module: str) -> str:
    """How the operator is told that the running kernel lacks ``module``."""
    return f"the running kernel has no {module} module; modprobe {module}"


def kernel_knows(fs_type: str, proc: Path = Path("/proc")) -> bool:
    """Whether ``fs_type`` is registered with the running kernel (``/proc/filesystems``).

    An unreadable file answers ``True``: never blame the kernel without evidence.
    """
    try:
        text = (proc / "filesystems").read_text("utf-8", errors="replace")
    except OSError:
        return True
    return any(line.split()[-1:] == [fs_type] for line in text.splitlines())


def missing_filesystem(fs_type: str, output: str, proc: Path = Path("/proc")) -> str:
    """The message for a failed mount whose ``output`` says the kernel lacks ``fs_type``, or
    ``""`` when that is not the cause (backends: ``flexhub.backend.kernel_lacks``).

    .. versionadded:: 0.2
    """
    if not any(text in output for text in NO_FILESYSTEM) or kernel_knows(fs_type, proc):
        return ""
    return missing_module_message(fs_type)


def has_module(module: str, root: Path = Path("/")) -> bool:
    """Loaded, built in, or loadable from the running kernel's module tree under ``root``."""
    if (root / "sys/module" / module).is_dir():
        return True
    tree = root / "lib/modules" / os.uname().release
    wanted = module.replace("-", "_")
    for index in ("modules.builtin", "modules.dep"):
        try:
            text = (tree / index).read_text("utf-8", errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            stem = os.path.basename(line.split(":", 1)[0]).split(".ko", 1)[0]
            if stem.replace("-", "_") == wanted:
                return True
    return False
