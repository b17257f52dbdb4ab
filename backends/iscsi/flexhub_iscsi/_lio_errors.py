"""Part of the remote program (:mod:`flexhub_iscsi._lio_remote`): its two refusals.

Standard library only: this text runs on the target host (python3 3.7 or later).
"""

from __future__ import annotations


class Refused(Exception):
    """The request cannot be done as asked; nothing was changed (one line)."""


class NoRoomLeft(Exception):
    """The change would promise more than the directory's filesystem can hold (one line);
    answered so that the provisioner raises ``NoRoom``."""
