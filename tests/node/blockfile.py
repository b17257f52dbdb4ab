"""A test-only block backend: a plain file bound to a loop device."""

from __future__ import annotations

import os
from pathlib import Path

from flexhub.backend import Attachment, BlockBackend, Volume, VolumeError


def loops_of(runner, path: str) -> list[str]:
    """The loop devices bound to ``path`` (``losetup -j``)."""
    out = runner(["losetup", "-j", path, "-O", "NAME", "-n"]).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


class BlockfileBackend(BlockBackend):
    """``file`` is an existing file; the volume id is its real path."""

    def volume_id(self, volume: Volume) -> str:
        return "blockfile:" + os.path.realpath(volume.options["file"])

    def attach(self, volume: Volume) -> Attachment:
        path = os.path.realpath(volume.options["file"])
        if not Path(path).is_file():
            raise VolumeError(f"backing file {path} does not exist")
        found = loops_of(self.node.runner, path)
        if found:
            return Attachment(found[0], {"file": path, "loop": found[0]})
        device = self.node.runner(["losetup", "-f", "--show", path]).stdout.strip()
        return Attachment(device, {"file": path, "loop": device})

    def detach(self, attachment: Attachment) -> None:
        path = attachment.details.get("file", "")
        # Only detach a loop device that is still bound to our file (it may have been reused).
        for device in loops_of(self.node.runner, path) if path else []:
            self.node.runner(["losetup", "-d", device])

    def expand(self, attachment: Attachment, volume: Volume, new_size: int) -> None:
        path = attachment.details["file"]
        if os.path.getsize(path) < new_size:
            os.truncate(path, new_size)
        self.node.runner(["losetup", "-c", attachment.device])
