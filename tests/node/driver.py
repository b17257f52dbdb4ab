"""Run one node operation in a fresh process, as kubelet would: ``driver.py JSON``.

Exit 0 and ``OK`` on success, exit 1 and ``FAIL <message>`` on a FlexhubError.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from blockfile import BlockfileBackend

from flexhub.config import NodeConfig
from flexhub.errors import FlexhubError
from flexhub.node import Node
from flexhub.node.volumes import mount_volume, unmount_volume
from flexhub.volume import Volume


def main() -> int:
    args = json.loads(sys.argv[1])
    config = NodeConfig(
        state_dir=Path(args["state"]),
        log_dir=Path(args["state"]) / "log",  # never the node's /var/log/flexhub
        lock_timeout=float(args.get("lock_timeout", 30)),
        mount_timeout=20,
        unmount_timeout=10,
        command_timeout=60,
    )
    node = Node(config, "blockfile")
    if "start_at" in args:  # line concurrent drivers up on one instant
        time.sleep(max(0.0, float(args["start_at"]) - time.time()))
    backend = BlockfileBackend(node)
    try:
        if args["op"] == "mount":
            volume = Volume(
                options={"backend": "blockfile", "file": args["file"]},
                fs_type=args.get("fs_type", ""),
                read_only=bool(args.get("ro", False)),
                fs_group=args.get("fs_group"),
            )
            mount_volume(node, backend, Path(args["target"]), volume)
        else:
            unmount_volume(node, Path(args["target"]), lambda name: backend)
    except FlexhubError as exc:
        print(f"FAIL {exc}")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
