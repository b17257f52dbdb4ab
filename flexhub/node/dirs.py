"""Directories made root's alone, whatever the umask: the one mechanism behind
:func:`flexhub.node.statedir.private_dir` and the quick path's log directory
(:mod:`flexhub.driver.quick`), so it imports nothing but ``os``."""

import os

__all__ = ["make_private"]


def make_private(state_dir: str, *names: str) -> str:
    """Make ``state_dir`` (0700) and ``state_dir/names[0]/names[1]/...`` (each 0700) where
    missing, and return the last; missing parents of ``state_dir`` are made 0755.

    ``os.mkdir``'s mode is only narrowed by the umask (``os.makedirs`` would give missing
    parents 0777 less the umask). Existing directories are left as they are.

    :raises OSError: a directory cannot be made.
    """
    missing = []
    parent = os.path.dirname(state_dir)
    while not os.path.lexists(parent) and parent != os.path.dirname(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for directory in reversed(missing):
        _mkdir(directory, 0o755)
    path = state_dir
    _mkdir(path, 0o700)
    for name in names:
        path = os.path.join(path, name)
        _mkdir(path, 0o700)
    return path


def _mkdir(path: str, mode: int) -> None:
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return
