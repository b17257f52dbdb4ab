"""A cifs ``mount`` call SIGKILLed while ``mount.cifs`` runs, as kubelet's timeout kills one:
``python killed_mount.py STATE_DIR TARGET``.

The core's real mount path runs (pod record, private credentials file) with a runner that
kills its own process where the ``mount -t cifs`` command would run: what is left on disk is
exactly what a real kill leaves (no CIFS server is needed for that).
"""

from __future__ import annotations

import base64
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from flexhub_cifs import CifsBackend

from flexhub.config import NodeConfig
from flexhub.node import Node
from flexhub.node.runner import Result
from flexhub.node.volumes import mount_volume
from flexhub.volume import Volume


def killing_runner(
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    check: bool = True,
    secrets: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Result:
    if list(argv[:3]) == ["mount", "-t", "cifs"]:
        os.kill(os.getpid(), signal.SIGKILL)
    return Result(tuple(argv), 0, "", "")


def main() -> None:
    state, target = Path(sys.argv[1]), Path(sys.argv[2])
    config = NodeConfig(state_dir=state, log_dir=state / "log")
    node = Node(config, backend="cifs", runner=killing_runner)
    raw = {
        "backend": "cifs",
        "server": "files.example.com",
        "share": "team",
        "kubernetes.io/secret/username": base64.b64encode(b"bob").decode(),
        "kubernetes.io/secret/password": base64.b64encode(b"left-behind-pw").decode(),
    }
    mount_volume(node, CifsBackend(node), target, Volume.from_options(raw, with_pod=True))
    raise SystemExit("the mount was not killed")


if __name__ == "__main__":
    main()
